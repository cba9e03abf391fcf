"""critic.py: GAE against a plain recursion, clipped value loss against a reference, EV, the critic model."""
import math
import random

import pytest
import torch

import critic as C


def reference_gae(rewards, values, mask, gamma, lam):
    """The textbook recursion on the compacted action steps of one row (plain Python lists)."""
    steps = [t for t in range(len(mask)) if mask[t]]
    adv = [0.0] * len(mask)
    lastgaelam, next_value = 0.0, 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        lastgaelam = delta + gamma * lam * lastgaelam
        adv[t] = lastgaelam
        next_value = values[t]
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_reference_recursion(gamma, lam):
    rng = random.Random(0)
    B, T = 4, 37
    mask = torch.tensor([[float(rng.random() < 0.6) for _ in range(T)] for _ in range(B)])
    mask[:, -1] = 1
    rewards = torch.randn(B, T) * mask
    values = torch.randn(B, T)
    adv, ret = C.gae(rewards, values, mask, gamma, lam)
    for b in range(B):
        ref = reference_gae(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
        assert torch.allclose(adv[b], torch.tensor(ref), atol=1e-5)
    assert torch.allclose(ret, (adv + values) * mask, atol=1e-6)
    assert (adv[mask == 0] == 0).all()


def test_gae_gamma_lambda_one_is_returns_to_go_minus_v_old():
    """Paper: gamma = lambda = 1 and the reward on the last token -> A_j = r - V_old(s_j) on every action."""
    T = 20
    mask = torch.zeros(1, T)
    mask[0, 3:8] = 1
    mask[0, 12:18] = 1  # two turns, tool output in between
    rewards = torch.zeros(1, T)
    rewards[0, 17] = 0.35  # r = P / S = 7 / 20
    v_old = torch.linspace(-1, 1, T)[None]
    adv, ret = C.gae(rewards, v_old, mask, 1.0, 1.0)
    m = mask.bool()
    assert torch.allclose(adv[m], 0.35 - v_old[m], atol=1e-6)
    assert torch.allclose(ret[m], torch.full_like(ret[m], 0.35), atol=1e-6)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same"):
        C.gae(torch.zeros(2, 5), torch.zeros(2, 4), torch.ones(2, 5), 1.0, 1.0)


def test_clipped_value_loss_matches_reference():
    torch.manual_seed(0)
    v, v_old, ret = torch.randn(3, 9), torch.randn(3, 9), torch.randn(3, 9)
    mask = (torch.rand(3, 9) > 0.3).float()
    loss, clipfrac = C.value_loss(v, v_old, ret, mask, 0.2)
    ref_terms, n, nclip = 0.0, 0, 0
    for b in range(3):
        for t in range(9):
            if mask[b, t]:
                vc = v_old[b, t] + max(-0.2, min(0.2, float(v[b, t] - v_old[b, t])))
                ref_terms += max(float(v[b, t] - ret[b, t]) ** 2, float(vc - ret[b, t]) ** 2)
                n += 1
                nclip += abs(float(v[b, t] - v_old[b, t])) > 0.2
    assert loss.item() == pytest.approx(0.5 * ref_terms / n, rel=1e-5)
    assert clipfrac.item() == pytest.approx(nclip / n, rel=1e-6)


def test_clipped_value_loss_limits_the_move_away_from_v_old():
    """Far from V_old the clipped branch dominates: the gradient pushes no further than eps_v allows."""
    v_old = torch.zeros(1, 1)
    ret = torch.ones(1, 1)
    v = torch.full((1, 1), -0.5, requires_grad=True)  # moved the wrong way by more than eps_v
    loss, _ = C.value_loss(v, v_old, ret, torch.ones(1, 1), 0.2)
    loss.backward()
    assert v.grad.item() < 0  # still pulled towards the return


def test_explained_variance():
    ret = torch.tensor([0.0, 0.1, 0.5, 0.3])
    m = torch.ones(4)
    assert C.explained_variance(ret, ret, m) == pytest.approx(1.0)
    assert C.explained_variance(torch.full_like(ret, ret.mean()), ret, m) == pytest.approx(0.0, abs=1e-9)
    assert C.explained_variance(-ret * 10, ret, m) < 0  # unbounded below
    assert C.explained_variance(ret, torch.zeros(4), m) != C.explained_variance(ret, torch.zeros(4), m)  # nan
    almost_constant = torch.full((4,), 0.05) + torch.tensor([0.0, 1e-9, -1e-9, 0.0])  # float error of A + V
    assert math.isnan(C.explained_variance(torch.zeros(4), almost_constant, m))


def test_critic_has_actor_architecture_and_aligned_values():
    import model as M
    tok = M.train_tokenizer(["ls -la /app\n", "cat notes.txt | wc -l\n"] * 20, vocab_size=300)
    actor = M.build_actor(M.tiny_config(len(tok)), seed=0)
    critic = C.Critic.from_actor(actor)
    n_actor = sum(p.numel() for p in actor.model.parameters())
    n_critic = sum(p.numel() for p in critic.model.parameters())
    assert n_actor == n_critic  # full-size critic: the same backbone
    ids = torch.randint(3, len(tok), (2, 12))
    v = critic(ids)
    assert v.shape == (2, 12) and (v[:, 0] == 0).all()
    # V(s_j) depends only on tokens[:j]: changing token j leaves values[:, :j+1] unchanged
    torch.nn.init.normal_(critic.value_head.weight)
    ids2 = ids.clone()
    ids2[:, 7] = (ids2[:, 7] + 1) % len(tok)
    v1, v2 = critic(ids), critic(ids2)
    assert torch.allclose(v1[:, :8], v2[:, :8]) and not torch.allclose(v1[:, 8:], v2[:, 8:])


def test_critic_head_init_zero_predicts_zero_and_default_does_not():
    """--critic-head-init: zero (the default) predicts exactly 0 before training; default (nn.Linear's init, the
    miscalibrated cold critic of the second cold-start arm) does not; the backbone is the actor's either way."""
    import model as M
    actor = M.build_actor(M.tiny_config(300), seed=0)
    ids = torch.randint(3, 300, (2, 9))
    zero, rand = C.Critic.from_actor(actor), C.Critic.from_actor(actor, "default")
    assert torch.equal(zero(ids), torch.zeros(2, 9))
    assert zero(ids).shape == rand(ids).shape and rand(ids).abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(zero.model.state_dict().values(), rand.model.state_dict().values()))
    with pytest.raises(ValueError, match="--critic-head-init"):
        C.Critic.from_actor(actor, "xavier")


def test_explained_variance_per_trajectory_weighs_each_trajectory_once():
    """critic_update's per-trajectory EV reads V_old and R at each row's first m = 1 token: a long trajectory whose
    values are right at every token counts once, not once per token; a row without sampled tokens is skipped."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0],
                         [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    returns = torch.tensor([1.0, 0.0, 1.0, 0.0])[:, None].expand(4, 8).clone() * mask
    old = returns.clone()
    old[1, 3], old[2, 2] = 1.0, 0.0  # rows 1 and 2: wrong at their first sampled token only
    v0, r0 = C.first_sampled({"mask": mask, "returns": returns, "old_values": old})
    assert v0.tolist() == [1.0, 1.0, 0.0] and r0.tolist() == [1.0, 0.0, 1.0]
    assert C.explained_variance(v0, r0, torch.ones(3)) == pytest.approx(-2.0)  # 1 - Var(r - v) / Var(r) = 1 - 3
    assert C.explained_variance(old, returns, mask) == pytest.approx(1 - (2 / 11) / (18 / 121))  # the long row's 7
