"""Critic: the paper's full-size value model, GAE, clipped value loss, explained variance, warm-up.

Paper section "critic" (T1, arXiv 2609.11042): a full-size critic with the actor's architecture and a scalar head,
the only baseline (no GRPO group baseline); one epoch of Critic Warm-Up before RL; every step the critic is updated
*before* the actor, at lr 1.5e-5 against the actor's 1.0e-6 (the seeds also call it "30x", which those values
are not: 15x; Args keeps the absolute values); GAE with gamma = lambda = 1 from V_old (the values before the critic
update); value clip eps_v = 0.2 around V_old; reward on the last token; EV = 1 - Var(R - V) / Var(R) logged.

Conventions (the mask convention of tito.py): tensors are (B, T) by token position j; m[j] = 1 iff token j was
sampled; values[:, j] = V(tokens[:j]), as logprobs[:, j] = log pi(tokens[j] | tokens[:j]); GAE skips m = 0 tokens
(tool output, template glue) and carries the bootstrap across. Every function takes an optional `group` (the
trainer ranks under --trainer-ranks N): losses over the minibatch's global token count, gradients summed over ranks
before clipping (dp.py); group=None runs no collective.

Run: used by train_t1.py; `python -m pytest tests/test_critic.py` checks it.

Departures from the paper:
  1. The critic backbone is initialised from the SFT actor (the paper does not say how; initialising from the
     policy is the common choice and keeps the warm-up short).
  2. Warm-up pool: by default rollouts of the SFT policy on the training pool (the paper warms up on a separate
     pool, TMax-15k); `warmup_critic` takes any list of samples.
  3. Loss aggregation (paper silent): `aggregate` averages per token over the minibatch by default, or per sample
     (slime's default) with train_t1's --loss-agg, for the value and the PPO loss alike.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AutoModel

import dp


def masked_mean(x: torch.Tensor, mask: torch.Tensor, n: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of x over positions where mask == 1 (the one masking helper; see tito.py).

    n: the denominator when these rows are one rank's share of a minibatch (its global token count)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / (mask.sum().clamp(min=1.0) if n is None else n)


AGGS = ("token", "sample")


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str = "token", n: torch.Tensor | None = None) -> torch.Tensor:
    """A per-token loss x (B, T) reduced to a scalar over the masked positions (paper silent on which).

    agg "token": sum over every masked token of the minibatch / its token count (one weight per token: a
    long trajectory weighs more). agg "sample": mean over the tokens of each sample, then mean over the samples
    with at least one masked token (one weight per trajectory; slime's default, without
    --calculate-per-token-loss). n: the denominator (tokens, or samples) when these rows are one rank's share."""
    if agg == "token":
        return masked_mean(x, mask, n)
    if agg != "sample":
        raise ValueError(f"loss aggregation: expected one of {'|'.join(AGGS)}, got {agg!r}")
    mask = mask.to(x.dtype)
    per_sample = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,): mean over each sample's tokens
    return per_sample.sum() / ((mask.sum(-1) > 0).sum().to(x.dtype).clamp(min=1.0) if n is None else n)


def agg_count(mask: torch.Tensor, agg: str = "token", group=None) -> torch.Tensor:
    """The denominator of `aggregate` over every rank (the minibatch's tokens or samples; this rank's alone without a
    group): what each piece of a minibatch (`pieces`) divides its loss by, so that the pieces sum to the whole."""
    local = mask.sum() if agg == "token" else (mask.sum(-1) > 0).sum()
    return dp.dp_sum(local.to(torch.float32), group).clamp(min=1.0)


# --- pieces of a minibatch: no compute on padding -------------------------------------------------------------------

