"""Tests for cluster/mcore_weights.py's Transformer-Engine layout (to_te_layout / from_te_layout /
load_hf_into_cluster_model): the cluster model's parameter names. On CPU: the renames against names listed here per
layer type from megatron-core 0.16.1's TE spec (cluster/mcore_convert.py, the comment above _fused_input_norm), round
trips, expert numbering after shard_for_ep. On a GPU with Transformer Engine: the real `mcore._qwen35_gpt` has exactly
those names and loads HF weights round trip."""
import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core")
import infra  # noqa: E402
from cluster import mcore  # noqa: E402
from cluster import mcore_convert  # noqa: E402
from cluster import mcore_weights  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM  # noqa: E402

V = 96


def hf_state_dict(hf_cfg, seed=0):
    torch.manual_seed(seed)
    cls = Qwen3_5MoeForCausalLM if mcore_convert.is_qwen35(hf_cfg) else Qwen3MoeForCausalLM
    m = cls(hf_cfg)
    with torch.no_grad():  # norms and gates off their init, so a swapped norm would show in the values
        for name, p in m.named_parameters():
            if "norm" in name or "gate" in name or "dt_bias" in name:
                p.add_(0.1 * torch.randn(p.shape))
    return m.state_dict()


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def layout(request):
    """(hf config, local-layout Megatron state dict from hf_to_megatron) for each of mcore's two layouts."""
    hf_cfg = mcore.tiny_qwen35_hf_config(V) if request.param == "qwen3_5_moe" else mcore.tiny_hf_config(V)
    return hf_cfg, mcore_convert.hf_to_megatron(hf_state_dict(hf_cfg), hf_cfg)


