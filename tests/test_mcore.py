"""Tests for cluster/mcore.py on CPU: tiny Megatron-Core MoE vs its HF twin, conversion both ways, native R3 replay,
the Megatron critic vs critic.Critic's conventions."""
import pytest
import torch

pytest.importorskip("megatron.core")
import critic  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_convert  # noqa: E402
import r3  # noqa: E402
from transformers import Qwen3MoeForCausalLM, Qwen3MoeModel  # noqa: E402

from mcore_common import *  # noqa: E402,F401,F403  B, T, V, actor, batch, logprobs, routing_maps, ...


@pytest.fixture(scope="module")
def hf_cfg():
    return mcore.tiny_hf_config(V)


@pytest.fixture(scope="module")
def hf(hf_cfg):
    torch.manual_seed(0)
    return r3.install(Qwen3MoeForCausalLM(hf_cfg)).eval()


def test_hf_and_megatron_logits_agree(hf, actor, batch):
    ids, am = batch
    with torch.no_grad():
        a, b = hf(input_ids=ids, attention_mask=am).logits, actor(input_ids=ids, attention_mask=am).logits
    assert torch.allclose(a[am.bool()], b[am.bool()], atol=1e-5, rtol=0)


def test_hf_megatron_hf_round_trip_gives_equal_logprobs(hf, hf_cfg, actor, batch):
    ids, am = batch
    back = Qwen3MoeForCausalLM(hf_cfg).eval()
    back.load_state_dict(mcore_convert.megatron_to_hf(actor.gpt.state_dict(), hf_cfg), strict=True)
    with torch.no_grad():
        assert torch.equal(logprobs(hf, ids, am), logprobs(back, ids, am))


def test_megatron_hf_megatron_round_trip_gives_equal_weights(hf_cfg, actor):
    sd = {k: v for k, v in actor.gpt.state_dict().items() if not k.endswith("_extra_state")}
    again = mcore_convert.hf_to_megatron(mcore_convert.megatron_to_hf(sd, hf_cfg), hf_cfg)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


def test_megatron_replays_a_recorded_routing_under_perturbed_router_weights(hf, hf_cfg, actor, batch):
    check_replay_under_perturbed_routers(hf, hf_cfg, actor, batch, n_layers=2, n_experts=4, top_k=2)


def test_megatron_replay_matches_hf_replay_and_gradient_reaches_forced_experts(hf, actor, batch):
    got, want = replay_forced(hf, actor, batch, 2, (2, 3))  # experts 2 and 3 everywhere: not what the live router picks
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    g = r3.megatron_routers(actor.gpt)[0].weight.grad  # (E, H)
    assert g[2].abs().sum() > 0 and g[3].abs().sum() > 0
    assert g[:2].abs().max() < 1e-4 * g[2:].abs().max()  # softmax over the recorded k only
    actor.zero_grad()


def test_megatron_placeholder_rows_use_live_routing_and_bad_slices_raise(actor, batch):
    ids, am = batch
    live = routing_maps(actor, lambda: actor(input_ids=ids, attention_mask=am))
    forced = torch.full((B, T, 2, 2), -1, dtype=torch.int32)

    def replay():
        with torch.no_grad(), r3.routing(actor, "replay", forced):
            actor(input_ids=ids, attention_mask=am)
    assert all(torch.equal(a, b) for a, b in zip(live, routing_maps(actor, replay)))
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
    for preset in ("qwen35-122b-a10b", "qwen35-35b-a3b"):  # the paper's model and its sibling
        cfg, vocab = mcore.qwen35_config(preset, tp=2, ep=8, moe_permute_fusion=False)  # permute fusion needs TE
        assert cfg.moe_enable_routing_replay and not cfg.moe_router_fusion and cfg.moe_aux_loss_coeff == 0.0
        assert cfg.moe_token_dispatcher_type == "flex" and cfg.moe_flex_dispatcher_backend == "deepep"
        assert cfg.experimental_attention_variant == "gated_delta_net" and cfg.attention_output_gate
        assert cfg.sequence_parallel and vocab == 248320
    cfg, _ = mcore.qwen35_config("qwen35-122b-a10b", moe_permute_fusion=False)
    assert (cfg.num_layers, cfg.num_moe_experts, cfg.moe_router_topk, cfg.hidden_size) == (48, 256, 8, 3072)


# --- the critic ----------------------------------------------------------------------------------------
class HFCritic(critic.Critic):
    """critic.Critic (zero-init head, forward with its shift) on the tiny Qwen3-MoE backbone of these tests."""

    def __init__(self, config):
        torch.nn.Module.__init__(self)
        self.config, self.model = config, Qwen3MoeModel(config)
        self.value_head = torch.nn.Linear(config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)


@pytest.fixture(scope="module")
def hf_critic(hf, hf_cfg):
    c = HFCritic(hf_cfg)
    c.model.load_state_dict(hf.model.state_dict())
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained-looking head, so values depend on the backbone
        c.value_head.weight.copy_(torch.randn(c.value_head.weight.shape, generator=g))
        c.value_head.bias.fill_(0.3)
    return c.eval()


