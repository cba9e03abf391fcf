"""The update of one RL step, on the trainer (paper: the optimisation section, steps 5-6 of an RL step).

What the trainer process (trainer.py) calls by name: train_step = V_old -> GAE (gamma = lambda = 1) -> critic
update first (value clip eps_v = 0.2) -> old logprobs of the behaviour policy -> PPO actor update (ppo_loss, clip
eps = 0.2), every forward (and its recompute) under R3 replay; plus the SFT warm start (sft) and the Critic Warm-Up
(critic_warmup). The loop that drives them is train_t1.py; the critic's math is critic.py, the sums over the
trainer ranks dp.py. Machinery (no paper section): a step's no-grad forwards run over rows of similar length, in
groups of about UPDATE_TOKENS tokens, each cut after its longest row (by_length, critic.trim: the same values on
every token); the critic's and the actor's minibatches (and SFT's) run forward + backward in pieces of rows of
similar length (a long row alone), each cut after its longest row, with one optimizer step per minibatch
(critic.pieces: no compute on padding; the same minibatches and steps to float rounding). The Megatron backend
(cluster/mcore*.py) keeps one padded forward per chunk and minibatch (over a group full width: a collective needs
equal shapes), as does the aux loss (a product of two means over the minibatch).
The R3-off diagnostic forward runs every --r3-off-every steps (r3_off_step).

Run: not by itself (`python train_t1.py`); tests/test_train_t1.py checks each function against hand-computed values.

Departures from the paper (numbered; what and why):
  1. The KL term and the load-balancing term are off, as in the paper ("KL 项与负载均衡项均关闭"); advantage
     normalisation, an entropy bonus and length shaping are off too (paper silent). --kl-coef (k3 to a frozen SFT
     copy, linear beyond a log ratio of 2), --entropy-coef and --aux-loss-coef exist for ablations (hf backend only).
  4. The critic passes over each step's minibatches --critic-epochs times (default 1), the actor --ppo-epochs times
     (paper silent on both).
  2. Loss aggregation (paper silent): a per-token mean over the minibatch; --loss-agg sample averages within each
     trajectory first (slime's default).
  3. The paper's comparison arms, off by default: --reward-mode binary (1 if every test passed) and
     --advantage grpo (group-normalised rewards over --samples-per-task G, the critic neither used nor updated).
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import critic as C
import r3
import tito
from dp import dp_sum, even, local_rows, optimizer_step, share
from rundir import log


REWARD_MODES = ("dense", "binary")  # --reward-mode: r = P / S (paper) | 1 if every test passed, else 0
ADVANTAGES = ("gae", "grpo")  # --advantage: GAE with the critic (paper) | group-normalised rewards, no critic


def trained_reward(s: dict, mode: str = "dense") -> float:
    """The reward a sample trains on: dense, the trial's r = P / S as reward.compute gave it (paper); binary, 1 when
    every test of its report passed (passed == total > 0), else 0 (the paper's first experiment)."""
    if mode == "dense":
        return s["reward"]
    if mode == "binary":
        return float(s["total"] > 0 and s["passed"] >= s["total"])
    raise ValueError(f"--reward-mode: expected one of {'|'.join(REWARD_MODES)}, got {mode!r}")


def pad_batch(samples: list[dict], scale: float, replay: bool = False, reward_mode: str = "dense") -> dict:
    """Right-pad samples into (B, T) tensors; the trial's reward placed on the last sampled token: r = P / S, or the
    binary outcome with reward_mode "binary" (trained_reward).

    One reward: r is the one reward.compute gave the trial (rollout.run_trial's reward_scale = --reward-scale);
    a CTRF sample whose r is not P / scale was scored with another S and is refused.
    replay (R3 on): every sample must carry its routing; one without is refused, never trained with live routing."""
    lacking = [s.get("task", "?") for s in samples if s.get("routed_experts") is None]
    if replay and lacking:
        raise ValueError(f"R3 replay: {len(lacking)} of {len(samples)} samples carry no routing (trials "
                         f"{lacking[:5]}): {tito.ENGINE_CAPTURE_HINT}; or run with --r3-mode off")
    B, T = len(samples), max(len(s["tokens"]) for s in samples)
    out = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.zeros(B, T, dtype=torch.long),
           "mask": torch.zeros(B, T), "rollout_logprobs": torch.zeros(B, T), "rewards": torch.zeros(B, T)}
    re0 = next((s["routed_experts"] for s in samples if s.get("routed_experts") is not None), None)
    out["experts"] = None if re0 is None else torch.full((B, T) + re0.shape[1:], -1, dtype=torch.int32)
    for b, s in enumerate(samples):
        n = len(s["tokens"])
        out["input_ids"][b, :n] = torch.tensor(np.asarray(s["tokens"]))  # copies (Ray hands over read-only arrays)
        out["attention_mask"][b, :n] = 1
        out["mask"][b, :n] = torch.tensor(np.asarray(s["loss_mask"]), dtype=torch.float32)
        out["rollout_logprobs"][b, :n] = torch.tensor(np.asarray(s["rollout_logprobs"]), dtype=torch.float32)
        last = int(np.flatnonzero(s["loss_mask"])[-1])
        if s.get("reward_source") == "ctrf" and abs(s["reward"] - s["passed"] / scale) > 1e-9:
            raise ValueError(f"sample of task {s.get('task')!r}: reward {s['reward']} is not P / S = {s['passed']} / "
                             f"{scale} (--reward-scale): the trial was scored with another S")
        out["rewards"][b, last] = trained_reward(s, reward_mode)  # r = P / S, as reward.compute gave it
        if out["experts"] is not None and s.get("routed_experts") is not None:
            # row n-1 stays -1 (no next token)
            out["experts"][b, : n - 1] = torch.tensor(np.asarray(s["routed_experts"]))
    return out


