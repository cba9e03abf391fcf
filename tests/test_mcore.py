"""Tests for mcore.py on CPU: tiny Megatron-Core MoE vs its HF twin, conversion both ways, native R3 replay."""
import pytest
import torch

pytest.importorskip("megatron.core")
import mcore  # noqa: E402
import r3  # noqa: E402
from transformers import Qwen3MoeForCausalLM  # noqa: E402

B, T, V = 2, 12, 96


@pytest.fixture(scope="module")
def hf_cfg():
    return mcore.tiny_hf_config(V)


@pytest.fixture(scope="module")
def hf(hf_cfg):
    torch.manual_seed(0)
    return r3.install(Qwen3MoeForCausalLM(hf_cfg)).eval()


@pytest.fixture(scope="module")
def actor(hf, hf_cfg):
    gpt = mcore.load_hf_into_megatron(mcore.build_tiny(hf_cfg), hf.state_dict(), hf_cfg)
    return mcore.MegatronActor(gpt).eval()


@pytest.fixture(scope="module")
def batch():
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(1))  # (B, T)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 9:] = 0  # right padding, as train_t1.pad_batch
    return ids, am


def logprobs(model, ids, am):
    logits = model(input_ids=ids, attention_mask=am).logits.float()  # (B, T, V)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * am[:, 1:]  # (B, T-1)


def chosen_experts(actor, fn):
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


def test_hf_and_megatron_logits_agree(hf, actor, batch):
    ids, am = batch
    with torch.no_grad():
        a, b = hf(input_ids=ids, attention_mask=am).logits, actor(input_ids=ids, attention_mask=am).logits
    assert torch.allclose(a[am.bool()], b[am.bool()], atol=1e-5, rtol=0)


def test_hf_megatron_hf_round_trip_gives_equal_logprobs(hf, hf_cfg, actor, batch):
    ids, am = batch
    back = Qwen3MoeForCausalLM(hf_cfg).eval()
    back.load_state_dict(mcore.megatron_to_hf(actor.gpt.state_dict(), hf_cfg), strict=True)
    with torch.no_grad():
        assert torch.equal(logprobs(hf, ids, am), logprobs(back, ids, am))


def test_megatron_hf_megatron_round_trip_gives_equal_weights(hf_cfg, actor):
    sd = {k: v for k, v in actor.gpt.state_dict().items() if not k.endswith("_extra_state")}
    again = mcore.hf_to_megatron(mcore.megatron_to_hf(sd, hf_cfg), hf_cfg)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


def test_megatron_replays_a_recorded_routing_under_perturbed_router_weights(hf, hf_cfg, actor, batch):
    ids, am = batch
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(input_ids=ids, attention_mask=am)
        recorded = rec.experts  # (B, T, L, k) from the native RECORD action
    assert recorded.shape == (B, T, 2, 2)
    other = mcore.MegatronActor(mcore.load_hf_into_megatron(mcore.build_tiny(hf_cfg), hf.state_dict(), hf_cfg)).eval()
    with torch.no_grad():
        for r in r3.megatron_routers(other.gpt):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(2)))
    live = chosen_experts(other, lambda: other(input_ids=ids, attention_mask=am))

    def replay():
        with torch.no_grad(), r3.routing(other, "replay", recorded):
            other(input_ids=ids, attention_mask=am)
    got = chosen_experts(other, replay)
    want = r3.slice_for_megatron(recorded)  # per layer (T * B, k), Megatron's [s, b] order
    for l in range(2):
        assert torch.equal(got[l], as_map(want[l], 4))
    assert any(not torch.equal(live[l], got[l]) for l in range(2))  # the replay really overrode live routing
    assert all(rp.router_replay_action is None for rp in (r.router_replay for r in r3.megatron_routers(other.gpt)))


