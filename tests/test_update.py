"""The update without compute on padding (critic.pieces: rows by length, one optimizer step per minibatch) against the
padded update before it, the R3-off diagnostic every --r3-off-every steps, and `bench.py update`."""
import copy
import dataclasses
import json
import math
import os
import random
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import critic as C  # noqa: E402
import model as M  # noqa: E402
import ppo  # noqa: E402
import report  # noqa: E402
import train_t1 as T  # noqa: E402
from experiments import training  # noqa: E402
from rundir import Metrics  # noqa: E402

# Weights after one train_step (2 PPO epochs of 2 minibatches, SGD at lr 1e-2), row by row vs padded: the largest
# difference over seeds 0-2 x 1 and 2 threads was 1.2e-7 (mostly 4e-9 to 7e-9), the largest move of a weight 8e-4 to
# 1.2e-3 (critic 3e-3); the tolerance is 8x the largest difference seen. SGD, not Adam: Adam's
# first steps move a weight by ~lr whatever its gradient's size, so a gradient of ~0 flips on float rounding alone
# (up to 2 lr, compounded over the steps), which says nothing of the update; the gradients are compared directly.
WEIGHT_TOL = 1e-6
GRAD_REL_TOL = 1e-4  # one minibatch's gradient, relative to each parameter's norm: measured up to ~1e-6


def _step(samples, actor0, args, padded, step=1, run_dir=None, opt=torch.optim.SGD, lr=1e-2):
    """One ppo.train_step from actor0's weights (fresh optimizers): -> (actor, critic state dicts, stats)."""
    actor = copy.deepcopy(actor0)
    critic = C.Critic.from_actor(actor0)
    behaviour, ref = copy.deepcopy(actor0), copy.deepcopy(actor0).eval().requires_grad_(False)
    aopt, copt = opt(actor.parameters(), lr=lr), opt(critic.parameters(), lr=lr)
    st = ppo.train_step(actor, behaviour, critic, aopt, copt, samples, args, random.Random(0), run_dir, step, None,
                        ref, padded=padded)
    return actor.state_dict(), critic.state_dict(), st


@pytest.fixture(scope="module")
def batch():
    """6 recorded trajectories of 25-55 tokens (tool outputs m = 0, R3 routing), minibatches of 3: padding in each."""
    actor, samples = training.update_samples(6, 40, 15, "qwen3_moe", seed=0)
    args = dataclasses.replace(T.EMBEDDED, minibatch_size=3, ppo_epochs=2, kl_coef=0.05, r3_mode="replay")
    return actor, samples, args


@pytest.mark.parametrize("threads", [1, 2])
def test_row_by_row_update_matches_the_padded_one(batch, threads, tmp_path):
    """The update of the same minibatches without padding gives the padded update's weights (within TOL_LR of each
    learning rate) and statistics, on 1 and 2 threads."""
    actor0, samples, args = batch
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a_pad, c_pad, s_pad = _step(samples, actor0, args, True, run_dir=tmp_path)
        a_row, c_row, s_row = _step(samples, actor0, args, False, run_dir=tmp_path)
    finally:
        torch.set_num_threads(before)
    moved = max((a_pad[k] - v).abs().max().item() for k, v in actor0.state_dict().items())
    assert moved > 100 * WEIGHT_TOL  # the step moved the weights: the comparison is not of two no-ops
    assert max((a_pad[k] - a_row[k]).abs().max().item() for k in a_pad) <= WEIGHT_TOL
    assert max((c_pad[k] - c_row[k]).abs().max().item() for k in c_pad) <= WEIGHT_TOL
    for k in ("pg_loss", "value_loss", "approx_kl", "clipfrac", "losses/kl", "dlogp", "dlogp_r3_off",
              "expert_set_mismatch", "explained_variance"):
        assert s_row[k] == pytest.approx(s_pad[k], rel=1e-4, abs=1e-6), k