def task_groups(samples: list[dict], required: bool = False) -> list[list[int]]:
    """Indices of the samples of each task (a GRPO group: the same task launched --samples-per-task times in a step;
    the oversampling may have cut some members), in first-seen order. required (GRPO): a sample without its task's
    name is refused; otherwise it is a group of its own (the all-fail statistic only)."""
    groups = {}
    for i, s in enumerate(samples):
        if required and "task" not in s:
            raise ValueError(f"--advantage grpo: sample {i} carries no task name to group it by")
        groups.setdefault(s.get("task", ("unnamed", i)), []).append(i)
    return list(groups.values())


def grpo_advantages(rewards: torch.Tensor, groups: list[list[int]], eps: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage per sample (DeepSeekMath): (r - group mean) / (group std + eps), std with Bessel's
    correction as TRL computes it; a group of one, or one where every reward is equal (all fail, all pass), gives 0:
    no signal, the case the paper's PPO-vs-GRPO comparison is about."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in groups:
        if len(g) > 1:
            r = rewards[g].float()
            adv[g] = (r - r.mean()) / (r.std() + eps)
    return adv


def token_logprobs(actor, batch: dict, temperature: float = 1.0, rows=slice(None)) -> torch.Tensor:
    """logprobs (B, T): logprobs[:, j] = log pi(tokens[j] | tokens[:j]); column 0 is 0.

    Runs inside the caller's `r3.routing` context; backward must run inside it too (recompute replays).
    """
    ids, am = batch["input_ids"][rows], batch["attention_mask"][rows]
    if actor.backend == "megatron":  # mcore.MegatronActor: from the vocab-parallel logits, no (B, T, V) gather
        return F.pad(actor.token_logprobs(ids, am, temperature), (1, 0))
    logits = actor(input_ids=ids, attention_mask=C.causal_mask(am)).logits.float() / temperature  # (B, T, V)
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
    return F.pad(lp, (1, 0))


def batch_routing(actor, batch, mode, rows=slice(None)):
    """The R3 context for rows of a batch: replay its recorded experts (a batch without them is refused), or off."""
    if mode == "replay" and batch["experts"] is None:
        raise ValueError(f"R3 replay: the batch carries no routing: {tito.ENGINE_CAPTURE_HINT}; "
                         f"or run with --r3-mode off")
    return r3.routing(actor, mode, experts=batch["experts"][rows] if mode == "replay" else None)


def forward_logprobs(actor, batch, mode, temperature, rows=slice(None), grad=False):
    """token_logprobs under the batch's R3 context."""
    with batch_routing(actor, batch, mode, rows), torch.set_grad_enabled(grad):
        return token_logprobs(actor, batch, temperature, rows)


def by_length(fn, batch: dict, budget: int | None = C.UPDATE_TOKENS) -> torch.Tensor:
    """fn(sub-batch) -> (b, n), run over the batch's rows longest first in groups of about `budget` tokens
    (critic.row_groups, as the update's pieces: a long row alone, so its forward needs no attention mask and
    SDPA skips the causal upper triangle), each group trimmed (trim) -> (B, T), zero after each row's tokens; budget
    None: one call on the whole batch (Megatron over a group)."""
    if budget is None:
        return fn(batch).float() * batch["attention_mask"]
    out = torch.zeros(batch["attention_mask"].shape)
    for rows in C.row_groups(batch["attention_mask"].sum(1), budget):
        sub, n = C.trim(batch, rows)
        out[rows, :n] = fn(sub).float() * sub["attention_mask"]
    return out


def minibatches(n: int, size: int, rng: random.Random):
    idx = list(range(n))
    rng.shuffle(idx)
    return [idx[i:i + size] for i in range(0, n, size)]


BASE_LR, BASE_BATCH = 2e-3, 16  # the base phase's lr and copy samples per step (this project's; paper: no base phase)


def sft(actor, samples: list[dict], args, metrics, phase: str = "sft", epochs: int | None = None,
        lr: float | None = None, batch_size: int | None = None) -> None:
    """SFT warm start: cross-entropy on the sampled (m = 1) tokens of reference trajectories. The base phase
    (phase "base": the embedded model's synthetic pretraining, train_t1.base_phase) runs the same loop on its own
    samples, epochs, lr and batch size."""
    epochs = args.sft_epochs if epochs is None else epochs
    lr = args.sft_lr if lr is None else lr
    batch_size = args.sft_batch_size if batch_size is None else batch_size
    opt = torch.optim.AdamW(actor.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    size = C.update_rows(actor)
    step = 0
    actor.train()
    for epoch in range(epochs):
        bar = tqdm(minibatches(len(samples), batch_size, rng), desc=f"{phase} epoch {epoch + 1}/{epochs}")
        for mb in bar:
            batch = pad_batch([samples[i] for i in mb], args.reward_scale)
            n = C.agg_count(batch["mask"])  # the minibatch's tokens: each piece's part of the mean
            opt.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for p in C.pieces(batch, size):  # by length: no compute on padding, the gradients summed
                part = -C.masked_mean(forward_logprobs(actor, p, "off", 1.0, grad=True), p["mask"], n)  # NLL of the
                part.backward()  # reference actions
                loss = loss + part.detach()
            torch.nn.utils.clip_grad_norm_(actor.parameters(), args.max_grad_norm)
            opt.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}")
            metrics.write({f"{phase}_loss": loss.item(), "epoch": epoch}, step, phase)


@torch.no_grad()
def copy_accuracy(actor, samples: list[dict]) -> float:
    """The copy gate's figure: teacher-forced greedy accuracy on the copied tokens of data.copy_samples (those from
    each sample's copy_from on; the "copy:" cue and <|im_end|> excluded)."""
    batch = pad_batch(samples, 1.0)
    mask = torch.zeros_like(batch["mask"])
    for b, s in enumerate(samples):
        mask[b, s["copy_from"]:len(s["tokens"]) - 1] = 1
    was = actor.training
    actor.eval()
    with r3.routing(actor, "off"):
        logits = actor(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    actor.train(was)
    hit = (logits[:, :-1].argmax(-1) == batch["input_ids"][:, 1:]).float() * mask[:, 1:]
    return float(hit.sum() / mask[:, 1:].sum())


def critic_warmup(critic, opt, samples, args, group=None) -> list[dict]:
    """Critic Warm-Up: critic-only epochs on SFT-policy rollouts; EV of every update from the first."""
    rng = random.Random(args.seed + 1)
    recs = []
    for epoch in range(args.critic_warmup_epochs):
        for mb in tqdm(minibatches(len(samples), args.minibatch_size, rng), desc="critic warm-up"):
            batch = local_rows(pad_batch([samples[i] for i in mb], args.reward_scale, reward_mode=args.reward_mode),
                               group, even(args, group))  # the reward the RL phase trains on
            old = by_length(lambda sub: C.compute_values(critic, sub["input_ids"], sub["attention_mask"]), batch,
                            None if even(args, group) else C.UPDATE_TOKENS)  # zeros on a rank with no row
            _, returns = C.gae(batch["rewards"], old, batch["mask"], args.gamma, args.lam)
            batch.update(old_values=old, returns=returns)
            stats = C.critic_update(critic, opt, [batch], args.clip_eps_v, 1, args.max_grad_norm, group, args.loss_agg)
            recs.append({"explained_variance": stats["charts/explained_variance"],
                         "explained_variance_traj": stats["charts/explained_variance_traj"],
                         "value_loss": stats["losses/value_loss"], "value_clipfrac": stats["losses/value_clipfrac"]})
    return recs


def ppo_loss(logp, old_logp, adv, mask, clip_eps: float, agg: str = "token", n=None) -> torch.Tensor:
    """The paper's clipped surrogate over the m = 1 tokens (all (B, T)); agg / n as in critic.aggregate.

    old_logp are the behaviour policy's (the weights that sampled the batch), logp the actor's being trained."""
    ratio = (logp - old_logp).exp()  # r_j = pi_theta(a_j | s_j) / pi_old(a_j | s_j)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    # L = -E_j[min(r_j A_j, clip(r_j, 1 - eps, 1 + eps) A_j)]
    return C.aggregate(torch.max(pg_loss1, pg_loss2), mask, agg, n)


# k3 grows as exp(log pi_ref / pi_theta): one token the policy has all but dropped (pi_theta << pi_ref) gave a k3 of
# 1.8e6 at actor lr 3e-4 (results/LOG.md, 2026-12-03: RL at 256 trajectories a step), a gradient that swamps the
# minibatch's policy gradient under the norm clip. Beyond this log ratio k3 continues as its tangent line: the pull
# back to pi_ref stays, bounded (paper silent: the paper runs without KL; verl's low_var_kl clamps the value instead,
# which drops the pull on those tokens).
KL_K3_LINEAR_BEYOND = 2.0  # log ratio where k3 turns linear (pi_theta = 13.5% of pi_ref); slope e^2 - 1 ~ 6.4


def kl_k3(logp, ref_logp) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) from the sampled tokens (B, T), >= 0: k3 = r - log r - 1 with
    r = pi_ref / pi_theta (unbiased), continued linearly beyond log r = KL_K3_LINEAR_BEYOND (bounded gradient)."""
    log_r = ref_logp - logp  # log pi_ref / pi_theta at the sampled token
    c = KL_K3_LINEAR_BEYOND
    inside = log_r.clamp(max=c)  # the exact k3 up to c, its tangent at c beyond (value and slope continuous)
    return inside.exp() - inside - 1 + (math.exp(c) - 1) * (log_r - inside)


def load_balancing_loss(router_logits: list, experts: list, token_mask: torch.Tensor) -> torch.Tensor:
    """The Switch / Qwen-MoE auxiliary loss of the routers, mean over layers (what HF adds with
    router_aux_loss_coef): aux_l = E * sum_e f_e * P_e over the tokens of token_mask (N,) where f_e is the fraction
    of tokens dispatched to expert e (over the k choices; the replayed experts under R3) and P_e the mean router
    probability of e. router_logits[l] (N, E), experts[l] (N, k)."""
    m = token_mask.reshape(-1).float()  # (N,)
    out = []
    for logits, idx in zip(router_logits, experts):
        E = logits.shape[-1]
        probs = F.softmax(logits.float(), dim=-1)  # (N, E)
        counts = F.one_hot(idx.long(), E).float().sum(1)  # (N, E): how many of the token's k slots chose e
        f = (counts * m[:, None]).sum(0) / m.sum().clamp(min=1.0)  # (E,), sums to k
        P = (probs * m[:, None]).sum(0) / m.sum().clamp(min=1.0)  # (E,)
        out.append(E * (f * P).sum())  # aux_l = E * sum_e f_e P_e (k with a uniform router)
    return torch.stack(out).mean()


def policy_forward(actor, batch: dict, temperature: float, rows, entropy: bool = False, aux: bool = False):
    """(logprobs (B, T), entropy (B, T) or None, load-balancing loss or None) of the rows, in the caller's R3 context.

    entropy[:, j] is the entropy of pi(. | tokens[:j]) (aligned with logprobs[:, j]); aux from the routers' logits
    of this forward (hf actor: r3.routers' outputs). Neither asked: token_logprobs unchanged."""
    if not (entropy or aux):
        return token_logprobs(actor, batch, temperature, rows), None, None
    ids, am = batch["input_ids"][rows], batch["attention_mask"][rows]
    seen = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: seen.append((out[0], out[2]))) for r in r3.routers(actor)]
    try:
        logits = actor(input_ids=ids, attention_mask=C.causal_mask(am)).logits.float() / temperature  # (B, T, V)
    finally:
        for h in hooks:
            h.remove()
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V)
    lp = F.pad(logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))  # (B, T)
    ent = F.pad(-(logp_all.exp() * logp_all).sum(-1), (1, 0)) if entropy else None  # H = -sum_v p log p
    lb = load_balancing_loss([l for l, _ in seen], [i for _, i in seen], am) if aux else None
    return lp, ent, lb