@pytest.fixture(scope="module")
def mg_critic(hf_critic, hf_cfg):
    c = mcore.MegatronCritic(mcore.build_tiny(hf_cfg, moe_enable_routing_replay=False))
    sd = mcore_convert.critic_hf_to_megatron(hf_critic.state_dict(), hf_cfg)
    missing, unexpected = c.gpt.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return c.eval()


def test_megatron_critic_values_match_hf_critic(hf_critic, mg_critic, batch):
    ids, am = batch
    want, got = critic.compute_values(hf_critic, ids, am), critic.compute_values(mg_critic, ids, am)  # (B, T)
    assert got.shape == (B, T) and got.dtype == torch.float32 and torch.all(got[:, 0] == 0)
    dv = (got - want)[am.bool()].abs().max().item()
    print(f"max |dV| HF vs Megatron critic: {dv:.2e}")
    assert dv < 1e-5 and want[am.bool()].abs().max() > 0.1


def test_critic_hf_megatron_hf_round_trip_is_bit_equal(hf_critic, mg_critic, hf_cfg):
    sd = hf_critic.state_dict()
    back = mcore_convert.critic_megatron_to_hf(mg_critic.gpt.state_dict(), hf_cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_critic_from_actor_copies_backbone_with_zero_head(actor, hf_critic, mg_critic, batch):
    ids, am = batch
    c = mcore.MegatronCritic.from_actor(actor)
    assert torch.equal(critic.compute_values(c, ids, am), torch.zeros(B, T))  # zero head: V = 0, as critic.Critic
    sd, act = c.gpt.state_dict(), actor.gpt.state_dict()
    backbone = [k for k in act if not k.startswith("output_layer.") and not k.endswith("_extra_state")]
    assert all(torch.equal(sd[k], act[k]) for k in backbone)
    routers = [m for m in c.gpt.modules() if hasattr(m, "router_replay")]
    assert len(routers) == 2 and all(r.router_replay is None for r in routers)  # live routing, no RouterReplay
    with torch.no_grad():  # same head as hf_critic -> same values: the backbone is the actor's
        c.gpt.output_layer.weight.copy_(mg_critic.gpt.output_layer.weight)
        c.gpt.output_layer.bias.copy_(mg_critic.gpt.output_layer.bias)
    dv = (critic.compute_values(c, ids, am) - critic.compute_values(hf_critic, ids, am))[am.bool()].abs().max().item()
    print(f"max |dV| from_actor critic vs HF critic: {dv:.2e}")
    assert dv < 1e-5


def test_critic_update_step_lowers_clipped_value_loss(actor, batch):
    ids, am = batch
    c = mcore.MegatronCritic.from_actor(actor)
    old = critic.compute_values(c, ids, am)  # (B, T) V_old
    mask = am.clone()
    mask[:, 0] = 0
    returns = torch.linspace(0.2, 1.0, T).expand(B, T) * mask  # (B, T)
    b = {"input_ids": ids, "attention_mask": am, "mask": mask, "returns": returns, "old_values": old}
    before = critic.value_loss(old, old, returns, mask, 0.2)[0].item()
    opt = torch.optim.Adam(c.parameters(), lr=1e-2)
    stats = critic.critic_update(c, opt, [b], clip_eps_v=0.2)
    after = critic.value_loss(critic.compute_values(c, ids, am), old, returns, mask, 0.2)[0].item()
    assert stats["losses/value_loss"] == pytest.approx(before) and after < before
    assert all(p.grad is not None for p in c.gpt.output_layer.parameters())


def test_critic_value_at_j_uses_only_tokens_before_j(mg_critic, batch):
    ids, am = batch
    j = 5
    other = ids.clone()
    other[:, j] = (ids[:, j] + 7) % V
    a, b = critic.compute_values(mg_critic, ids, am), critic.compute_values(mg_critic, other, am)
    assert torch.allclose(a[:, : j + 1], b[:, : j + 1], atol=1e-6, rtol=0)
    assert (a[:, j + 1:] - b[:, j + 1:]).abs().max() > 1e-4


def test_trainer_bench_runs_the_trainers_megatron_path(tmp_path):
    """`python -m experiments.bench trainer` (what `python -m cluster.launch gpu-check` runs on a GPU for the cluster
    model): here, on the CPU, the bf16 trainer (local modules, ShardedAdam with fp32 masters) from a bf16 checkpoint,
    2 real train_steps on trajectories recorded by the HF model; dlogp = the HF fp32 vs Megatron bf16 mismatch of the
    same weights (measured 1.1e-3 with R3, 1.9e-3 without on 256 tokens)."""
    import json
    import os
    import subprocess
    import sys
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "experiments.bench", "trainer", "--shape", "t1-tiny", "--tokens", "96",
                          "--steps", "2", "--param-dtype", "bf16", "--torch-threads", "1"],
                         cwd=root, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(tmp_path.glob("t1-trainer-bench-*"))  # its checkpoint's temporary folder is removed
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(res)
    assert res["param_dtype"] == "torch.bfloat16" and res["optimizer"] == "ShardedAdam" and res["device"] == "cpu"
    assert [r["step"] for r in res["steps"]] == [1, 2]
    for r in res["steps"]:
        assert 0 < r["dlogp"] < 0.05 and 0 < r["dlogp_r3_off"] < 0.05 and r["tokens_per_s"] > 0
    assert res["steps"][1]["approx_kl"] > 0  # step 2's policy is not step 1's: the update moved the weights