# tokens per forward + backward of an update (critic and actor minibatches, SFT; also per no-grad forward of a step,
# ppo.by_length; this project's choice): the rows go longest first, a piece takes rows while (its rows) x (its
# longest row) <= UPDATE_TOKENS (row_groups), each piece cut after its longest row. A row longer than the budget
# runs alone with no padding left, so its attention mask is dropped and attention runs causal only (SDPA skips the
# upper triangle); short rows share a piece (one call instead of many: one by one, short rows cost more in calls
# than their padding; results/LOG.md 2026-12-06, the update's pieces).
# Each piece's loss divides by the minibatch's count (agg_count) and the gradients add up before the one optimizer
# step: the same step as one padded forward of the minibatch, to float rounding. 1: every row alone. None: the
# minibatch's rows in one padded forward (Megatron, the aux loss, tests).
UPDATE_TOKENS = 512


def trim(batch: dict, rows, cut: bool = True) -> tuple[dict, int]:
    """(the rows' sub-batch with the columns after their longest row cut, that length): every (B, T, ...) tensor of
    batch. Padding is on the right, and a causal forward of a row never reads the columns after it, so a trimmed
    forward gives the same values on the row's tokens; no rows, or cut False: the full width (Megatron ranks over a
    group: every forward is a collective over the expert-parallel ranks, which needs the same shape on each)."""
    am = batch["attention_mask"][rows]
    n = int(am.sum(1).max()) if len(am) and cut else am.shape[1]
    return {k: (v[rows][:, :n] if torch.is_tensor(v) and v.dim() >= 2 else v) for k, v in batch.items()}, n


def pieces(batch: dict, budget: int | None = UPDATE_TOKENS):
    """The sub-batches of a minibatch's rows, one forward + backward each: longest first, a piece adding rows while
    (rows) x (its longest row) <= budget (a row over it alone; budget 1: every row alone), each piece cut after its
    longest row (trim); budget None: the batch itself, one piece (none when it has no rows)."""
    B = batch["attention_mask"].shape[0]
    if budget is None:
        return [batch] if B else []
    return [trim(batch, rows)[0] for rows in row_groups(batch["attention_mask"].sum(1), budget)]


def row_groups(lens: torch.Tensor, budget: int) -> list[list[int]]:
    """Row indices in groups, longest first: a group adds rows while (rows) x (its longest row) <= budget tokens (a
    row over it alone)."""
    out, cur = [], []
    for i in torch.argsort(lens, descending=True, stable=True).tolist():
        if cur and (len(cur) + 1) * int(lens[cur[0]]) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


def update_rows(model, padded: bool = False) -> int | None:
    """UPDATE_TOKENS (the pieces' budget) for an HF model; None (one padded forward per minibatch) for a Megatron
    one (cluster/mcore*.py keep their full-width forwards: over a group every forward is a collective that needs
    equal shapes) or padded."""
    return None if padded or getattr(model, "backend", "hf") != "hf" else UPDATE_TOKENS


def causal_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask an HF forward gets: None where every position is a token (a row cut after its last token),
    which the causal mask alone covers exactly and lets SDPA skip the causal upper triangle; else the mask."""
    return None if attention_mask is None or bool(attention_mask.all()) else attention_mask


def dp_masked_mean(x: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """masked_mean over the masked positions of every rank (a statistic, no gradient)."""
    if group is None:
        return masked_mean(x, mask)
    return dp.dp_sum(masked_mean(x, mask, dp.dp_sum(mask.sum().to(x.dtype), group).clamp(min=1.0)), group)


# --- value model ------------------------------------------------------------------------------------

HEAD_INITS = ("zero", "default")  # --critic-head-init


class Critic(nn.Module):
    """Same architecture as the actor (Qwen3.5-MoE backbone) with a scalar value head."""

    backend = "hf"  # the trainer's backend attribute (mcore.MegatronCritic: "megatron")

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = AutoModel.from_config(config, dtype=torch.float32)  # the actor's `model.` submodule's class
        self.value_head = nn.Linear(config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_actor(cls, actor, head_init: str = "zero") -> "Critic":
        """Full-size critic initialised from the actor's backbone (departure 1). head_init (paper silent): "zero", the
        value head predicts 0 until trained; "default", nn.Linear's own random init (a miscalibrated cold critic, the
        kind behind the paper's cold-start EV of -33.6; the second cold-start arm of the experiments)."""
        if head_init not in HEAD_INITS:
            raise ValueError(f"--critic-head-init: expected one of {'|'.join(HEAD_INITS)}, got {head_init!r}")
        critic = cls(actor.config)
        critic.model.load_state_dict(actor.model.state_dict())
        if head_init == "default":
            critic.value_head.reset_parameters()
        return critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """values (B, T): values[:, j] = V(tokens[:j]); values[:, 0] = 0 (no action at j = 0)."""
        h = self.model(input_ids=input_ids, attention_mask=causal_mask(attention_mask)).last_hidden_state  # (B, T, H)
        v = self.value_head(h).squeeze(-1).float()  # (B, T): value of the prefix ending at position t
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # shift: V(s_j) from h_{j-1}