def actor_piece(actor, p: dict, args, n, n_tok, aux_share=None) -> torch.Tensor:
    """Forward + backward of one piece of a minibatch (critic.pieces: its rows, or all of them) under the piece's R3
    replay; every term divided by the minibatch's count n (tokens or samples, critic.agg_count), so that the pieces'
    gradients add up to the minibatch's. aux_share: the load-balancing loss's weight (the piece's share of the
    minibatch's tokens over the ranks). -> the piece's (pg_loss, approx_kl, clipfrac, kl, entropy, aux), which add up
    over the pieces (aux: one piece)."""
    m, old, adv = p["mask"], p["old"], p["adv"]
    with batch_routing(actor, p, args.r3_mode):  # ALGO LOGIC: the clipped surrogate, R3 replay
        newlogprob, entropy, aux = policy_forward(actor, p, args.temperature, slice(None),
                                                  args.entropy_coef > 0, args.aux_loss_coef > 0)
        logratio = newlogprob - old
        ratio = logratio.exp()
        pg_loss = ppo_loss(newlogprob, old, adv, m, args.clip_eps, args.loss_agg, n)
        loss, extra = pg_loss, torch.zeros(3)
        if args.kl_coef > 0:  # KL(pi_theta || pi_SFT), k3 on the sampled tokens
            kl = C.aggregate(kl_k3(newlogprob, p["ref"]), m, args.loss_agg, n)
            loss, extra[0] = loss + args.kl_coef * kl, kl.detach()
        if args.entropy_coef > 0:  # entropy bonus
            ent = C.aggregate(entropy, m, args.loss_agg, n)
            loss, extra[1] = loss - args.entropy_coef * ent, ent.detach()
        if args.aux_loss_coef > 0:
            aux = aux if aux_share is None else aux * aux_share
            loss, extra[2] = loss + args.aux_loss_coef * aux, aux.detach()
        loss.backward()  # inside the routing context: recompute replays the same experts
    with torch.no_grad():
        return torch.cat([torch.stack([pg_loss, C.masked_mean((ratio - 1) - logratio, m, n_tok),
                                       C.masked_mean(((ratio - 1).abs() > args.clip_eps).float(), m, n_tok)]), extra])


