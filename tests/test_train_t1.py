"""train_t1.py's algorithm pieces: the PPO loss and its optional terms, loss aggregation, the epoch's task draw,
one reward, and the evaluation that counts every trial (rollout.evaluate_trials)."""
import dataclasses
from types import SimpleNamespace
import json
import math
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import critic as C
import data
import model as M
import ppo
import report
import reward
import rollout
import runstate
import train_t1 as T
from cluster import actors
from experiments import bench, training
from rundir import Metrics

ROOT = Path(__file__).resolve().parent.parent


# --- ppo_loss and its aggregation ------------------------------------------------------------------------

def test_ppo_loss_matches_hand_computation_with_behaviour_not_actor():
    """Three tokens of one sample, old (behaviour) != new (actor): ratio 1.5 clipped at 1.2 for A > 0, ratio 0.5
    clipped at 0.8 for A < 0 (the pessimistic branch is the clipped one there), one unclipped; a 4th token m = 0."""
    logp = torch.tensor([[math.log(0.3), math.log(0.1), math.log(0.5), 0.0]])
    old = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.5), -3.0]])
    adv = torch.tensor([[2.0, -1.0, 0.5, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # token 0: r = 1.5, A = 2: min(3.0, 1.2 * 2 = 2.4) = 2.4 -> loss -2.4
    # token 1: r = 0.5, A = -1: min(-0.5, 0.8 * -1 = -0.8) = -0.8 -> loss 0.8
    # token 2: r = 1, A = 0.5 -> loss -0.5
    want = (-2.4 + 0.8 - 0.5) / 3
    got = ppo.ppo_loss(logp, old, adv, mask, 0.2, "token")
    assert got.item() == pytest.approx(want, abs=1e-6)
    assert ppo.ppo_loss(logp, old, adv, mask, 0.2, "sample").item() == pytest.approx(want, abs=1e-6)  # one sample


def test_loss_aggregation_token_vs_sample_by_hand():
    """Sample 0 has 3 loss tokens of loss 1, sample 1 one token of loss 5: per token (3 + 5) / 4 = 2, per sample
    (1 + 5) / 2 = 3; a sample without loss tokens counts in neither; n overrides the denominator."""
    x = torch.tensor([[1.0, 1.0, 1.0, 9.0], [5.0, 9.0, 9.0, 9.0], [7.0, 7.0, 7.0, 7.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert C.aggregate(x, m, "token").item() == pytest.approx(2.0)
    assert C.aggregate(x, m, "sample").item() == pytest.approx(3.0)
    assert C.aggregate(x, m, "sample", torch.tensor(4.0)).item() == pytest.approx(1.5)  # (1 + 5) / 4 samples
    with pytest.raises(ValueError, match="token|sample"):
        C.aggregate(x, m, "seq")


@pytest.mark.parametrize("agg", ["token", "sample"])
def test_aggregation_over_ranks_sums_to_the_one_rank_value(agg):
    """Data parallel: each rank's rows divided by the minibatch's global count (tokens or samples) sum to the
    one-rank value, as critic.agg_count gives it over a group (a row without loss tokens counts nowhere)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    m = (torch.rand(5, 7, generator=g) < 0.5).float()
    m[2] = 0
    whole = C.aggregate(x, m, agg)
    n = m.sum() if agg == "token" else (m.sum(-1) > 0).sum().float()
    parts = [C.aggregate(x[r::2], m[r::2], agg, n) for r in range(2)]  # rank r holds rows r, r + 2, ...
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_value_loss_sample_aggregation_by_hand():
    """0.5 * max(unclipped, clipped) squared errors, per sample then over samples."""
    old = torch.zeros(2, 3)
    values = torch.tensor([[0.1, 0.5, 0.0], [0.3, 0.0, 0.0]])  # 0.5 is clipped to 0.2 around V_old = 0
    returns = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    e00 = max(0.9 ** 2, 0.9 ** 2)  # v = 0.1: inside the clip
    e01 = max(0.5 ** 2, 0.8 ** 2)  # v = 0.5 -> clipped 0.2: (0.2 - 1)^2 = 0.64 is larger
    e10 = max(0.3 ** 2, 0.2 ** 2)
    token, _ = C.value_loss(values, old, returns, mask, 0.2, agg="token")
    sample, clipfrac = C.value_loss(values, old, returns, mask, 0.2, agg="sample")
    assert token.item() == pytest.approx(0.5 * (e00 + e01 + e10) / 3)
    assert sample.item() == pytest.approx(0.5 * ((e00 + e01) / 2 + e10) / 2)
    assert clipfrac.item() == pytest.approx(2 / 3)  # 0.5 and 0.3 moved more than 0.2: a per-token fraction


# --- the optional loss terms (all off in the paper) --------------------------------------------------------

def test_kl_k3_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.2)])
    ref = torch.tensor([math.log(0.25), math.log(0.2)])
    # k3 = r - log r - 1 with r = pi_ref / pi: r = 0.5 -> 0.5 + log 2 - 1; r = 1 -> 0
    assert torch.allclose(ppo.kl_k3(logp, ref), torch.tensor([0.5 + math.log(2) - 1, 0.0]), atol=1e-6)


def test_kl_k3_is_bounded_in_slope_beyond_its_knee():
    """Beyond log(pi_ref / pi) = KL_K3_LINEAR_BEYOND, k3 follows its tangent: value and gradient continuous at the
    knee, the gradient never steeper than there (exact k3 would give e^20 at log r = 20), still pulling to pi_ref."""
    c = ppo.KL_K3_LINEAR_BEYOND
    ref = torch.zeros(4)
    logp = torch.tensor([-c + 1e-4, -c - 1e-4, -5.0, -20.0], requires_grad=True)  # log r just below / above c, far
    k = ppo.kl_k3(logp, ref)
    k.sum().backward()
    exact = lambda lr: math.exp(lr) - lr - 1
    assert k[0].item() == pytest.approx(exact(c - 1e-4), rel=1e-5)
    assert k[1].item() == pytest.approx(exact(c) + (math.exp(c) - 1) * 1e-4, rel=1e-5)
    assert k[3].item() == pytest.approx(exact(c) + (math.exp(c) - 1) * (20 - c), rel=1e-5)
    slope = math.exp(c) - 1  # d k3 / d log r at the knee; d / d logp = -slope
    assert logp.grad.tolist() == pytest.approx([-slope, -slope, -slope, -slope], rel=1e-3)
    assert (ppo.kl_k3(torch.tensor([0.0, 3.0]), torch.tensor([0.0, -30.0])) >= 0).all()  # pi >> pi_ref: exact, >= 0


def test_load_balancing_loss_matches_transformers():
    """Our aux loss on one layer equals HF's load_balancing_loss_func (what router_aux_loss_coef scales)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    torch.manual_seed(0)
    B, S, E, k = 2, 5, 8, 2
    logits = torch.randn(B * S, E)
    idx = torch.topk(torch.softmax(logits, -1), k, -1).indices
    am = torch.ones(B, S)
    am[1, 3:] = 0
    ours = ppo.load_balancing_loss([logits], [idx], am)
    theirs = load_balancing_loss_func((logits,), E, k, am)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    uniform = ppo.load_balancing_loss([torch.zeros(4, E)], [torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])],
                                    torch.ones(4))
    assert uniform.item() == pytest.approx(k)  # a balanced router: aux = k


@pytest.fixture(scope="module")
def tiny():
    cfg = M.tiny_config(64)
    actor = M.build_actor(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    B, Tn = 4, 10
    ids = torch.randint(0, 64, (B, Tn), generator=g)
    am = torch.ones(B, Tn, dtype=torch.long)
    am[3, 7:] = 0
    mask = torch.zeros(B, Tn)
    mask[:, 3:7] = 1
    mask[0, 8:] = 1
    batch = {"input_ids": ids, "attention_mask": am, "mask": mask, "experts": None}
    with torch.no_grad():
        old = ppo.token_logprobs(actor, batch) + 0.05 * torch.randn(B, Tn, generator=g)  # behaviour != actor
        ref = ppo.token_logprobs(actor, batch) - 0.1 * torch.rand(B, Tn, generator=g)
    adv = torch.randn(B, Tn, generator=g) * mask
    return actor, batch, old, ref, adv


def _update(tiny, padded=False, **over):
    actor0, batch, old, ref, adv = tiny
    actor = M.build_actor(actor0.config, seed=0)
    actor.load_state_dict(actor0.state_dict())
    args = dataclasses.replace(T.Args(), minibatch_size=2, ppo_epochs=1, r3_mode="off", actor_lr=1e-3, **over)
    opt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr)
    stats = ppo.ppo_update(actor, opt, batch, adv, old, args, random.Random(0), 4, None, ref, padded)
    return actor.state_dict(), stats


def _reference_update(tiny):
    """The PPO update as it was before the optional terms (plain per-token clipped surrogate, nothing else)."""
    actor0, batch, old, _, adv = tiny
    actor = M.build_actor(actor0.config, seed=0)
    actor.load_state_dict(actor0.state_dict())
    opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
    actor.train()
    for mb in ppo.minibatches(4, 2, random.Random(0)):
        m = batch["mask"][mb]
        opt.zero_grad()
        lp = ppo.token_logprobs(actor, batch, 1.0, rows=mb)
        ratio = (lp - old[mb]).exp()
        loss = C.masked_mean(torch.max(-adv[mb] * ratio, -adv[mb] * torch.clamp(ratio, 0.8, 1.2)), m)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        opt.step()
    return actor.state_dict()


def test_zero_coefficients_leave_the_update_bit_identical(tiny):
    """The padded update (one forward per minibatch; the row-by-row default against it: tests/test_update.py)."""
    got, stats = _update(tiny, padded=True)
    want = _reference_update(tiny)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert stats["losses/kl"] == stats["losses/entropy"] == stats["losses/aux"] == 0.0


@pytest.mark.parametrize("flag,metric", [("kl_coef", "losses/kl"), ("entropy_coef", "losses/entropy"),
                                         ("aux_loss_coef", "losses/aux")])
def test_nonzero_coefficient_changes_the_update(tiny, flag, metric):
    base, _ = _update(tiny)
    got, stats = _update(tiny, **{flag: 0.5})
    assert stats[metric] > 0  # k3 >= 0 (ref != actor), entropy > 0, aux ~ k
    assert any(not torch.equal(got[k], base[k]) for k in base)
    if flag == "aux_loss_coef":  # the routers get the balancing gradient
        gates = [k for k in base if k.endswith("mlp.gate.weight")]
        assert gates and any(not torch.equal(got[k], base[k]) for k in gates)


def test_sample_aggregation_changes_the_update(tiny):
    base, _ = _update(tiny)
    got, _ = _update(tiny, loss_agg="sample")  # row 0 has 6 loss tokens, the others 4: weights differ
    assert any(not torch.equal(got[k], base[k]) for k in base)


def test_step_forwards_by_length_match_the_padded_batch(tiny_sft):
    """train_step's no-grad forwards run in chunks of similar length, each cut after its longest row (ppo.by_length),
    and a minibatch is cut after its longest row (ppo.trim): on every row's tokens the same values as one forward of
    the right-padded batch (V_old, old logprobs with R3 replay, R3 off, the expert-set mismatch)."""
    import r3
    actor, _ = M.load_actor(tiny_sft.sft)
    critic = C.Critic.from_actor(actor, "default")  # a random head: values that differ per position
    samples = tiny_sft.samples[::-1]  # the longest first: the chunks reorder the rows
    batch = ppo.pad_batch(samples, 20.0, replay=True)
    am = batch["attention_mask"].bool()
    sub, n = C.trim(batch, [5, 6])  # rows of 23 and 20 tokens in a batch 38 wide
    assert n == 23 and sub["input_ids"].shape == (2, 23) and sub["experts"].shape[:2] == (2, 23)
    assert C.trim(batch, [])[1] == batch["input_ids"].shape[1]  # a rank with no rows keeps the full width
    with torch.no_grad():
        pairs = [(ppo.forward_logprobs(actor, batch, mode, 1.0),
                  ppo.by_length(lambda b: ppo.forward_logprobs(actor, b, mode, 1.0), batch, budget=70))
                 for mode in ("replay", "off")]
        pairs.append((C.compute_values(critic, batch["input_ids"], batch["attention_mask"]),
                      ppo.by_length(lambda b: C.compute_values(critic, b["input_ids"], b["attention_mask"]), batch,
                                    70)))
    for full, chunked in pairs:
        assert chunked.shape == full.shape and not chunked[~am].any()  # zero after each row's tokens
        assert (chunked - full)[am].abs().max() < 1e-5
    flipped = batch["experts"].clone()
    flipped[..., 0] = (flipped[..., 0] + 1) % actor.config.num_experts  # a recorded set live routing will not pick
    for experts in (batch["experts"], flipped):
        counts = [0, 0]
        for rows in ([0, 1, 2], [3, 4, 5, 6]):
            s, _ = C.trim({**batch, "experts": experts}, rows)
            with r3.routing(actor, "record") as rec, torch.no_grad():
                actor(input_ids=s["input_ids"], attention_mask=s["attention_mask"])
                counts = np.add(counts, r3.mismatch_counts(rec.experts, s["experts"], s["attention_mask"], s["mask"]))
        assert counts[0] / counts[1] == pytest.approx(r3.mismatch(actor, batch["input_ids"], batch["attention_mask"],
                                                                  experts, batch["mask"]))
    assert counts[0] > 0


def test_check_args_refuses_bad_loss_flags():
    a = T.EMBEDDED
    with pytest.raises(ValueError, match="--loss-agg"):
        T.check_args(dataclasses.replace(a, loss_agg="seq"))
    for flag in ("kl_coef", "entropy_coef", "aux_loss_coef"):
        for bad in (-0.1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
                T.check_args(dataclasses.replace(a, **{flag: bad}))
        with pytest.raises(NotImplementedError, match="--" + flag.replace("_", "-") + ".*megatron"):
            T.check_args(dataclasses.replace(a, backend="megatron", **{flag: 0.1}))
    T.check_args(dataclasses.replace(a, loss_agg="sample", kl_coef=0.1))


def test_parse_args_takes_the_new_flags():
    a = T.parse_args(["--loss-agg", "sample", "--kl-coef", "0.05", "--eval-verifier-timeout-s", "30"])
    assert (a.loss_agg, a.kl_coef, a.eval_verifier_timeout_s) == ("sample", 0.05, 30.0)


# --- an epoch launches the whole pool --------------------------------------------------------------------

@pytest.mark.parametrize("n_pool,n_launch", [(10, 4), (7, 7), (5, 12), (120, 36)])
def test_every_task_is_launched_once_per_epoch(n_pool, n_launch):
    pool = [f"task{i}" for i in range(n_pool)]
    steps = 3 * n_pool  # covers n_launch * steps / n_pool >= 3 epochs
    stream = [t for s in range(1, steps + 1) for t in data.launch_tasks(pool, s, n_launch, seed=1)]
    assert all(len(data.launch_tasks(pool, s, n_launch, 1)) == n_launch for s in (1, 2, steps))  # no short step
    for e in range(len(stream) // n_pool):
        assert Counter(stream[e * n_pool:(e + 1) * n_pool]) == Counter(pool), f"epoch {e}"
    orders = [stream[e * n_pool:(e + 1) * n_pool] for e in range(2)]
    assert n_pool < 5 or orders[0] != orders[1]  # reshuffled per epoch


# --- one reward ----------------------------------------------------------------------------------------------

def _sample(P, scale, n=8, reward=None):
    mask = np.zeros(n, dtype=np.int8)
    mask[3:6] = 1
    return {"task": f"t{P}", "tokens": np.arange(n), "loss_mask": mask, "rollout_logprobs": np.zeros(n),
            "routed_experts": None, "passed": P, "total": 10, "reward_source": "ctrf",
            "reward": P / scale if reward is None else reward, "weight_version": 0, "turns": 1}


def test_train_step_logs_the_reward_it_trains_on(tmp_path, tiny):
    actor0 = tiny[0]
    actor, behaviour = (M.build_actor(actor0.config, seed=0) for _ in range(2))
    critic = C.Critic.from_actor(actor)
    args = dataclasses.replace(T.Args(), reward_scale=10.0, minibatch_size=2, r3_mode="off")
    samples = [_sample(P, 10.0) for P in (0, 3, 7)]
    stats = ppo.train_step(actor, behaviour, critic, torch.optim.Adam(actor.parameters()),
                         torch.optim.Adam(critic.parameters()), samples, args, random.Random(0), tmp_path, 1)
    assert stats["reward_mean"] == pytest.approx((0 + 0.3 + 0.7) / 3)
    batch = ppo.pad_batch(samples, 10.0)
    assert stats["reward_mean"] == pytest.approx(float(batch["rewards"].sum(1).mean()))
    assert math.isfinite(stats["explained_variance_traj"])  # three trajectories, rewards 0 / 0.3 / 0.7


# --- the comparison arms of the paper: binary reward, GRPO -------------------------------------------------------

def test_binary_reward_is_one_only_when_every_test_passed():
    samples = [_sample(P, 10.0) for P in (0, 3, 10)]  # total 10
    assert [ppo.trained_reward(s, "binary") for s in samples] == [0.0, 0.0, 1.0]
    assert [ppo.trained_reward(s) for s in samples] == [0.0, 0.3, 1.0]  # dense: r = P / S
    assert ppo.pad_batch(samples, 10.0, reward_mode="binary")["rewards"].sum(1).tolist() == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="--reward-mode"):
        ppo.trained_reward(samples[0], "pass-rate")


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    adv = ppo.grpo_advantages(r, [[0, 1, 2], [3], [4, 5]])
    sd = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # Bessel: n - 1 = 2
    assert adv[:3].tolist() == pytest.approx([(2 / 3) / sd, -(1 / 3) / sd, -(1 / 3) / sd], rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # a group of one; a group where every sample failed: no signal
    samples = [dict(_sample(1, 10.0), task=t) for t in ("a", "b", "a", "c", "b")]
    assert ppo.task_groups(samples) == [[0, 2], [1, 4], [3]]
    unnamed = [{k: v for k, v in s.items() if k != "task"} for s in samples[:2]]
    assert ppo.task_groups(unnamed) == [[0], [1]]  # the statistic only: each its own group
    with pytest.raises(ValueError, match="grpo: sample 0 carries no task name"):
        ppo.task_groups(unnamed, required=True)


def test_launch_repeats_each_task_per_task_times():
    pool = [f"task{i}" for i in range(10)]
    got = data.launch_tasks(pool, 2, 3, seed=1, per_task=4)
    assert len(got) == 12 and got == [t for t in data.launch_tasks(pool, 2, 3, seed=1) for _ in range(4)]


def test_grpo_step_trains_the_actor_and_leaves_the_critic_alone(tmp_path, tiny):
    actor0 = tiny[0]
    actor, behaviour = (M.build_actor(actor0.config, seed=0) for _ in range(2))
    critic = C.Critic.from_actor(actor)
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    critic_before = {k: v.clone() for k, v in critic.state_dict().items()}
    args = dataclasses.replace(T.Args(), reward_scale=10.0, minibatch_size=2, r3_mode="off", actor_lr=1e-3,
                               advantage="grpo", samples_per_task=2)
    samples = [dict(_sample(P, 10.0), task=t) for P, t in ((0, "a"), (7, "a"), (0, "b"), (0, "b"))]
    stats = ppo.train_step(actor, behaviour, critic, torch.optim.Adam(actor.parameters(), lr=1e-3),
                           torch.optim.Adam(critic.parameters(), lr=1e-3), samples, args, random.Random(0), tmp_path, 1)
    assert math.isnan(stats["explained_variance"]) and stats["all_fail_group_frac"] == 0.5  # group b: all fail
    assert all(torch.equal(critic.state_dict()[k], v) for k, v in critic_before.items())
    assert any(not torch.equal(actor.state_dict()[k], v) for k, v in before.items())


def test_check_args_refuses_bad_arm_flags():
    a = T.EMBEDDED
    for flag, bad in (("reward_mode", "pass-rate"), ("advantage", "rloo"), ("expert_text", "short")):
        with pytest.raises(ValueError, match="--" + flag.replace("_", "-")):
            T.check_args(dataclasses.replace(a, **{flag: bad}))
    with pytest.raises(ValueError, match="--samples-per-task: 5 must divide --n-launch 36"):
        T.check_args(dataclasses.replace(a, samples_per_task=5))
    with pytest.raises(ValueError, match="--advantage grpo: needs --samples-per-task >= 2"):
        T.check_args(dataclasses.replace(a, advantage="grpo"))
    T.check_args(dataclasses.replace(a, advantage="grpo", samples_per_task=4, reward_mode="binary"))
    with pytest.raises(ValueError, match="--critic-head-init"):
        T.check_args(dataclasses.replace(a, critic_head_init="xavier"))
    with pytest.raises(NotImplementedError, match="--critic-head-init default with --backend megatron"):
        T.check_args(dataclasses.replace(a, critic_head_init="default", backend="megatron"))
    T.check_args(dataclasses.replace(a, critic_head_init="default"))


def test_pad_batch_refuses_a_reward_scored_with_another_scale():
    with pytest.raises(ValueError, match="another S"):
        ppo.pad_batch([_sample(4, 20.0)], 10.0)  # r = 4 / 20 computed with S = 20, the run's S is 10
    assert ppo.pad_batch([_sample(4, 10.0)], 10.0)["rewards"].sum().item() == pytest.approx(0.4)


needs_jail = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"),
                                reason="the bubblewrap sandbox needs root and bwrap")


def _task(root, verify_sleep=0):
    d = root / "three-asserts"
    for sub in ("environment/app", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "task.toml").write_text("[verifier]\ntimeout_sec = 60\n\n[agent]\ntimeout_sec = 60\n")
    (d / "instruction.md").write_text("Write ok to /app/out.txt.\n")
    (d / "tests/test_outputs.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n\n\n"
                                             "def test_c():\n    assert open('/app/out.txt').read() == 'ok\\n'\n")
    (d / "tests/test.sh").write_text(f"#!/bin/bash\nsleep {verify_sleep}\nmkdir -p /logs/verifier\n"
                                     "pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py\n")
    (d / "solution/solve.sh").write_text("#!/bin/bash\necho ok > /app/out.txt\n")
    return d


@needs_jail
def test_reward_scale_reaches_the_verifier_reward(tmp_path):
    task = _task(tmp_path)
    res = rollout.run_trial(task, "oracle", reward_scale=10.0)
    assert res["exit_reason"] == "oracle", res["error"]
    assert (res["passed"], res["reward"], res["reward_scale"]) == (3, 3 / 10, 10.0)  # r = P / S with S = 10
    assert rollout.run_trial(task, "oracle")["reward"] == 3 / 20  # the paper's S by default


@needs_jail
def test_evaluation_verifier_timeout_replaces_the_tasks(tmp_path):
    task = _task(tmp_path, verify_sleep=4)
    res = rollout.run_trial(task, "oracle", limits={"verifier_timeout_s": 1.0})
    assert (res["reward"], res["reward_source"]) == (0.0, "none")  # killed at 1 s, before its report
    assert rollout.run_trial(task, "oracle")["reward"] == 3 / 20  # the task's 60 s


# --- evaluation counts every trial ------------------------------------------------------------------------------

def _result(task, reward=0.5, resolved=False, exit_reason="task_complete", error=None, turns=2):
    return {"task": task, "reward": reward, "resolved": resolved, "exit_reason": exit_reason, "error": error,
            "turns": turns}


def test_evaluate_trials_counts_failed_and_missing_trials_as_zero():
    tasks = ["/x/a", "/x/b", "/x/c"]

    def run_attempt(dirs, k):
        out = [_result("a", 1.0, True), _result("b", 0.9, True, "error", "RuntimeError: sandbox died")]
        return out if k == 0 else out[:1]  # attempt 1: b and c never came back
    rep = rollout.evaluate_trials(tasks, run_attempt, 2)
    assert rep["n_trials"] == 6 and rep["n_tasks"] == 3 and rep["attempts"] == 2
    assert rep["solve_rate"] == pytest.approx(2 / 6) and rep["reward_mean"] == pytest.approx(2.0 / 6)
    assert rep["n_errors"] == 4
    assert {(e["task"], e["attempt"]) for e in rep["errors"]} == {("b", 0), ("c", 0), ("b", 1), ("c", 1)}
    assert "sandbox died" in [e for e in rep["errors"] if e["task"] == "b"][0]["error"]


def test_evaluate_trials_refuses_foreign_or_duplicate_results():
    with pytest.raises(ValueError, match="not one of the tasks"):
        rollout.evaluate_trials(["/x/a"], lambda d, k: [_result("zzz")], 1)
    with pytest.raises(ValueError, match="duplicate"):
        rollout.evaluate_trials(["/x/a"], lambda d, k: [_result("a"), _result("a")], 1)
    with pytest.raises(ValueError, match="attempts"):
        rollout.evaluate_trials(["/x/a"], lambda d, k: [], 0)


def test_train_t1_evaluate_counts_dropped_trials(monkeypatch, tmp_path):
    """runstate.evaluate: a trial that errored (run_rollouts' dropped) is a 0 in the denominator, with the
    protocol's sampling and limits."""
    seen = []

    def fake_run_rollouts(dirs, agent, args, run_dir, tok, workers, urls, **kw):
        seen.append(kw)
        kept = [_result("a", 0.6, True)]
        return kept, [{"task": "b", "seconds": 1.0, "reason": "OSError: no space left"}], 1.0
    monkeypatch.setattr(actors, "run_rollouts", fake_run_rollouts)
    args = dataclasses.replace(T.Args(), eval_attempts=3)
    rep = runstate.evaluate(["/x/a", "/x/b"], args, tmp_path, None, None, None, "test")
    assert rep["n_trials"] == 6 and rep["n_errors"] == 3
    assert rep["solve_rate"] == pytest.approx(0.5) and rep["reward_mean"] == pytest.approx(0.3)
    assert seen[0]["temperature"] == 0.1 and seen[0]["top_p"] == 0.95
    assert seen[0]["limits"] == {"max_turns": 60, "trial_timeout_s": 3600.0, "agent_timeout_s": 3600.0,
                                 "verifier_timeout_s": 900.0}


def test_one_source_for_the_evaluation_protocol():
    a = T.Args()
    assert (a.eval_temperature, a.eval_top_p, a.eval_attempts, a.eval_max_turns, a.eval_agent_timeout_s,
            a.eval_verifier_timeout_s) == tuple(rollout.EVAL[k] for k in (
                "temperature", "top_p", "attempts", "max_turns", "agent_timeout_s", "verifier_timeout_s"))
    assert rollout.EVAL == {"harness": "terminus-2", "max_turns": 60, "agent_timeout_s": 3600.0,
                            "verifier_timeout_s": 900.0, "temperature": 0.1, "top_p": 0.95, "attempts": 3}


def test_args_literal_defaults_equal_their_sources():
    """Args writes the paper's values literally (its module loads before torch, so --help answers at once); each
    equals the one source it stands for."""
    a = T.Args()
    assert a.trial_timeout_s == rollout.EVAL["agent_timeout_s"] and a.reward_scale == float(reward.SCALE)
    assert (a.base_lr, a.base_batch_size) == (ppo.BASE_LR, ppo.BASE_BATCH)


def test_help_answers_before_torch_loads_with_a_line_and_default_for_every_flag():
    """`python train_t1.py --help` parses before the heavy imports: torch is not loaded when it answers; every Args
    field is a flag whose help line is its comment in Args plus the embedded preset's value."""
    code = ("import runpy, sys\nsys.argv = ['train_t1.py', '--help']\ntry:\n    runpy.run_path('train_t1.py', "
            "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "TORCH False" in out.stdout, out.stderr[-2000:]
    helps = T.field_help()
    assert set(helps) == {f.name for f in dataclasses.fields(T.Args)} and all(helps.values())
    text = " ".join(out.stdout.split())
    for f in dataclasses.fields(T.Args):
        assert f"--{f.name.replace('_', '-')}" in text and f"(default: {getattr(T.EMBEDDED, f.name)!r})" in text
    assert "(paper: 0.1) (default: 0.1)" in text and "(paper: 1.0e-6, constant) (default: 0.0001)" in text


def test_model_vocab_is_padded_to_the_tensor_parallel_size_under_megatron():
    """A tokenizer of 673 tokens (seen in a loaded test run: the audit redrew tasks) crashed the Megatron TP = 2 trainer
    (VocabParallelEmbedding: 673 is not divisible by 2): warm_start pads it to tp (1 on the hf backend)."""
    assert M.padded_vocab(673, 2) == 674 and M.padded_vocab(674, 2) == 674 and M.padded_vocab(673, 4) == 676
    assert M.padded_vocab(673, 1) == 673  # hf: unchanged


def test_sft_batches_its_samples_in_task_order_not_finishing_order(tmp_path, monkeypatch):
    """warm_start hands the SFT data to TITO (and so to SFT's seeded minibatches) in task order, whatever order the
    concurrent scripted trials finished in: the seed alone fixes the batches (finishing order made two runs of one
    seed on the same data reach held-out 0.593 and 0.773)."""
    train, held = data.generate_tasks(tmp_path / "tasks", 6, 1, seed=3, validate_tasks=False)
    args = dataclasses.replace(T.QUICK, run_dir=str(tmp_path / "run"), n_sft_tasks=0, base_steps=0, sft_faults=0.0)
    run = runstate.Run(args)
    got = []
    monkeypatch.setattr(actors, "run_rollouts", lambda pool, *a, **k: ([{"task": os.path.basename(str(d)),
                                                                     "resolved": True} for d in reversed(pool)],
                                                                   [], 0.0))
    monkeypatch.setattr(rollout, "to_samples", lambda trials, *a: got.append([t["task"] for t in trials]) or [])
    monkeypatch.setattr(ppo, "sft", lambda *a, **k: None)
    T.warm_start(run, train, held)
    assert got == [sorted(os.path.basename(str(d)) for d in train)] and got[0] != [os.path.basename(d) for d in
                                                                                    reversed(train)]


def test_s_is_the_pools_90th_percentile_and_fixed_for_the_run(tmp_path):
    """The paper's rule for S (about the 90th percentile of the pool's assertion counts) on a generated pool, recorded
    in the run's state; a resume with another S is refused; a task without a count cannot set S."""
    train, _ = data.generate_tasks(tmp_path / "tasks", 12, 0, seed=3, validate_tasks=False)
    counts = sorted(int(open(os.path.join(d, "task.toml")).read().split("n_assertions = ")[1].split()[0])
                    for d in train)
    s = data.pool_scale(train)
    assert s == counts[math.ceil(0.9 * len(counts)) - 1] and counts[0] <= s <= counts[-1]
    assert data.pool_scale(train, q=1.0) == counts[-1]
    state = {}
    assert runstate.run_scale(dataclasses.replace(T.QUICK), state, train) == s == state["reward_scale"]
    assert runstate.run_scale(dataclasses.replace(T.QUICK), state, train) == s  # a resume: the same S
    with pytest.raises(ValueError, match="S is fixed for the whole run"):
        runstate.run_scale(dataclasses.replace(T.QUICK, reward_scale_from_pool=False, reward_scale=20.0), state, train)
    paper_s = runstate.run_scale(dataclasses.replace(T.QUICK, reward_scale_from_pool=False), {}, train)
    assert paper_s == 20.0  # the paper's S
    assert T.parse_args(["--reward-scale", "7"]).reward_scale_from_pool is False  # an S given by hand wins
    assert T.parse_args([]).reward_scale_from_pool is True  # the embedded preset: the pool's rule
    toml = os.path.join(train[0], "task.toml")
    text = open(toml).read()
    open(toml, "w").write("\n".join(l for l in text.splitlines() if not l.startswith("n_assertions")) + "\n")
    with pytest.raises(ValueError, match="no assertion count"):
        data.pool_scale(train)


# --- the base phase: copy samples and the copy gate --------------------------------------------------------

def test_copy_samples_mask_the_reply_and_mark_the_copied_items():
    texts = ["mkdir maple42_dir", "cp onyx17.txt grove88.txt maple42_dir/", "wc -w < notes.txt > out.txt"]
    tok = M.train_tokenizer(texts * 5, vocab_size=300)
    items = data.copy_items(texts)
    assert "maple42_dir/" in items and "<" in items
    longer = data.copy_items(["juniper45_data/willow15/dune19.txt " + "x" * 64], max_chars=64)  # a longer cap
    assert "juniper45_data/willow15/dune19.txt" in longer and "x" * 64 not in longer
    assert data.copy_items(["juniper45_data/willow15/dune19.txt"]) == []  # the default leaves nested paths out
    samples = data.copy_samples(tok, items, 20, seed=3)
    assert [s["tokens"] for s in samples] == [s["tokens"] for s in data.copy_samples(tok, items, 20, seed=3)]
    for s in samples:
        toks, mask = s["tokens"], s["loss_mask"]
        assert len(toks) == len(mask) == len(s["rollout_logprobs"])
        listed = tok.decode(toks[:len(toks) - sum(mask)]).split("list: ")[1].split("<|im_end|>")[0]
        assert tok.decode([t for t, m in zip(toks, mask) if m]) == f"copy: {listed}<|im_end|>"
        assert tok.decode(toks[s["copy_from"]:-1]) == " " + listed  # the copied items, no cue, no <|im_end|>
        assert 3 <= len(listed.split()) <= 8 and set(listed.split()) <= set(items)
    with pytest.raises(ValueError, match="copy_samples: need items"):
        data.copy_samples(tok, [], 4, seed=0)


def test_base_phase_teaches_copying_and_the_gate_measures_it(tmp_path):
    """100 base steps on copy samples lift greedy copy accuracy on unseen samples from chance (< .05) to above .2
    (measured: 0.39 at step 100 and .99 at step 1000 with qwen3_moe, results/LOG.md); the gate counts only copied
    tokens (a model that always says the cue scores 0 there)."""
    texts = [" ".join(f"{w}{i}" for w in ("maple", "onyx", "grove", "cedar", "lumen")) for i in range(10, 60)]
    tok = M.train_tokenizer(texts, vocab_size=400)
    items = data.copy_items(texts)
    actor = M.build_actor(M.tiny_config(M.padded_vocab(len(tok), 1), "qwen3_moe"), seed=0)
    probe = data.copy_samples(tok, items, 32, seed=-1)
    before = ppo.copy_accuracy(actor, probe)
    args = dataclasses.replace(T.QUICK, seed=0)
    ppo.sft(actor, data.copy_samples(tok, items, 100 * ppo.BASE_BATCH, seed=0), args, Metrics(tmp_path),
            phase="base", epochs=1, lr=ppo.BASE_LR, batch_size=ppo.BASE_BATCH)
    after = ppo.copy_accuracy(actor, probe)
    assert before < 0.05 and after > 0.2, (before, after)


def test_base_phase_runs_on_to_the_gate_within_its_cap(tmp_path, monkeypatch):
    """--base-max-steps: below the copy gate after base_steps the base phase adds chunks of base_steps / 4 while a
    probe reads < COPY_GATE and the cap allows (the reported gate is a second probe); still below it at the cap it
    says WARNING; at 0 it trains exactly base_steps. A reading is two, corpus pieces and random names never
    trained on, both needed when names are trained on (the corpus alone at --base-name-share 0). The probe
    readings are scripted here (the arithmetic of copying is the test above's); each chunk really trains."""
    texts = [" ".join(f"{w}{i}" for w in ("maple", "onyx", "grove")) for i in range(10, 30)]
    tok = M.train_tokenizer(texts, vocab_size=300)

    def run_base(max_steps, readings, share=0.5):
        actor = M.build_actor(M.tiny_config(M.padded_vocab(len(tok), 1), "qwen3_moe"), seed=0)
        reads = iter(readings)
        monkeypatch.setattr(ppo, "copy_accuracy", lambda a, s: next(reads))
        run = SimpleNamespace(args=dataclasses.replace(T.QUICK, seed=0, base_steps=8, base_max_steps=max_steps,
                                                       base_name_share=share, base_batch_size=2),  # steps counted
                              metrics=Metrics(tmp_path), dir=tmp_path)
        before = [p.detach().clone() for p in actor.parameters()]
        gate = T.base_phase(run, actor, tok, texts)
        moved = max((p - b).abs().max().item() for p, b in zip(actor.parameters(), before))
        return gate, moved, (tmp_path / "log.txt").read_text().splitlines()[-1]
    # each reading is two: corpus pieces, then random names never trained on; the gate needs both
    gate, moved, line = run_base(16, [0.5, 0.95, 0.95, 0.95, 0.93, 0.94])  # below, one chunk of 2, at the gate: stop
    assert (gate["steps"], gate["copy_accuracy"], gate["copy_accuracy_names"]) == (10, 0.93, 0.94) and moved > 0
    assert "WARNING" not in line and gate["names"] > 0
    gate, _, line = run_base(16, [0.95, 0.5, 0.95, 0.95, 0.93, 0.93])  # names below: a chunk more as well
    assert gate["steps"] == 10 and "WARNING" not in line
    gate, _, line = run_base(12, [0.5, 0.5, 0.6, 0.6, 0.7, 0.7])  # below to the cap: 8 + 2 + 2, then the report
    assert gate["steps"] == 12 and gate["copy_accuracy"] == 0.7 and "WARNING: below the gate" in line
    gate, _, line = run_base(0, [0.95, 0.7])  # no cap: exactly base_steps; names below the gate: the alarm
    assert gate["steps"] == 8 and "WARNING: below the gate" in line
    gate, _, line = run_base(16, [0.5, 0.5, 0.91, 0.92, 0.89, 0.95])  # the deciding probe passed, the report .89
    assert gate["steps"] == 10 and "WARNING" not in line and "the probe that decided read 0.910" in line
    # no random names trained on (--base-name-share 0, the default): their reading is recorded, never gates
    gate, _, line = run_base(16, [0.95, 0.2, 0.93, 0.1], share=0.0)  # names low: no chunk, no alarm
    assert (gate["steps"], gate["names"], gate["copy_accuracy_names"]) == (8, 0, 0.1) and "WARNING" not in line
    assert "(not gated)" in line
    gate, _, line = run_base(12, [0.5, 0.99, 0.6, 0.99, 0.7, 0.99], share=0.0)  # corpus low: chunks, then the alarm
    assert gate["steps"] == 12 and "WARNING: below the gate" in line


# --- the end-of-run table's statistics (report.py)
# ----------------------------------------------------------

def _ev(resolved, rewards):
    return {"trials": [{"task": f"t{i}", "attempt": 0, "resolved": r, "reward": w}
                       for i, (r, w) in enumerate(zip(resolved, rewards))]}


def test_wilson_and_mean_intervals_by_hand():
    lo, hi = report.wilson(30, 150)  # p = .2, n = 150: Wilson [.144, .271]
    assert abs(lo - 0.1440) < 1e-3 and abs(hi - 0.2707) < 1e-3
    assert report.wilson(0, 150)[0] == 0.0 and report.wilson(0, 150)[1] > 0.02  # no solve still has an upper bound
    lo, hi = report.mean_interval([0.0, 1.0] * 50)  # mean .5, sd .5025, se .0503
    assert abs(lo - (0.5 - 1.96 * 0.050252)) < 1e-4 and abs(hi - (0.5 + 1.96 * 0.050252)) < 1e-4


def test_paired_mcnemar_and_bootstrap_by_hand():
    a = _ev([False] * 20 + [True] * 5, [0.0] * 20 + [1.0] * 5)
    b = _ev([True] * 12 + [False] * 8 + [True] * 4 + [False], [1.0] * 12 + [0.0] * 8 + [1.0] * 4 + [0.0])
    t = report.paired(a, b)
    assert (t["solved_gained"], t["solved_lost"], t["n"]) == (12, 1, 25)
    assert abs(t["mcnemar_p"] - 2 * 14 / 2 ** 13) < 1e-12  # exact: 2 P(X <= 1), X ~ Bin(13, 1/2)
    assert abs(t["reward_diff"] - 11 / 25) < 1e-12 and t["reward_diff_ci"][0] > 0 and t["reward_p_le"] < 0.01
    same = report.paired(a, a)
    assert same["mcnemar_p"] == 1.0 and same["reward_diff"] == 0.0
    with pytest.raises(ValueError, match="different trials"):
        report.paired(a, _ev([True], [1.0]))


def test_eval_row_keeps_each_evaluation_and_compare_pairs_two(tmp_path):
    """eval_row writes evals/step_N.json whole (per-trial rows); experiments.bench compare pairs two of them
    by task."""
    rows = []
    run = SimpleNamespace(dir=tmp_path, metrics=SimpleNamespace(write=lambda rec, step, phase: rows.append(step)))
    sft = {**_ev([False] * 20 + [True] * 5, [0.0] * 20 + [1.0] * 5), "solve_rate": 0.2, "reward_mean": 0.2,
           "n_trials": 25}
    for t in sft["trials"]:
        t["task"] = f"heldout-{t['task']}-" + ("find" if t["task"] in ("t0", "t21") else "files")
    rl = json.loads(json.dumps(sft))
    for t in rl["trials"][:12]:
        t.update(resolved=True, reward=1.0)
    rl["trials"][21].update(resolved=False, reward=0.0)
    runstate.eval_row(run, {"test": sft}, 0)
    runstate.eval_row(run, {"test": rl}, 16)
    assert rows == [0, 16] and sorted(os.listdir(tmp_path / "evals")) == ["step_000000.json", "step_000016.json"]
    assert json.loads((tmp_path / "evals" / "step_000016.json").read_text())["after_step"] == 16
    c = bench.compare(str(tmp_path / "evals" / "step_000000.json"), str(tmp_path / "evals" / "step_000016.json"))
    assert (c["solved_gained"], c["solved_lost"], c["n"]) == (12, 1, 25)
    assert c["a"]["per_family"] == {"files": 4, "find": 1} and c["b"]["per_family"] == {"files": 15, "find": 1}
    assert c["b"]["solve_rate"] == 0.64 and c["a"]["ci"][0] < 0.2 < c["a"]["ci"][1]
    (tmp_path / "broken.json").write_text('{"solve_rate": 0.5}')
    with pytest.raises(ValueError, match="broken.json is not an evaluation with per-trial rows"):
        bench.compare(str(tmp_path / "broken.json"), str(tmp_path / "evals" / "step_000000.json"))


def test_an_evaluation_redone_after_a_kill_has_one_row(tmp_path):
    """A kill after eval_row's metrics row but before the state's commit: the resume redoes the evaluation (the step
    is committed, so resume_run keeps the first row); the redo replaces that row, other rows untouched."""
    run = SimpleNamespace(dir=tmp_path, metrics=Metrics(tmp_path))

    def ev(k, n=4):
        return {**_ev([True] * k + [False] * (n - k), [1.0] * k + [0.0] * (n - k)), "solve_rate": k / n,
                "reward_mean": k / n, "n_trials": n}
    run.metrics.write({"reward_mean": 0.5}, 16, "rl")
    runstate.eval_row(run, {"test": ev(1)}, 0)
    runstate.eval_row(run, {"test": ev(2)}, 16)
    runstate.eval_row(run, {"test": ev(3)}, 16)  # the redo of step 16's evaluation
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [(r["phase"], r["step"], r.get("heldout_solve_rate")) for r in rows] == [
        ("rl", 16, None), ("eval", 0, 0.25), ("eval", 16, 0.75)]
    assert "eval row of step 16: metrics.jsonl: dropped 1 row(s)" in (tmp_path / "log.txt").read_text()
    assert json.loads((tmp_path / "evals" / "step_000016.json").read_text())["solve_rate"] == 0.75


def test_best_val_chooses_on_validation_alone_and_the_table_shows_it(tmp_path, capsys):
    """--n-val-tasks: eval_row writes evals/val_step_N.json beside step_N.json, and one metrics row with both;
    report.best_val picks the RL step by validation solve rate, then mean reward, then the earlier step (never step
    0, never a step without a held-out file), whatever the held-out figures; print_table adds RL@val and its
    paired test against SFT."""
    rows = []
    run = SimpleNamespace(dir=tmp_path, metrics=SimpleNamespace(write=lambda rec, step, phase: rows.append(rec)))

    def ev(k, n=10, reward=None):  # k of n resolved
        e = _ev([True] * k + [False] * (n - k), [1.0] * k + [0.0] * (n - k))
        return {**e, "solve_rate": k / n, "reward_mean": reward if reward is not None else k / n, "n_trials": n,
                "turns_mean": 3.0}
    assert report.best_val(tmp_path) is None  # no evals at all
    runstate.eval_row(run, {"test": ev(2), "val": ev(9)}, 0)  # the SFT step: not a candidate
    runstate.eval_row(run, {"test": ev(3), "val": ev(5, reward=0.4)}, 16)
    runstate.eval_row(run, {"test": ev(9), "val": ev(4)}, 32)  # the best held-out: not read
    runstate.eval_row(run, {"test": ev(6), "val": ev(5, reward=0.6)}, 48)  # ties 16 on solve rate, better mean reward
    runstate.eval_row(run, {"test": ev(1), "val": ev(5, reward=0.6)}, 64)  # a full tie with 48: the earlier step
    (tmp_path / "evals" / "val_step_000080.json").write_text(json.dumps(ev(10)))  # no held-out file: skipped
    assert [set(r) >= {"val_solve_rate", "val_n_trials", "heldout_solve_rate"} for r in rows] == [True] * 5
    best = report.best_val(tmp_path)
    assert (best["step"], best["solve_rate"], best["val_solve_rate"], best["val_reward_mean"], best["val_n"]) == (
        48, 0.6, 0.5, 0.6, 10)
    report.print_table({"eval_sft": ev(2), "eval_rl": {**ev(1), "after_step": 64}, "eval_rl_best_val": best,
                       "phase_times": {}})
    out = capsys.readouterr().out
    assert "| test (in-template) | RL@val (step 48, val 0.500) | 0.600 [" in out
    assert "test (in-template): RL@val (step 48) vs SFT (paired, 10 tasks, n 10): solved +4 -0, McNemar p" in out
    (tmp_path / "evals" / "val_step_000016.json").write_text('{"solve_rate": 0.5')  # torn: named, not guessed
    with pytest.raises(ValueError, match="val_step_000016.json is not a validation evaluation"):
        report.best_val(tmp_path)


def test_snr_stats_by_hand():
    G = torch.tensor([[1.0, 0.0], [3.0, 0.0], [1.0, 2.0], [3.0, -2.0]])  # mean (2, 0)
    st = training.snr_stats(G)
    tr = (1 + 1 + (1 + 4) + (1 + 4)) / 3  # sum |g_i - gbar|^2 / (n - 1) = 4
    assert abs(st["rho"] - (4 - tr / 4) / tr) < 1e-12 and st["n"] == 4
    assert abs(st["trajectories_for_snr_1"] - 1 / st["rho"]) < 1e-9
    assert abs(st["split_half_cos"] - 1.0) < 1e-12  # both halves' means are (2, 0)
    assert training.snr_stats(torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]))["trajectories_for_snr_1"] == float("inf")
    with pytest.raises(ValueError, match=">= 4"):
        training.snr_stats(G[:3])


def test_pg_snr_on_a_run_directory(tmp_path, tiny_sft):
    """pg-snr reads a run's checkpoint, S and step samples (R3 replay of their routing) and gives finite figures."""
    import tito
    shutil.copytree(tiny_sft.sft, tmp_path / "ckpt" / "sft")
    (tmp_path / "args.json").write_text(json.dumps({"reward_scale": 20.0}))  # fake_samples: r = P / 20
    tito.save_samples(tmp_path / "samples" / "step_000001.jsonl", [dict(s, task=f"t{i}-text", spans=[])
                                                                   for i, s in enumerate(tiny_sft.samples)])
    out = training.pg_snr(tmp_path, steps=(1,), n=6)
    assert out["n"] == 6 and math.isfinite(out["rho"]) and -1 <= out["split_half_cos"] <= 1


def test_presets_full_and_quick_are_flags_and_exclusive(capsys):
    full, emb = T.parse_args(["--full"]), T.parse_args([])
    assert (full.n_heldout_tasks, full.eval_every, full.arch) == (100, 16, "qwen3_moe") and full.rl_steps > emb.rl_steps
    assert (full.n_val_tasks, full.n_deep_tasks, full.n_names_tasks, full.eval_attempts) == (50, 50, 50, 3)
    assert (full.n_train_tasks, full.validate_train, full.rl_steps) == (1152, False, 48)  # --full's pool and steps
    assert (full.rst_rounds, emb.rst_rounds) == (1, 0)  # RST tasks in --full
    assert (full.temperature, full.kl_coef, emb.temperature, emb.kl_coef) == (0.7, 0.05, 1.0, 0.0)  # --full's T and KL
    T.check_args(full)  # the KL is the hf backend's, as --full's
    assert emb.validate_train and emb.expert_text == full.expert_text == "full"
    assert T.parse_args(["--full", "--rl-steps", "3"]).rl_steps == 3  # a flag still wins over the preset
    assert emb.base_steps > 0 and T.Args().base_steps == 0  # the base phase is the embedded presets' only
    with pytest.raises(SystemExit):
        T.parse_args(["--full", "--quick"])
    assert "pick one preset" in capsys.readouterr().err


def test_invalid_reply_frac_counts_refused_replies_over_all_turns():
    """The format-collapse metric: refused replies / all replies of the kept trials that counted them (a trial
    without the count, e.g. an agent behind the gateway, is left out, and none counted is NaN, not 0)."""
    trials = [dict(turns=4, invalid_replies=1), dict(turns=8, invalid_replies=8), dict(turns=5)]
    assert runstate.invalid_reply_frac(trials) == pytest.approx(9 / 12)
    assert math.isnan(runstate.invalid_reply_frac([])) and math.isnan(runstate.invalid_reply_frac([dict(turns=3)]))
    assert runstate.invalid_reply_frac([dict(turns=0, invalid_replies=0)]) == 0.0
    low = runstate.invalid_reply_frac([dict(turns=10, invalid_replies=1)])
    assert runstate.invalid_reply_frac(trials) >= runstate.INVALID_ALARM > low


def test_a_validation_set_added_on_resume_avoids_the_sft_pool_too(tmp_path, monkeypatch):
    """--n-val-tasks on a run whose pools and SFT pool exist: the new set is drawn avoiding all three pools'
    instructions (a fresh run draws it before SFT, whose pool then drops any shared one: warm_start)."""
    from sandbox import task_io
    args = T.parse_args(["--quick", "--run-dir", str(tmp_path / "run"), "--n-train-tasks", "2", "--n-heldout-tasks",
                         "1", "--validate-train", "false"])
    monkeypatch.setattr(data, "validate", lambda *a, **k: None)
    real, seen = data.generate_tasks, {}

    def spy(out_dir, *a, **k):
        if k.get("heldout_split") == "val":
            seen["avoid"] = set(k["avoid"])
        return real(out_dir, *a, **dict(k, validate_tasks=False))
    monkeypatch.setattr(data, "generate_tasks", spy)
    run = runstate.Run(args)
    T.make_tasks(run)
    sft, _ = real(tmp_path / "run" / "tasks" / "sft", 4, 0, args.seed + 1, validate_tasks=False)
    run.args = dataclasses.replace(run.args, n_val_tasks=2)
    T.make_tasks(run)
    pools = [task_io.load_task(d).instruction for d in run.state["tasks"]["train"] + run.state["tasks"]["heldout"]]
    assert seen["avoid"] == set(pools) | {task_io.load_task(d).instruction for d in sft}
    assert len(run.state["tasks"]["val"]) == 2


def test_step_record_logs_the_dense_reward_whatever_the_arm_trains_on():
    """An RL step's metrics row: reward_mean is what the update trained on (a binary arm's 0 / 1), reward_dense_mean
    the samples' r = P / S (experiments/paper.py plots it for every arm)."""
    trials = [{"resolved": True, "turns": 2}, {"resolved": False, "turns": 1}]
    samples = [{"reward": 1.0, "turns": 2, "tokens": [1, 2, 3]}, {"reward": 0.3, "turns": 1, "tokens": [1]}]
    ro = {"trials": trials, "n_launched": 2, "dropped": [], "tok_s": 10.0, "t_rollout": 1.0}
    rec = runstate.step_record(ro, samples, {"reward_mean": 0.5}, {})
    assert rec["reward_mean"] == 0.5 and rec["reward_dense_mean"] == pytest.approx(0.65)
    assert rec["solve_rate"] == 0.5 and rec["tokens_mean"] == 2.0
    assert runstate.step_record({**ro, "trials": []}, [], {}, {})["reward_dense_mean"] == 0.0


def test_engine_errors_500_sums_the_engines_counts_and_is_none_where_one_does_not_count():
    """The RL step's engine_errors_500: the sum of the engines' /get_server_info counts; None (not 0) where an
    engine does not count them (SGLang) or does not answer, so a missing count never reads as 'no trial lost'."""
    import http.server
    import threading

    def serve(body):
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    servers = [serve({"errors_500": 2}), serve({"errors_500": 3}), serve({"version": "sglang"})]
    try:
        urls = [u for _, u in servers]
        assert actors.engine_errors_500(urls[:2]) == 5
        assert actors.engine_errors_500(urls) is None
        assert actors.engine_errors_500(urls[:1] + ["http://127.0.0.1:1"]) is None
    finally:
        for srv, _ in servers:
            srv.shutdown()


def test_paired_with_three_attempts_tests_over_tasks_and_the_table_names_every_split(capsys):
    """With 3 attempts a task, the solved difference is tested over tasks (attempts averaged: a sign-flip over the
    6 tasks that changed, exact: 2 of 64 patterns as extreme), not McNemar over 18 dependent trials; print_table
    gives every split the run drew its rows and its paired test, by the split's name."""
    def ev(solved_tasks, n=10, attempts=3):
        trials = [{"task": f"t{i}", "attempt": k, "resolved": i in solved_tasks, "reward": float(i in solved_tasks)}
                  for i in range(n) for k in range(attempts)]
        rate = len(solved_tasks) / n
        return {"trials": trials, "n_trials": n * attempts, "solve_rate": rate, "reward_mean": rate, "turns_mean": 3.0}
    sft, rl = ev(set()), ev(set(range(6)))
    t = report.paired(sft, rl)
    assert (t["test"], t["n_tasks"], t["n"], t["solved_gained"]) == ("sign-flip over tasks", 10, 30, 18)
    assert t["solve_p"] == t["task_p"] == 2 / 64 and t["mcnemar_p"] < 1e-4
    assert report.paired(ev(set(), attempts=1), ev({0, 1}, attempts=1))["test"] == "McNemar"
    assert report.signflip_p([0.0, 0.0]) == 1.0 and report.signflip_p([1.0] * 20, n_perm=999) == 1 / 1000
    report.print_table({"eval_sft": sft, "eval_rl": {**rl, "after_step": 8},
                        "eval_sft_splits": {"test_deep": ev({1}), "test_names": ev(set())},
                        "eval_rl_splits": {"test_deep": ev({1, 2, 3}), "test_names": ev({4})}, "phase_times": {}})
    out = capsys.readouterr().out
    assert "| test (out-of-template: deeper RST) | RL | 0.300 [" in out and "| test (unseen names) | SFT | 0.000" in out
    assert ("test (in-template): RL vs SFT (paired, 10 tasks, n 30): solved +18 -0, sign-flip over tasks p = 0.0312"
            in out)
    assert "test (unseen names): RL vs SFT (paired, 10 tasks, n 30): solved +3 -0" in out


def test_a_run_records_the_commit_and_command_that_made_it(tmp_path):
    """state.json carries the code's git commit ("+dirty" with tracked changes) and the command line, kept across
    resumes (the first run's): experiments.seeds collect files them with the run's evaluations."""
    import re
    runstate.Run(dataclasses.replace(T.QUICK, run_dir=str(tmp_path / "r")))
    st = json.loads((tmp_path / "r" / "state.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", st["commit"]) and st["argv"] == sys.argv
    (tmp_path / "r" / "state.json").write_text(json.dumps({**st, "commit": "abc", "argv": ["first"]}))
    runstate.Run(dataclasses.replace(T.QUICK, run_dir=str(tmp_path / "r")))
    st = json.loads((tmp_path / "r" / "state.json").read_text())
    assert (st["commit"], st["argv"]) == ("abc", ["first"])


def test_plot_draws_each_split_where_it_was_evaluated(tmp_path):
    """curves.png: a validation-only row (--eval-every) beside rows of every split (after SFT, after RL) is drawn,
    each split over the steps it was evaluated at (a row without the in-template split once broke the plot)."""
    def ev(step, *prefixes):
        return {"phase": "eval", "step": step, **{f"{p}_{k}": 0.5 for p in prefixes for k in ("solve_rate",
                                                                                               "reward_mean")}}
    rows = [ev(0, "heldout", "test_deep", "test_names", "val"), ev(2, "val"), ev(3, "heldout", "test_deep", "val")]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.plot(tmp_path, tmp_path / "c.png").stat().st_size > 0