# --- advantages ---------------------------------------------------------------------------------------

def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over the action tokens of each row.

    rewards, values, mask: (B, T). Steps are the positions with mask == 1 in order; the step after the
    last action is terminal (value 0). Returns (advantages, returns), both (B, T), zero where mask == 0.
    With gamma = lambda = 1 (paper) this is A_j = (sum of rewards from j on) - V_old(s_j).
    """
    if not (rewards.shape == values.shape == mask.shape and rewards.dim() == 2):
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and "
                         f"mask {tuple(mask.shape)} must all be the same (B, T)")
    B, T = rewards.shape
    m = mask.bool()
    advantages = torch.zeros_like(values, dtype=torch.float32)
    lastgaelam = torch.zeros(B, dtype=torch.float32, device=values.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=values.device)  # V of the state after the last action
    for t in reversed(range(T)):  # tool-output positions (m = 0) carry lastgaelam and next_value unchanged
        delta = rewards[:, t].float() + gamma * next_value - values[:, t].float()  # delta_t = r_t + g V_{t+1} - V_t
        gae_t = delta + gamma * lam * lastgaelam
        lastgaelam = torch.where(m[:, t], gae_t, lastgaelam)
        next_value = torch.where(m[:, t], values[:, t].float(), next_value)
        advantages[:, t] = torch.where(m[:, t], gae_t, torch.zeros_like(gae_t))
    returns = (advantages + values.float()) * m  # R_j = A_j + V_old(s_j)
    return advantages, returns


# --- losses and diagnostics ---------------------------------------------------------------------------

def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps_v: float, n: torch.Tensor | None = None, agg: str = "token",
               n_tok: torch.Tensor | None = None):
    """Clipped value loss around V_old (paper: eps_v = 0.2). Returns (loss, clipfrac).

    agg: how the per-token losses are reduced (`aggregate`; the paper is silent; "token" was the only choice
    before --loss-agg); n as in `aggregate`. clipfrac is a per-token fraction (n_tok: the minibatch's tokens over
    every rank; with agg "token" n is that count)."""
    v_clipped = old_values + (values - old_values).clamp(-clip_eps_v, clip_eps_v)
    v_loss_unclipped = (values - returns) ** 2
    v_loss_clipped = (v_clipped - returns) ** 2
    v_loss = 0.5 * aggregate(torch.max(v_loss_unclipped, v_loss_clipped), mask, agg, n)
    clipfrac = masked_mean(((values - old_values).abs() > clip_eps_v).float(), mask, n if agg == "token" else n_tok)
    return v_loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group=None) -> float:
    """EV = 1 - Var(R - V) / Var(R) over the masked positions (unbounded below; nan if Var(R) ~ 0).

    Over several ranks from the summed moments (n, sum R, sum R^2, sum d, sum d^2 with d = R - V)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    if group is not None:
        n, sr, srr, sd, sdd = dp.dp_sum(torch.stack([torch.tensor(r.numel(), dtype=torch.float64), r.sum(),
                                                      (r * r).sum(), (r - v).sum(), ((r - v) ** 2).sum()]), group)
        if n < 2 or srr / n - (sr / n) ** 2 <= 1e-12:
            return float("nan")
        return float(1.0 - (sdd / n - (sd / n) ** 2) / (srr / n - (sr / n) ** 2))
    if r.numel() < 2:
        return float("nan")
    var_r = r.var(unbiased=False)
    if var_r <= 1e-12:  # constant returns (up to float error of A + V): EV is undefined, not -1e13
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)