def ppo_update(actor, opt, batch, advantages, old_logprobs, args, rng, n_samples: int, group=None,
               ref_logprobs=None, padded: bool = False) -> dict:
    """PPO clipped surrogate on the m = 1 tokens (ppo_loss), with R3 replay in every forward (and its recompute),
    plus the optional terms, all off in the paper: kl_coef x k3 KL to the SFT reference (ref_logprobs),
    - entropy_coef x entropy, aux_loss_coef x the routers' load-balancing loss.

    batch, advantages, old_logprobs: this rank's rows (all n_samples on one rank); minibatches are drawn over
    all n_samples with the same rng on every rank, each rank trains its share (dp.py: data parallel). Each
    minibatch runs by length (critic.pieces, UPDATE_TOKENS: no compute on padding) with one optimizer step; in one
    padded forward with padded, on a Megatron actor, or with the aux loss (a product of two means over the
    minibatch's tokens: it does not split into rows)."""
    if args.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("--kl-coef > 0: ppo_update needs the SFT reference's logprobs (ref_logprobs)")
    size = C.update_rows(actor, padded or args.aux_loss_coef > 0)
    actor.train()
    stats = {"pg_loss": [], "approx_kl": [], "clipfrac": [], "losses/kl": [], "losses/entropy": [], "losses/aux": []}
    for _ in range(args.ppo_epochs):
        for mb in tqdm(minibatches(n_samples, args.minibatch_size, rng), desc="ppo update", leave=False):
            mb = share(mb, group, even(args, group))
            sub, _ = C.trim({**batch, "old": old_logprobs, "adv": advantages, "ref": ref_logprobs}, mb,
                            cut=not even(args, group))  # this rank's rows, cut after the longest
            m = sub["mask"]
            n_tok = C.agg_count(m, "token", group)  # tokens of the whole minibatch
            n = n_tok if args.loss_agg == "token" else C.agg_count(m, args.loss_agg, group)
            opt.zero_grad()
            st = torch.zeros(6)  # pg_loss, approx_kl, clipfrac, kl, entropy, aux (this rank's part)
            share_aux = None
            if args.aux_loss_coef > 0 and group is not None:  # this rank's rows, weighted by their share of the
                am = sub["attention_mask"].sum().float()  # minibatch's tokens (a rank without rows joins the sum)
                share_aux = am / dp_sum(am, group)
            for p in C.pieces(sub, size):  # none on a rank without rows: it still joins the gradient sum
                st = st + actor_piece(actor, p, args, n, n_tok, share_aux)
            optimizer_step(actor, opt, args.max_grad_norm, group)  # sum over ranks, clip: the one-rank step
            for k, v in zip(stats, dp_sum(st.detach(), group).tolist()):
                stats[k].append(v)
    return {k: float(np.mean(v)) for k, v in stats.items()}


