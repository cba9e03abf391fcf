"""Tests for cluster/mcore.py's Qwen3.5 layout on CPU: Megatron-Core's GatedDeltaNet + gated attention + MoE with a
gated shared expert (local modules, torch GDN kernel) vs HF Qwen3_5MoeForCausalLM, conversion both ways, native R3."""
import pytest
import torch

pytest.importorskip("megatron.core")
import critic  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_convert  # noqa: E402
from cluster import mcore_weights  # noqa: E402
import r3  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM  # noqa: E402

from mcore_common import *  # noqa: E402,F401,F403  B, T, V, actor, batch, logprobs, routing_maps, ...

L, K, E = 4, 2, 8  # L MoE layers (every layer), top-K of E experts


@pytest.fixture(scope="module")
def hf_cfg():
    return mcore.tiny_qwen35_hf_config(V)


@pytest.fixture(scope="module")
def hf(hf_cfg):
    torch.manual_seed(0)
    m = r3.install(Qwen3_5MoeForCausalLM(hf_cfg)).eval()
    with torch.no_grad():  # move norms, gates and dt_bias off their init so each conversion rule is exercised
        for name, p in m.named_parameters():
            if "norm" in name or "gate" in name or "dt_bias" in name:
                p.add_(0.1 * torch.randn(p.shape))
    return m


def test_qwen35_builds_megatron_gdn_gated_attention_and_gated_shared_expert(actor):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention
    layers = actor.gpt.decoder.layers
    assert [type(l.self_attention) for l in layers] == [GatedDeltaNet] * 3 + [SelfAttention]
    assert actor.gpt.config.attention_output_gate and actor.gpt.config.layernorm_zero_centered_gamma
    assert all(l.mlp.shared_experts.gate_weight.shape == (1, 32) for l in layers)
    assert actor.gpt.rotary_pos_emb.inv_freq.numel() == 2  # rotary on 16 * 0.25 = 4 of 16 head dims


def test_qwen35_hf_and_megatron_logits_agree(hf, actor, batch):
    ids, am = batch
    with torch.no_grad():
        a, b = hf(input_ids=ids, attention_mask=am).logits, actor(input_ids=ids, attention_mask=am).logits
    d = (a - b)[am.bool()].abs().max().item()
    print(f"max |dlogit| HF vs Megatron Qwen3.5: {d:.2e} (logits up to {a.abs().max().item():.2f})")
    assert d < 1e-6  # measured 1.4e-7 (fp32; two torch chunked delta-rule kernels, two attentions)


def test_qwen35_hf_megatron_hf_round_trip_is_bit_equal(hf, hf_cfg, actor):
    sd = hf.state_dict()
    back = mcore_convert.megatron_to_hf(actor.gpt.state_dict(), hf_cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_qwen35_megatron_hf_megatron_round_trip_is_bit_equal(hf_cfg):
    gpt = mcore.build_tiny(hf_cfg, seed=3)  # Megatron's own init: out_norm 0, A_log from its range
    sd = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    again = mcore_convert.hf_to_megatron(mcore_convert.megatron_to_hf(sd, hf_cfg), hf_cfg)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


def test_qwen35_megatron_replays_a_recorded_routing_under_perturbed_router_weights(hf, hf_cfg, actor, batch):
    check_replay_under_perturbed_routers(hf, hf_cfg, actor, batch, n_layers=L, n_experts=E, top_k=K)


def test_qwen35_megatron_replay_matches_hf_replay_and_gradient_reaches_gdn(hf, actor, batch):
    got, want = replay_forced(hf, actor, batch, L, (5, 6))  # experts 5 and 6 everywhere
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    gdn = actor.gpt.decoder.layers[0].self_attention
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (gdn.A_log, gdn.dt_bias, gdn.conv1d.weight))
    g = r3.megatron_routers(actor.gpt)[0].weight.grad  # (E, H): softmax over the recorded K only
    assert g[5:7].abs().sum() > 0 and g[[0, 1, 2, 3, 4, 7]].abs().max() < 1e-4 * g[5:7].abs().max()
    actor.zero_grad()


def test_qwen35_critic_from_actor_gives_zero_values_then_trains(actor, batch):
    ids, am = batch
    c = mcore.MegatronCritic.from_actor(actor)
    assert torch.equal(critic.compute_values(c, ids, am), torch.zeros(B, T))  # zero head, as critic.Critic
    mask = am.clone()
    mask[:, 0] = 0
    old = critic.compute_values(c, ids, am)
    returns = torch.linspace(0.2, 1.0, T).expand(B, T) * mask  # (B, T)
    b = {"input_ids": ids, "attention_mask": am, "mask": mask, "returns": returns, "old_values": old}
    critic.critic_update(c, torch.optim.Adam(c.parameters(), lr=1e-2), [b], clip_eps_v=0.2)
    after = critic.value_loss(critic.compute_values(c, ids, am), old, returns, mask, 0.2)[0].item()
    assert after < critic.value_loss(old, old, returns, mask, 0.2)[0].item()


def test_trainer_models_take_the_qwen35_embedded_preset(batch):
    import model as model_lib
    cfg = model_lib.tiny_config(V)  # the embedded preset train_t1 builds (hidden 128, GDN x3 + attention)
    hf = model_lib.build_actor(cfg, seed=0).eval()
    actor, behaviour, c = mcore.trainer_models(hf)
    ids, am = batch
    with torch.no_grad():
        a, b = hf(input_ids=ids, attention_mask=am).logits, actor(input_ids=ids, attention_mask=am).logits
    d = (a - b)[am.bool()].abs().max().item()
    print(f"max |dlogit| HF vs Megatron, embedded Qwen3.5 preset: {d:.2e}")
    assert d < 1e-5
    back = mcore_weights.to_hf(actor, cfg).state_dict()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_megatrons_fused_functions_run_eager_on_cpu(actor, batch):
    """On a CUDA-less torch Megatron's jit_fuser functions (torch.compile: the gated attention's output gate, the GDN
    gated norm, the experts' activation) run eager (cluster/mcore_cpu.init_cpu): dynamo traces no frame in a forward
    and backward of the Qwen3.5 actor (with compile it traced several and inductor compiled C++)."""
    from torch._dynamo.utils import counters
    ids, am = batch
    before = counters["frames"]["total"]
    actor(input_ids=ids, attention_mask=am).logits.sum().backward()
    actor.zero_grad()
    assert counters["frames"]["total"] == before and not torch.cuda.is_available()
