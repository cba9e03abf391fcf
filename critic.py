"""Critic: the paper's full-size value model, GAE, clipped value loss, explained variance, warm-up.

Paper section "critic" (T1, arXiv 2609.11042):
  * a full-size critic with the actor's architecture and a scalar head ("T1 uses a 122B critic of the
    same size as the actor"); the critic is the only baseline (no GRPO group baseline: "GRPO's
    group-relative advantage is identically zero on tasks the whole group fails");
  * Critic Warm-Up: one epoch of critic-only training before RL (warm start EV 0.71-0.86 vs cold start
    -33.6, 30 of 58 logged steps negative);
  * every step the critic is updated *before* the actor at 30x the actor lr (1.5e-5 vs 1.0e-6);
  * GAE with gamma = lambda = 1 from V_old, the values *before* the critic update; value clip
    eps_v = 0.2 around V_old; the reward sits on the last token;
  * explained variance EV = 1 - Var(R - V) / Var(R) is logged (unbounded below).

Conventions (shared with tito.py): every per-token tensor is indexed by token position j of the sample,
shape (B, T). m[j] = 1 iff token j was sampled by the policy (an action). values[:, j] is V(s_j), the
value of the prefix tokens[:j], i.e. the head applied to the hidden state at position j-1, exactly as
logprobs[:, j] = log pi(tokens[j] | tokens[:j]). Tool output and template glue (m = 0) are environment
transitions: GAE skips them and carries the bootstrap across.

Run: this module is used by train_t1.py; `python -m pytest tests/test_critic.py` checks it.

Departures from the paper:
  1. The critic backbone is initialised from the SFT actor (the paper does not say how its critic is
     initialised; initialising from the policy is the common choice and keeps the warm-up short).
  2. Warm-up pool: by default rollouts of the SFT policy on the training pool (the paper warms up on a
     separate pool, TMax-15k); `warmup_critic` takes any list of samples.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from transformers import AutoModel


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over positions where mask == 1 (the one masking helper; see tito.py)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# --- value model ------------------------------------------------------------------------------------

class Critic(nn.Module):
    """Same architecture as the actor (Qwen3.5-MoE backbone) with a scalar value head."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = AutoModel.from_config(config, dtype=torch.float32)  # the actor's `model.` submodule's class
        self.value_head = nn.Linear(config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_actor(cls, actor) -> "Critic":
        """Full-size critic initialised from the actor's backbone (departure 1)."""
        critic = cls(actor.config)
        critic.model.load_state_dict(actor.model.state_dict())
        return critic

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """values (B, T): values[:, j] = V(tokens[:j]); values[:, 0] = 0 (no action at j = 0)."""
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
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
               clip_eps_v: float):
    """Clipped value loss around V_old (paper: eps_v = 0.2). Returns (loss, clipfrac)."""
    v_clipped = old_values + (values - old_values).clamp(-clip_eps_v, clip_eps_v)
    v_loss_unclipped = (values - returns) ** 2
    v_loss_clipped = (v_clipped - returns) ** 2
    v_loss = 0.5 * masked_mean(torch.max(v_loss_unclipped, v_loss_clipped), mask)
    clipfrac = masked_mean(((values - old_values).abs() > clip_eps_v).float(), mask)
    return v_loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """EV = 1 - Var(R - V) / Var(R) over the masked positions (unbounded below; nan if Var(R) ~ 0)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
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
                  epochs: int = 1, max_grad_norm: float = 1.0) -> dict:
    """One critic update over minibatches of dicts with input_ids, attention_mask, mask, returns, old_values.

    Returns mean value loss, clip fraction and the explained variance of the *pre-update* values.
    """
    critic.train()
    losses, clipfracs = [], []
    for _ in range(epochs):
        for b in batches:
            values = critic(b["input_ids"], b["attention_mask"])
            loss, clipfrac = value_loss(values, b["old_values"], b["returns"], b["mask"], clip_eps_v)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(critic.parameters(), max_grad_norm)
            optimizer.step()
            losses.append(loss.item())
            clipfracs.append(clipfrac.item())
    old = torch.cat([b["old_values"][b["mask"].bool()] for b in batches])
    ret = torch.cat([b["returns"][b["mask"].bool()] for b in batches])
    ev = explained_variance(old, ret, torch.ones_like(ret))
    return {"losses/value_loss": sum(losses) / max(len(losses), 1),
            "losses/value_clipfrac": sum(clipfracs) / max(len(clipfracs), 1),
            "charts/explained_variance": ev}