def test_one_minibatch_gradient_matches_the_padded_one(batch):
    """ppo_update's gradient of one minibatch of every row (KL on, R3 replay): the same row by row as padded."""
    actor0, samples, args = batch
    a = dataclasses.replace(args, minibatch_size=len(samples), ppo_epochs=1)
    b = ppo.pad_batch(samples, a.reward_scale, True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        old = ppo.by_length(lambda s: ppo.forward_logprobs(actor0, s, "replay", a.temperature), b)
    adv = torch.randn(b["mask"].shape, generator=g) * b["mask"]
    grads = []
    for padded in (True, False):
        actor = copy.deepcopy(actor0)
        ppo.ppo_update(actor, torch.optim.SGD(actor.parameters(), lr=0.0), b, adv, old + 0.05 * adv, a,
                       random.Random(0), len(samples), None, old - 0.1 * b["mask"], padded)
        grads.append({n: p.grad for n, p in actor.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1])
    for k, v in grads[0].items():
        assert (v - grads[1][k]).norm() <= GRAD_REL_TOL * v.norm() + 1e-12, k


def test_pieces_cut_every_row_after_its_last_token():
    """pieces: rows longest first, each alone and cut at its own length (no padding left, so no attention mask);
    size None gives the batch itself; a batch without rows gives no piece."""
    am = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    b = {"attention_mask": am, "input_ids": torch.arange(12).view(3, 4), "experts": None}
    got = C.pieces(b, 1)
    assert [p["input_ids"].tolist() for p in got] == [[[4, 5, 6, 7]], [[0, 1]], [[8]]]
    assert all(C.causal_mask(p["attention_mask"]) is None for p in got)
    assert C.causal_mask(am) is am
    assert C.pieces(b, None) == [b]
    assert C.pieces({**b, "attention_mask": am[:0]}, 1) == []


def test_pieces_group_short_rows_within_the_token_budget():
    """A piece takes rows (longest first) while rows x its longest row <= the budget: short rows share one call, a
    row over the budget runs alone; every row in exactly one piece, each piece cut after its longest row."""
    lens = [700, 30, 600, 25, 40, 1500]
    am = torch.tensor([[1] * n + [0] * (1500 - n) for n in lens])
    b = {"attention_mask": am, "input_ids": torch.arange(am.numel()).view(am.shape), "experts": None}
    got = C.pieces(b, 1024)
    assert [[int(r) for r in p["attention_mask"].sum(1)] for p in got] == [[1500], [700], [600], [40, 30, 25]]
    assert [p["input_ids"].shape[1] for p in got] == [1500, 700, 600, 40]
    assert C.causal_mask(got[0]["attention_mask"]) is None and C.causal_mask(got[3]["attention_mask"]) is not None
    assert [len(p["input_ids"]) for p in C.pieces(b, 1)] == [1] * 6 and C.pieces(b, 10 ** 6)[0]["input_ids"].shape \
        == (6, 1500)


def test_sft_row_by_row_matches_the_padded_step(batch, monkeypatch, tmp_path):
    """ppo.sft row by row (the default) and in one padded forward (UPDATE_TOKENS None) take the same steps (SGD in
    place of its AdamW, as in test_row_by_row_update_matches_the_padded_one)."""
    actor0, samples, args = batch
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, lr, weight_decay: torch.optim.SGD(params, lr=lr))
    out = []
    for rows in (None, 1):
        monkeypatch.setattr(C, "UPDATE_TOKENS", rows)
        actor = copy.deepcopy(actor0)
        a = dataclasses.replace(args, sft_epochs=1, sft_batch_size=3, sft_lr=1e-2)
        ppo.sft(actor, samples, a, Metrics(tmp_path))
        out.append(actor.state_dict())
    assert max((out[0][k] - v).abs().max().item() for k, v in actor0.state_dict().items()) > 100 * WEIGHT_TOL
    assert max((out[0][k] - out[1][k]).abs().max().item() for k in out[0]) <= WEIGHT_TOL