def test_megatron_replay_matches_hf_replay_and_gradient_reaches_forced_experts(hf, actor, batch):
    ids, am = batch
    forced = torch.zeros(B, T, 2, 2, dtype=torch.int32)
    forced[..., 0], forced[..., 1] = 2, 3  # experts 2 and 3 everywhere: not what the live router picks
    with torch.no_grad(), r3.routing(hf, "replay", forced):
        want = logprobs(hf, ids, am)
    actor.zero_grad()
    with r3.routing(actor, "replay", forced):  # the training-step interface of the embedded backend
        got = logprobs(actor, ids, am)
        got.sum().backward()
    assert torch.allclose(got.detach(), want, atol=1e-5, rtol=0)
    g = r3.megatron_routers(actor.gpt)[0].weight.grad  # (E, H)
    assert g[2].abs().sum() > 0 and g[3].abs().sum() > 0
    assert g[:2].abs().max() < 1e-4 * g[2:].abs().max()  # softmax over the recorded k only
    actor.zero_grad()


def test_megatron_placeholder_rows_use_live_routing_and_bad_slices_raise(actor, batch):
    ids, am = batch
    live = chosen_experts(actor, lambda: actor(input_ids=ids, attention_mask=am))
    forced = torch.full((B, T, 2, 2), -1, dtype=torch.int32)

    def replay():
        with torch.no_grad(), r3.routing(actor, "replay", forced):
            actor(input_ids=ids, attention_mask=am)
    assert all(torch.equal(a, b) for a, b in zip(live, chosen_experts(actor, replay)))
    short = r3.slice_for_megatron(forced[:, : T - 2])
    with pytest.raises(ValueError, match="replay slice"), torch.no_grad():
        with r3.megatron_routing(actor.gpt, "replay", short):
            actor(input_ids=ids, attention_mask=am)
    with pytest.raises(ValueError, match="one \\(N, k\\) tensor per MoE layer"):
        with r3.megatron_routing(actor.gpt, "replay", short[:1]):
            pass


def test_router_fusion_is_refused(actor):
    cfg = r3.megatron_routers(actor.gpt)[0].config
    cfg.moe_router_fusion = True  # one config object is shared by every layer
    try:
        with pytest.raises(ValueError, match="fusion"):
            with r3.routing(actor, "replay", torch.zeros(B, T, 2, 2, dtype=torch.int32)):
                pass
    finally:
        cfg.moe_router_fusion = False


def test_mismatch_is_zero_against_own_recording(actor, batch):
    ids, am = batch
    with torch.no_grad(), r3.routing(actor, "record") as rec:
        actor(input_ids=ids, attention_mask=am)
        recorded = rec.experts
    m = am.float()
    assert r3.mismatch(actor, ids, am, recorded, m) == 0.0
    flipped = recorded.clone()
    flipped[..., 0] = (recorded[..., 1] + 1) % 4
    flipped[..., 1] = (recorded[..., 1] + 2) % 4  # never contains b: a different set everywhere
    assert r3.mismatch(actor, ids, am, flipped, m) > 0.5


def test_qwen35_cluster_config_has_r3_on_fusion_off_aux_zero_flex_dispatch():
    for preset in mcore.QWEN35_PRESETS:
        cfg, vocab = mcore.qwen35_config(preset, tp=2, ep=8, moe_permute_fusion=False)  # permute fusion needs TE
        assert cfg.moe_enable_routing_replay and not cfg.moe_router_fusion and cfg.moe_aux_loss_coeff == 0.0
        assert cfg.moe_token_dispatcher_type == "flex" and cfg.moe_flex_dispatcher_backend == "deepep"
        assert cfg.experimental_attention_variant == "gated_delta_net" and cfg.attention_output_gate
        assert cfg.sequence_parallel and vocab == 248320
    cfg, _ = mcore.qwen35_config("qwen35-122b-a10b", moe_permute_fusion=False)
    assert (cfg.num_layers, cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size) == (48, 256, 8, 3072)
