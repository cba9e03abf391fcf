"""What the Megatron-Core tests share (tests/test_mcore.py: Qwen3-MoE layout, tests/test_mcore_qwen35.py:
Qwen3.5 layout): the batch, the Megatron actor from the module's `hf` fixture, logprobs, routing maps and
the two R3 checks. A test module defines `hf_cfg` and `hf`; `from mcore_common import *` brings the rest."""
import pytest
import torch

from cluster import mcore
from cluster import mcore_weights
import r3

B, T, V = 2, 12, 96
__all__ = ["B", "T", "V", "actor", "batch", "logprobs", "routing_maps", "as_map",
           "check_replay_under_perturbed_routers", "replay_forced"]


@pytest.fixture(scope="module")
def actor(hf, hf_cfg):
    gpt = mcore_weights.load_hf_into_megatron(mcore.build_tiny(hf_cfg), hf.state_dict(), hf_cfg)
    return mcore.MegatronActor(gpt).eval()


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))  # (B, T)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 9:] = 0  # right padding, as ppo.pad_batch
    return ids, am


def logprobs(model, ids, am):
    logits = model(input_ids=ids, attention_mask=am).logits.float()  # (B, T, V)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * am[:, 1:]  # (B, T-1)


def routing_maps(actor, fn):
    """Run fn() and return each TopKRouter's routing_map (N, E) in layer order."""
    maps, hooks = [], [r.register_forward_hook(lambda m, i, o: maps.append(o[1].clone()))
                       for r in r3.megatron_routers(actor.gpt)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return maps


def as_map(layer_ids, E):
    """(N, k) ids -> (N, E) bool."""
    return torch.zeros(layer_ids.shape[0], E, dtype=torch.bool).scatter(1, layer_ids.long(), True)


def check_replay_under_perturbed_routers(hf, hf_cfg, actor, batch, n_layers, n_experts, top_k):
    """Record the actor's routing (native RECORD), perturb the routers of a twin, replay: the twin routes
    exactly as recorded, not as its live routers would, and every replay action is cleared afterwards."""
    ids, am = batch
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(input_ids=ids, attention_mask=am)
        recorded = rec.experts  # (B, T, L, k) from the native RECORD action
    assert recorded.shape == (B, T, n_layers, top_k)
    other = mcore_weights.load_hf_into_megatron(mcore.build_tiny(hf_cfg), hf.state_dict(), hf_cfg)
    other = mcore.MegatronActor(other).eval()
    with torch.no_grad():
        for r in r3.megatron_routers(other.gpt):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(2)))
    live = routing_maps(other, lambda: other(input_ids=ids, attention_mask=am))

    def replay():
        with torch.no_grad(), r3.routing(other, "replay", recorded):
            other(input_ids=ids, attention_mask=am)
    got = routing_maps(other, replay)
    want = r3.slice_for_megatron(recorded)  # per layer (T * B, k), Megatron's [s, b] order
    for l in range(n_layers):
        assert torch.equal(got[l], as_map(want[l], n_experts))
    assert any(not torch.equal(live[l], got[l]) for l in range(n_layers))  # the replay really overrode live routing
    assert all(rp.router_replay_action is None for rp in (r.router_replay for r in r3.megatron_routers(other.gpt)))


def replay_forced(hf, actor, batch, n_layers, experts):
    """Replay the same forced experts (every position, every layer) in HF and in Megatron; backward through
    the Megatron replay (the training-step interface of the embedded backend) -> (got, want) logprobs."""
    ids, am = batch
    forced = torch.zeros(B, T, n_layers, len(experts), dtype=torch.int32)
    for i, e in enumerate(experts):
        forced[..., i] = e
    with torch.no_grad(), r3.routing(hf, "replay", forced):
        want = logprobs(hf, ids, am)
    actor.zero_grad()
    with r3.routing(actor, "replay", forced):
        got = logprobs(actor, ids, am)
        got.sum().backward()
    return got.detach(), want