@torch.no_grad()
def compute_values(critic: Critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """V_old (B, T) in eval mode; called before the critic update (paper: GAE and clip use V_old)."""
    critic.eval()
    return critic(input_ids, attention_mask)


def critic_update(critic: Critic, optimizer: torch.optim.Optimizer, batches, clip_eps_v: float,
                  epochs: int = 1, max_grad_norm: float = 1.0, group=None, agg: str = "token",
                  padded: bool = False) -> dict:
    """One critic update over minibatches of dicts with input_ids, attention_mask, mask, returns, old_values.

    With a group, each dict holds this rank's rows of the minibatch (possibly none) and every rank passes
    as many. Returns mean value loss, clip fraction and the explained variance of the *pre-update* values.
    agg: the value loss's reduction over tokens ("token" | "sample", `aggregate`). Each minibatch runs in pieces
    (`pieces`, UPDATE_TOKENS) with one optimizer step; padded: in one padded forward (the reference of the tests).
    """
    size = update_rows(critic, padded)
    critic.train()
    losses, clipfracs = [], []
    for _ in range(epochs):
        for b in batches:
            n_tok = agg_count(b["mask"], "token", group)  # minibatch tokens over every rank (None: one rank)
            n = n_tok if agg == "token" else agg_count(b["mask"], agg, group)  # the loss's denominator
            optimizer.zero_grad()
            loss = clipfrac = torch.zeros(())
            for p in pieces(b, size):  # none on a rank without rows, which still joins the gradient sum
                values = critic(p["input_ids"], p["attention_mask"])
                l, c = value_loss(values, p["old_values"], p["returns"], p["mask"], clip_eps_v, n, agg, n_tok)
                l.backward()  # over the minibatch's count: the pieces' losses and gradients add up to the whole
                loss, clipfrac = loss + l.detach(), clipfrac + c.detach()
            dp.optimizer_step(critic, optimizer, max_grad_norm, group)
            loss, clipfrac = dp.dp_sum(torch.stack([loss.detach(), clipfrac.detach()]), group)
            losses.append(loss.item())
            clipfracs.append(clipfrac.item())
    old = torch.cat([b["old_values"][b["mask"].bool()] for b in batches])
    ret = torch.cat([b["returns"][b["mask"].bool()] for b in batches])
    ev = explained_variance(old, ret, torch.ones_like(ret), group)
    first = [first_sampled(b) for b in batches]  # one (V_old, R) per trajectory: at its first sampled token
    v0, r0 = torch.cat([f[0] for f in first]), torch.cat([f[1] for f in first])
    return {"losses/value_loss": sum(losses) / max(len(losses), 1),
            "losses/value_clipfrac": sum(clipfracs) / max(len(clipfracs), 1),
            "charts/explained_variance": ev,
            "charts/explained_variance_traj": explained_variance(v0, r0, torch.ones_like(r0), group)}


def first_sampled(b: dict) -> tuple:
    """(old value, return) at the first m = 1 token of every row that has one: the critic's prediction of the
    trajectory's outcome before the agent's first reply, so the EV over them weighs every trajectory once (the
    token-level EV weighs long ones more)."""
    m = b["mask"].bool()
    rows = torch.nonzero(m.any(1)).flatten()
    j = m.float().argmax(1)[rows]
    return b["old_values"][rows, j], b["returns"][rows, j]