def test_r3_off_every_k_steps():
    """--r3-off-every K: steps 1, 1 + K, 1 + 2K, ... run the R3-off diagnostic; 1 every step; 0 never."""
    a = T.Args()
    assert a.r3_off_every == 1 and all(ppo.r3_off_step(a, s) for s in range(1, 6))
    three = dataclasses.replace(a, r3_off_every=3)
    assert [s for s in range(1, 9) if ppo.r3_off_step(three, s)] == [1, 4, 7]
    assert not any(ppo.r3_off_step(dataclasses.replace(a, r3_off_every=0), s) for s in range(1, 9))
    assert T.parse_args(["--r3-off-every", "4"]).r3_off_every == 4


def test_a_step_without_the_r3_off_diagnostic_reports_nan(batch, tmp_path):
    """On a step without the diagnostic, dlogp_r3_off and expert_set_mismatch are NaN and the log says nothing of
    it; on a step with it both are finite and the log names the step; the update itself is the same."""
    actor0, samples, args = batch
    a = dataclasses.replace(args, r3_off_every=2, ppo_epochs=1)
    with_diag = _step(samples, actor0, a, False, step=3, run_dir=tmp_path)
    without = _step(samples, actor0, a, False, step=2, run_dir=tmp_path)
    log = (tmp_path / "log.txt").read_text()
    assert "step 3: R3-off diagnostic" in log and "step 2: R3-off diagnostic" not in log
    assert math.isfinite(with_diag[2]["dlogp_r3_off"]) and math.isfinite(with_diag[2]["expert_set_mismatch"])
    assert math.isnan(without[2]["dlogp_r3_off"]) and math.isnan(without[2]["expert_set_mismatch"])
    assert without[2]["dlogp"] == with_diag[2]["dlogp"]
    assert all(torch.equal(with_diag[0][k], without[0][k]) for k in with_diag[0])


def test_plot_skips_steps_without_the_r3_off_diagnostic(tmp_path):
    """report.plot draws the R3-off curve over the steps that ran it (NaN elsewhere, as metrics.jsonl holds it)."""
    rows = [{"phase": "rl", "step": s, "reward_mean": 0.1 * s, "solve_rate": 0.5, "explained_variance": 0.3,
             "turns_mean": 3.0, "time_step": 60.0, "dlogp": 0.01,
             "dlogp_r3_off": 0.02 if s % 2 else float("nan")} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = report.plot(tmp_path, tmp_path / "c.png")
    assert out.exists() and out.stat().st_size > 0


def test_update_bench_quick_prints_both_throughputs(tmp_path, monkeypatch):
    """`bench.py update --quick`'s figures: train_step, the padded update and the unpadded passes, and the ratios;
    its temporary folder is gone afterwards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = training.update_bench(dataclasses.replace(T.FULL, minibatch_size=2), n=4, mean_len=30, sd_len=8, repeats=1)
    assert set(r["seconds"]) == {"train_step", "padded", "unpadded"}
    assert r["train_step_tokens_per_s"] > 0 and r["unpadded_tokens_per_s"] > 0 and r["ratio"] > 0
    assert 0 <= r["minibatch_padding"] < 1
    assert not list(tmp_path.glob("t1-update-bench-*"))


def test_critic_epochs_are_the_critics_passes_and_leave_the_actor_alone(batch, tmp_path):
    """--critic-epochs 2 passes the critic twice over the step's minibatches (its weights move further than after
    one pass, along the same first pass); the actor's update starts from the advantages of V_old, computed before
    the critic's update, so its weights are the same as with one critic pass."""
    actor0, samples, args = batch
    a1, c1, _ = _step(samples, actor0, args, False, run_dir=tmp_path)
    a2, c2, _ = _step(samples, actor0, dataclasses.replace(args, critic_epochs=2), False, run_dir=tmp_path)
    c0 = C.Critic.from_actor(actor0).state_dict()
    assert max((a1[k] - a2[k]).abs().max().item() for k in a1) <= WEIGHT_TOL
    one = sum((c1[k] - c0[k]).double().norm() ** 2 for k in c0) ** 0.5
    two = sum((c2[k] - c0[k]).double().norm() ** 2 for k in c0) ** 0.5
    assert two > 1.5 * one > 0