def r3_off_step(args, step: int) -> bool:
    """Whether RL step `step` (from 1) runs the R3-off diagnostic forward (dlogp_r3_off, expert_set_mismatch):
    every --r3-off-every K steps from the first (steps 1, 1 + K, ...); K = 0 never."""
    k = args.r3_off_every
    return k > 0 and (step - 1) % k == 0


def train_step(actor, behaviour, critic, actor_opt, critic_opt, samples, args, rng, run_dir: Path,
               step: int, group=None, ref=None, padded: bool = False) -> dict:
    """Steps 5-6 of the paper's step: V_old -> GAE -> critic update (first) -> old logprobs -> PPO (R3 replay).

    `behaviour` holds the weights the engine served when it sampled these trajectories (version t-1 under
    one-step async): the trainer's old logprobs pi^t_{t-1} come from it, so the PPO ratio compares two
    versions of the same policy and |dlogp| measures only the train-inference mismatch (paper, R3/TITO).
    With a group of N ranks this rank computes V_old, GAE and old logprobs of its samples (i = rank mod N)
    only, and trains its share of every minibatch. ref: the frozen SFT actor (kl_coef > 0 only).
    Returns the update's statistics and reward_mean, the mean reward of the batch it trained on; dlogp_r3_off and
    expert_set_mismatch are NaN on a step without the R3-off diagnostic forward (r3_off_step).
    padded: every minibatch in one padded forward (the update before pieces; the reference of the tests).
    """
    full = pad_batch(samples, args.reward_scale, args.r3_mode == "replay", args.reward_mode)  # every rank: (B, T)
    groups = task_groups(samples, required=args.advantage == "grpo")
    if args.advantage == "grpo":  # on the whole batch (a group may span ranks), then this rank's rows
        full["grpo_adv"] = grpo_advantages(full["rewards"].sum(1), groups)[:, None] * full["mask"]
    batch = local_rows(full, group, even(args, group))  # this rank's samples (B_local, T)
    no_rows = torch.zeros_like(batch["mask"]) if len(batch["mask"]) == 0 else None  # fewer samples than ranks
    chunk = None if even(args, group) else C.UPDATE_TOKENS  # no-grad forwards by length (by_length), but Megatron
    nan = float("nan")
    if args.advantage == "grpo":  # the GRPO arm: no critic, no V_old, no critic update
        advantages = batch["grpo_adv"] * batch["mask"]
        cstats = {"charts/explained_variance": nan, "charts/explained_variance_traj": nan, "losses/value_loss": nan,
                  "losses/value_clipfrac": nan}
    else:
        # ALGO LOGIC: 5. critic: V_old before its update, GAE (gamma = lambda = 1), critic update FIRST
        old_values = (no_rows if no_rows is not None  # V_old (B_local, T)
                      else by_length(lambda sub: C.compute_values(critic, sub["input_ids"], sub["attention_mask"]),
                                     batch, chunk))
        advantages, returns = C.gae(batch["rewards"], old_values, batch["mask"], args.gamma, args.lam)
        mbs = [C.trim({**batch, "old_values": old_values, "returns": returns}, mb, cut=chunk is not None)[0]
               for mb in (share(mb, group, even(args, group))
                          for mb in minibatches(len(samples), args.minibatch_size, rng))]
        log(run_dir, f"step {step}: critic update")
        cstats = C.critic_update(critic, critic_opt, mbs, args.clip_eps_v, args.critic_epochs, args.max_grad_norm,
                                 group, args.loss_agg, padded)
    # ALGO LOGIC: 6. actor: old logprobs from the trainer with R3 replay, then PPO with replay
    m = batch["mask"]
    if args.kl_coef > 0 and ref is None:
        raise ValueError("--kl-coef > 0: train_step needs the SFT reference actor (ref)")
    sets = [0, 0]  # (position, layer) pairs whose live expert set differs from the recorded one, pairs counted

    def live(sub):  # R3 off: the logprobs and the expert sets the trainer's own routing picks
        with r3.routing(behaviour, "record") as rec, torch.no_grad():
            lp = token_logprobs(behaviour, sub, args.temperature)
            if sub["experts"] is not None:
                sets[:] = np.add(sets, r3.mismatch_counts(rec.experts, sub["experts"], sub["attention_mask"],
                                                          sub["mask"])).tolist()
        return lp
    old_logprobs = no_rows if no_rows is not None else by_length(  # pi^t_{t-1} with R3 replay
        lambda sub: forward_logprobs(behaviour, sub, args.r3_mode, args.temperature), batch, chunk)
    diagnose = r3_off_step(args, step)  # R3 off: every --r3-off-every steps
    if diagnose:
        log(run_dir, f"step {step}: R3-off diagnostic")
    lp_off = (no_rows if no_rows is not None else by_length(live, batch, chunk)) if diagnose else None
    ref_logprobs = (None if args.kl_coef == 0 else no_rows if no_rows is not None else by_length(  # pi_SFT, under
        lambda sub: forward_logprobs(ref, sub, args.r3_mode, args.temperature), batch, chunk))  # the same R3 replay
    mismatch = (sets[0] / sets[1] if sets[1] else 0.0) if batch["experts"] is not None and no_rows is None \
        and diagnose else nan  # the share of expert sets live routing would change
    log(run_dir, f"step {step}: actor update")
    t0 = time.time()
    astats = ppo_update(actor, actor_opt, batch, advantages, old_logprobs, args, rng, len(samples), group,
                        ref_logprobs, padded)
    r = full["rewards"].sum(1)
    return {"reward_mean": float(r.mean()),  # the rewards trained on: one per sample
            # groups (tasks) in which every sample failed (reward 0): no GRPO signal there
            "all_fail_group_frac": float(np.mean([bool((r[g] == 0).all()) for g in groups])),
            "explained_variance": cstats["charts/explained_variance"],
            "explained_variance_traj": cstats["charts/explained_variance_traj"],  # one point per trajectory
            "value_loss": cstats["losses/value_loss"],
            "value_clipfrac": cstats["losses/value_clipfrac"],
            "dlogp": C.dp_masked_mean((old_logprobs - batch["rollout_logprobs"]).abs(), m, group).item(),  # |dlogp|
            "dlogp_r3_off": (C.dp_masked_mean((lp_off - batch["rollout_logprobs"]).abs(), m, group).item()
                             if diagnose else nan),
            "expert_set_mismatch": mismatch, **astats,  # mismatch: over rank 0's samples only
            "train_tokens_per_s": float(full["attention_mask"].sum()) * args.ppo_epochs / max(time.time() - t0, 1e-9)}