def expected_te_keys(hf_cfg, n_local_experts):
    """The TE spec's parameter names, per layer type, written out from megatron-core 0.16.1's source:
    GDN layer = GatedDeltaNet(in_proj: TELayerNormColumnParallelLinear, conv1d, dt_bias, A_log, out_norm: TENorm,
    out_proj: TERowParallelLinear), input_layernorm IdentityOp; attention layer = SelfAttention(linear_qkv:
    TELayerNormColumnParallelLinear, q/k_layernorm: TENorm, linear_proj), input_layernorm IdentityOp; MoE =
    pre_mlp_layernorm TENorm + TopKRouter + TEGroupedMLP(GroupedLinear weight0..n-1) [+ SharedExpertMLP]."""
    keys = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    for i in range(hf_cfg.num_hidden_layers):
        m = f"decoder.layers.{i}."
        if mcore_convert.is_qwen35(hf_cfg) and hf_cfg.layer_types[i] == "linear_attention":
            keys |= {m + "self_attention." + n for n in ("in_proj.weight", "in_proj.layer_norm_weight",
                                                         "conv1d.weight", "dt_bias", "A_log", "out_norm.weight",
                                                         "out_proj.weight")}
        else:
            keys |= {m + "self_attention." + n for n in ("linear_qkv.weight", "linear_qkv.layer_norm_weight",
                                                         "q_layernorm.weight", "k_layernorm.weight",
                                                         "linear_proj.weight")}
        keys |= {m + "pre_mlp_layernorm.weight", m + "mlp.router.weight"}
        keys |= {f"{m}mlp.experts.linear_fc{j}.weight{e}" for j in (1, 2) for e in range(n_local_experts)}
        if mcore_convert.is_qwen35(hf_cfg):
            keys |= {m + "mlp.shared_experts." + n for n in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")}
    return keys


def test_te_layout_has_exactly_the_te_spec_names(layout):
    hf_cfg, local = layout
    te = mcore_convert.to_te_layout(local, hf_cfg)
    assert set(te) == expected_te_keys(hf_cfg, hf_cfg.num_experts)
    assert len(te) == len(local)  # a rename: nothing merged or dropped
    for i in range(hf_cfg.num_hidden_layers):  # the input norm moved into the TE linear that follows it
        fused = [k for k in te if k.startswith(f"decoder.layers.{i}.") and k.endswith("layer_norm_weight")]
        assert len(fused) == 1 and torch.equal(te[fused[0]], local[f"decoder.layers.{i}.input_layernorm.weight"])


def test_local_te_local_round_trip_is_bit_exact(layout):
    hf_cfg, local = layout
    te = mcore_convert.to_te_layout(local, hf_cfg)
    back = mcore_convert.from_te_layout(te, hf_cfg)
    assert back.keys() == local.keys() and all(torch.equal(back[k], local[k]) for k in local)
    again = mcore_convert.to_te_layout(back, hf_cfg)
    assert again.keys() == te.keys() and all(torch.equal(again[k], te[k]) for k in te)


@pytest.mark.parametrize("ep_size", [2, 4])
def test_grouped_experts_are_numbered_by_local_index_after_shard_for_ep(layout, ep_size):
    hf_cfg, local = layout
    E = hf_cfg.num_experts  # 4 (Qwen3-MoE) or 8 (Qwen3.5)
    per = E // ep_size
    for rank in range(ep_size):
        shard = mcore_convert.shard_for_ep(local, E, rank, ep_size)
        te = mcore_convert.to_te_layout(shard, hf_cfg)
        assert set(te) == expected_te_keys(hf_cfg, per)
        for i in range(hf_cfg.num_hidden_layers):
            for j in range(per):  # GroupedLinear weight{j} on rank r = global expert r * per + j
                for fc in ("linear_fc1", "linear_fc2"):
                    glob = local[f"decoder.layers.{i}.mlp.experts.local_experts.{rank * per + j}.{fc}.weight"]
                    assert torch.equal(te[f"decoder.layers.{i}.mlp.experts.{fc}.weight{j}"], glob)
        back = mcore_convert.from_te_layout(te, hf_cfg)
        assert back.keys() == shard.keys() and all(torch.equal(back[k], shard[k]) for k in shard)


def test_te_layout_after_shard_for_tp_keeps_the_norm_whole(layout):
    hf_cfg, local = layout
    shard = mcore_convert.shard_for_tp(mcore_convert.shard_for_ep(local, hf_cfg.num_experts, 1, 2), hf_cfg, 1, 2)
    te = mcore_convert.to_te_layout(shard, hf_cfg)
    assert set(te) == expected_te_keys(hf_cfg, hf_cfg.num_experts // 2)
    H = hf_cfg.hidden_size
    norms = [k for k in te if k.endswith("layer_norm_weight")]  # LayerNormLinear's norm: replicated, (H,)
    assert len(norms) == hf_cfg.num_hidden_layers and all(te[k].shape == (H,) for k in norms)
    back = mcore_convert.from_te_layout(te, hf_cfg)
    assert back.keys() == shard.keys() and all(torch.equal(back[k], shard[k]) for k in shard)


@pytest.mark.parametrize("cuts", [(0, 2, 4), (0, 1, 4), (0, 3, 4)], ids=["2+2", "1+3", "3+1"])
def test_te_layout_under_pipeline_stages_round_trips(layout, cuts):
    """PP with the TE names (the 35B one-node preset's plan): the trainer's loads name each layer's fused input norm
    by its GLOBAL layer number (GDN in_proj or attention linear_qkv), then cut the stage out and number its layers
    from 0 (to_te_layout, then shard_for_pp); the gather maps a stage back with its first layer's global number
    (from_te_layout(first=...)) before unshard_pp. The whole model comes back bit for bit for every cut, including
    one where a stage starts on the attention layer (3+1); a stage gathered with the wrong `first` (0) does not."""
    hf_cfg, sd = layout
    if cuts[-1] != hf_cfg.num_hidden_layers:  # the 2-layer Qwen3-MoE: one cut, 1 + 1
        cuts = (0, 1, hf_cfg.num_hidden_layers)
    te = mcore_convert.to_te_layout(sd, hf_cfg)
    stages = [(a, mcore_convert.shard_for_pp(te, a, b, a == 0, b == hf_cfg.num_hidden_layers))
              for a, b in zip(cuts[:-1], cuts[1:])]
    back = mcore_convert.unshard_pp([(a, mcore_convert.from_te_layout(part, hf_cfg, a)) for a, part in stages])
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    if mcore_convert.is_qwen35(hf_cfg):  # GDN and attention layers name their norm differently: the offset matters
        wrong = mcore_convert.unshard_pp([(a, mcore_convert.from_te_layout(part, hf_cfg, 0)) for a, part in stages])
        assert wrong.keys() != sd.keys()


def test_to_te_layout_refuses_a_dict_without_the_input_norms(layout):
    hf_cfg, local = layout
    with pytest.raises(KeyError, match="input_layernorm"):
        mcore_convert.to_te_layout({k: v for k, v in local.items() if "input_layernorm" not in k}, hf_cfg)


# --- GPU + Transformer Engine: the cluster model itself --------------------------------------------------------
needs_te = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
                              reason="needs CUDA and Transformer Engine (the cluster model's TE spec)")


@needs_te
def test_cluster_model_has_the_te_layout_names_and_loads_hf_round_trip(monkeypatch):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.ssm import gated_delta_net as gdn
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    if importlib.util.find_spec("fla") is None:  # GatedDeltaNet.__init__ checks this flag alone; no forward here
        monkeypatch.setattr(gdn, "HAVE_FLA", True)
    p = mcore.megatron_shape(infra.MODEL_SHAPES["qwen35-35b-a3b"])
    hf_cfg = mcore.tiny_qwen35_hf_config(p["vocab_size"])  # _qwen35_gpt takes the preset's vocab
    gpt = mcore._qwen35_gpt(  # the preset at tiny_qwen35_hf_config's sizes; fp32 so the round trip is exact
        "qwen35-35b-a3b", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, moe_token_dispatcher_type="alltoall",  # flex needs TP*EP > 1
        bf16=False, params_dtype=torch.float32).cuda()
    names = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    sd = hf_state_dict(hf_cfg)
    assert names == expected_te_keys(hf_cfg, 8)
    assert names == set(mcore_convert.to_te_layout(mcore_convert.hf_to_megatron(sd, hf_cfg), hf_cfg))
    mcore_weights.load_hf_into_cluster_model(gpt, sd, hf_cfg)
    te = {k: v.cpu() for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    back = mcore_convert.megatron_to_hf(mcore_convert.from_te_layout(te, hf_cfg), hf_cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
