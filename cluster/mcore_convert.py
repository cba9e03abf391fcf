"""HF <-> Megatron-Core state dicts (paper: infrastructure: the trainer is Megatron-Core, the engines load Hugging Face
checkpoints): pure functions of state dicts and configs, no model built, no process group; cluster/mcore_weights.py
puts their results into a built model and takes them back out.

- `hf_to_megatron` / `megatron_to_hf` (Qwen3-MoE and Qwen3.5-MoE, local module names), `critic_hf_to_megatron` /
  `critic_megatron_to_hf` (the value head in the output layer's slot); `to_te_layout` / `from_te_layout`: the same
  weights under the Transformer-Engine spec's names.
- `shard_for_tp` / `shard_for_ep` / `shard_for_pp` cut the TP = EP = PP = 1 dict for one rank; `unshard_tp` /
  `unshard_ep` / `unshard_pp` join the ranks' dicts back.

    python -m pytest tests/test_mcore.py -q        # CPU: conversion round trips (Qwen3-MoE, critic), vs the HF twin
    python -m pytest tests/test_mcore_qwen35.py -q # CPU: the same for Qwen3.5
    python -m pytest tests/test_mcore_te.py -q     # CPU: TE names per layer type, round trips (GPU: the built model)
    python -m pytest tests/test_mcore_tp.py -q     # CPU: tiny Qwen3.5 at TP = 2 (+ SP), EP = 2, gloo; back to HF

Departures from the paper:
1. Key names are the local modules' (cluster/mcore.py departure 1); `to_te_layout` renames them to the TE spec's
   (rules read from the 0.16.1 source, listed above them). That a built TE model has exactly those names is checked
   only on a GPU with Transformer Engine (`python -m cluster.launch gpu-check` runs tests/test_mcore_te.py; the one
   GPU run so far had no TE). Under PP the TE names are given by global layer number, then renumbered per stage
   (shard_for_pp / from_te_layout's `first`).
2. Conversion is at TP = EP = 1, then sliced per rank (experts by expert TP, which may differ from TP).
"""

import torch

# --- HF <-> Megatron weights (Qwen3-MoE and Qwen3.5-MoE layouts, TP = EP = 1, local module names) -----------
def is_qwen35(hf):
    """Qwen3.5 layout (GDN + gated attention + gated shared expert) vs Qwen3-MoE (standard attention)."""
    return getattr(hf, "model_type", "").startswith("qwen3_5")


def _qkv_pack(q, k, v, n_heads, n_groups, d, gate=None):
    """q (nh*d, H), k/v (ng*d, H) [, gate (nh*d, H)] -> Megatron linear_qkv: per query group [q.., gate.., k, v]
    ((nh + 2 ng) * d rows; (2 nh + 2 ng) * d with the attention output gate)."""
    H = q.shape[-1]
    parts = [q] if gate is None else [q, gate]
    parts = [x.reshape(n_groups, n_heads // n_groups * d, H) for x in parts]
    return torch.cat(parts + [k.reshape(n_groups, d, H), v.reshape(n_groups, d, H)], dim=1).reshape(-1, H)


def _qkv_unpack(qkv, n_heads, n_groups, d, gated=False):
    """Inverse of _qkv_pack -> [q, gate (if gated), k, v], each (heads * d, H)."""
    H = qkv.shape[-1]
    per = n_heads // n_groups * d
    sizes = [per] * (2 if gated else 1) + [d, d]
    return [x.reshape(-1, H) for x in qkv.reshape(n_groups, sum(sizes), H).split(sizes, dim=1)]


def _gated_q_split(q_proj, n_heads, d):
    """HF Qwen3.5 q_proj (nh * 2d, H), per head [q_h; gate_h] -> q, gate (nh*d, H) each."""
    x = q_proj.reshape(n_heads, 2, d, -1)
    return x[:, 0].reshape(n_heads * d, -1), x[:, 1].reshape(n_heads * d, -1)


def _gated_q_join(q, gate, n_heads, d):
    return torch.stack([q.reshape(n_heads, d, -1), gate.reshape(n_heads, d, -1)], dim=1).reshape(n_heads * 2 * d, -1)


def _gdn_split(hf):
    """Row sizes of Megatron's GDN in_proj: [q k v (= HF in_proj_qkv), z, beta (in_proj_b), alpha (in_proj_a)]."""
    qk, v = hf.linear_num_key_heads * hf.linear_key_head_dim, hf.linear_num_value_heads * hf.linear_value_head_dim
    return [2 * qk + v, v, hf.linear_num_value_heads, hf.linear_num_value_heads]


def hf_to_megatron(sd, hf) -> dict:
    """HF Qwen3MoeForCausalLM / Qwen3_5MoeForCausalLM state dict (transformers 5: fused experts) -> GPTModel's.

    Qwen3.5: all HF RMSNorms but the GDN's gated norm are zero-centred (1 + w), as Megatron's with
    layernorm_zero_centered_gamma, so they copy; that config also makes the GDN out_norm zero-centred, while
    HF's Qwen3_5MoeRMSNormGated multiplies by w: out_norm = w - 1 (exact for w in [0.5, 2], Sterbenz)."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": sd["model.norm.weight"],
           "output_layer.weight": sd["lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"]}
    for i in range(hf.num_hidden_layers):
        out.update(hf_layer_to_megatron(sd, hf, i))
    return {k: v.detach().clone() for k, v in out.items()}


def hf_layer_to_megatron(sd, hf, i, experts=None) -> dict:
    """hf_to_megatron for decoder layer i alone (its HF tensors in `sd`; tensors not copied). `experts`: the global
    ids of the routed experts whose rows the fused mlp.experts tensors hold, in order (None: all E)."""
    nh, ng, d, E = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.num_experts
    q35 = is_qwen35(hf)
    out = {}
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    out[m + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
    if q35 and hf.layer_types[i] == "linear_attention":  # Gated DeltaNet
        a, g = h + "linear_attn.", m + "self_attention."
        out[g + "in_proj.weight"] = torch.cat([sd[a + f"in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")])
        out[g + "conv1d.weight"] = sd[a + "conv1d.weight"]  # (conv_dim, 1, K) over [q, k, v] channels
        out[g + "dt_bias"], out[g + "A_log"] = sd[a + "dt_bias"], sd[a + "A_log"]
        out[g + "out_norm.weight"] = sd[a + "norm.weight"] - 1
        out[g + "out_proj.weight"] = sd[a + "out_proj.weight"]
    else:
        a = h + "self_attn."
        q, gate = (_gated_q_split(sd[a + "q_proj.weight"], nh, d) if q35 else (sd[a + "q_proj.weight"], None))
        out[m + "self_attention.linear_qkv.weight"] = _qkv_pack(q, sd[a + "k_proj.weight"], sd[a + "v_proj.weight"],
                                                              nh, ng, d, gate)
        out[m + "self_attention.q_layernorm.weight"] = sd[a + "q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = sd[a + "k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = sd[a + "o_proj.weight"]
    out[m + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
    out[m + "mlp.router.weight"] = sd[h + "mlp.gate.weight"]
    gate_up, down = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.down_proj"]  # (E, 2I, H), (E, H, I)
    for j, e in enumerate(range(E) if experts is None else experts):
        x = f"{m}mlp.experts.local_experts.{e}."
        out[x + "linear_fc1.weight"] = gate_up[j]  # [gate; up], Megatron's GLU chunk order
        out[x + "linear_fc2.weight"] = down[j]
    if q35:  # shared expert: sigmoid(x . gate_weight) * SwiGLU(x), added to the routed output
        s, x = h + "mlp.shared_expert", m + "mlp.shared_experts."
        out[x + "linear_fc1.weight"] = torch.cat([sd[s + ".gate_proj.weight"], sd[s + ".up_proj.weight"]])
        out[x + "linear_fc2.weight"] = sd[s + ".down_proj.weight"]
        out[x + "gate_weight"] = sd[s + "_gate.weight"]  # (1, H)
    return out


def megatron_to_hf(sd, hf) -> dict:
    """GPTModel state dict -> HF Qwen3MoeForCausalLM / Qwen3_5MoeForCausalLM state dict (inverse of hf_to_megatron)."""
    nh, ng, d, E = hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.num_experts
    q35 = is_qwen35(hf)
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"], "lm_head.weight": sd["output_layer.weight"]}
    for i in range(hf.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[m + "input_layernorm.weight"]
        if q35 and hf.layer_types[i] == "linear_attention":
            a, g = h + "linear_attn.", m + "self_attention."
            qkv, z, b, al = sd[g + "in_proj.weight"].split(_gdn_split(hf))
            out.update({a + "in_proj_qkv.weight": qkv, a + "in_proj_z.weight": z, a + "in_proj_b.weight": b,
                        a + "in_proj_a.weight": al})
            out[a + "conv1d.weight"] = sd[g + "conv1d.weight"]
            out[a + "dt_bias"], out[a + "A_log"] = sd[g + "dt_bias"], sd[g + "A_log"]
            out[a + "norm.weight"] = sd[g + "out_norm.weight"] + 1
            out[a + "out_proj.weight"] = sd[g + "out_proj.weight"]
        else:
            a = h + "self_attn."
            parts = _qkv_unpack(sd[m + "self_attention.linear_qkv.weight"], nh, ng, d, gated=q35)
            out[a + "q_proj.weight"] = _gated_q_join(parts[0], parts[1], nh, d) if q35 else parts[0]
            out[a + "k_proj.weight"], out[a + "v_proj.weight"] = parts[-2], parts[-1]
            out[a + "q_norm.weight"] = sd[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = sd[m + "self_attention.k_layernorm.weight"]
            out[a + "o_proj.weight"] = sd[m + "self_attention.linear_proj.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[m + "pre_mlp_layernorm.weight"]
        out[h + "mlp.gate.weight"] = sd[m + "mlp.router.weight"]
        x = f"{m}mlp.experts.local_experts."
        out[h + "mlp.experts.gate_up_proj"] = torch.stack([sd[f"{x}{e}.linear_fc1.weight"] for e in range(E)])
        out[h + "mlp.experts.down_proj"] = torch.stack([sd[f"{x}{e}.linear_fc2.weight"] for e in range(E)])
        if q35:
            s, x = h + "mlp.shared_expert", m + "mlp.shared_experts."
            out[s + ".gate_proj.weight"], out[s + ".up_proj.weight"] = sd[x + "linear_fc1.weight"].chunk(2)
            out[s + ".down_proj.weight"] = sd[x + "linear_fc2.weight"]
            out[s + "_gate.weight"] = sd[x + "gate_weight"]
    return {k: v.detach().clone() for k, v in out.items()}


def critic_hf_to_megatron(sd, hf) -> dict:
    """HF critic state dict (Qwen3-MoE `model.*` + `value_head.weight/bias`) -> MegatronCritic.gpt state dict."""
    out = hf_to_megatron({**sd, "lm_head.weight": sd["value_head.weight"]}, hf)  # head sits in output_layer
    out["output_layer.bias"] = sd["value_head.bias"].detach().clone()
    return out


def critic_megatron_to_hf(sd, hf) -> dict:
    """MegatronCritic.gpt state dict -> HF critic state dict (the inverse of critic_hf_to_megatron)."""
    out = megatron_to_hf(sd, hf)
    out["value_head.weight"] = out.pop("lm_head.weight")
    out["value_head.bias"] = sd["output_layer.bias"].detach().clone()
    return out


# --- the Transformer-Engine layout: the cluster model's parameter names -----------------------------------------
# hf_to_megatron writes the local modules' names (mcore.build_tiny). The cluster model (mcore._qwen35_gpt:
# megatron-core 0.16.1's get_transformer_block_with_experimental_attention_variant_spec, TESpecProvider,
# moe_grouped_gemm=True) differs in two places only, both read from the 0.16.1 source:
# 1. input norm: models/gpt/experimental_attention_variant_module_specs.py (get_transformer_block_with_experimental_
#    attention_variant_spec) sets input_layernorm = IdentityOp when the attention spec's metainfo
#    "fuse_input_layernorm" is True: GDN (get_gated_delta_net_module_spec: in_proj = TELayerNormColumnParallelLinear)
#    and attention (_get_self_attention_module_spec: TESpecProvider.fuse_layernorm_and_linear() is True; linear_qkv
#    = TELayerNormColumnParallelLinear, gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec). That class is
#    te.pytorch.LayerNormLinear (extensions/transformer_engine.py), which registers `layer_norm_weight` (and
#    `layer_norm_bias` only for LayerNorm, not RMSNorm) and takes zero_centered_gamma from the config as
#    mcore_cpu.RMSNorm does, so the value copies: input_layernorm.weight -> self_attention.{in_proj |
#    linear_qkv}.layer_norm_weight.
#    Qwen3-MoE's TE spec (get_gpt_layer_with_transformer_engine_spec) leaves input_layernorm at its IdentityOp
#    default with the same linear_qkv: the same rule.
# 2. routed experts: TESpecProvider.grouped_mlp_modules(grouped gemm) -> TEGroupedMLP (transformer/moe/experts.py)
#    with linear_fc1 / linear_fc2 = TE{Column,Row}ParallelGroupedLinear over num_local_experts GEMMs; te.pytorch.
#    GroupedLinear registers weight0..weight{n-1}: mlp.experts.local_experts.{e}.linear_fc1.weight ->
#    mlp.experts.linear_fc1.weight{e}, e the LOCAL expert index (apply after shard_for_ep).
# Unchanged: pre_mlp_layernorm (_get_moe_module_spec sets fuse_pre_mlp_layernorm False: the router reads the normed
# input; TENorm -> te.pytorch.RMSNorm `weight`), q/k_layernorm (TENorm), GDN conv1d / dt_bias / A_log / out_norm
# (TENorm) / out_proj (TERowParallelLinear `weight`), shared experts (moe_module_specs: SharedExpertMLP with
# TEColumnParallelLinear / TERowParallelLinear `weight`, shared_experts.py gate_weight), router, embedding, output
# layer, final_layernorm (TENorm). With add_bias_linear=False TE registers no bias; TE modules add `_extra_state`
# (fp8 metadata) only, and TEDotProductAttention nothing else (softmax_offset only with softmax_type "learnable").
def _fused_input_norm(hf, i):
    """Where the TE layout keeps layer i's input norm: GDN in_proj or attention linear_qkv (rule 1)."""
    gdn = is_qwen35(hf) and hf.layer_types[i] == "linear_attention"
    return f"decoder.layers.{i}.self_attention.{'in_proj' if gdn else 'linear_qkv'}.layer_norm_weight"


def to_te_layout(sd, hf, whole: bool = True) -> dict:
    """Local-module GPTModel state dict (hf_to_megatron's, after shard_for_ep / shard_for_tp) -> the TE-spec model's
    names (rules 1-2 above); tensors are not copied. Inverse: from_te_layout. whole=False: `sd` may be a part of
    the model (one layer, as mcore_weights.load_checkpoint_into_megatron loads it)."""
    fused = {f"decoder.layers.{i}.input_layernorm.weight": _fused_input_norm(hf, i)
             for i in range(hf.num_hidden_layers)}
    if whole and not fused.keys() <= sd.keys():
        raise KeyError(f"to_te_layout: no {sorted(fused.keys() - sd.keys())[:3]}")
    out = {}
    for k, w in sd.items():
        if ".mlp.experts.local_experts." in k:  # {m}.mlp.experts.local_experts.{e}.linear_fc1.weight
            head, rest = k.split(".local_experts.")
            e, tail = rest.split(".", 1)
            k = f"{head}.{tail}{e}"  # {m}.mlp.experts.linear_fc1.weight{e}
        out[fused.get(k, k)] = w
    return out


def from_te_layout(sd, hf, first: int = 0) -> dict:
    """TE-spec GPTModel state dict (without `_extra_state`) -> the local-module names: the inverse of to_te_layout.
    first: the global number of the state dict's layer 0 (a pipeline stage's; shard_for_pp numbers them locally)."""
    unfused = {_fused_input_norm(hf, j + first).replace(f"layers.{j + first}.", f"layers.{j}.", 1):
               f"decoder.layers.{j}.input_layernorm.weight" for j in range(hf.num_hidden_layers - first)}
    out = {}
    for k, w in sd.items():
        if ".mlp.experts.linear_fc" in k:  # {m}.mlp.experts.linear_fc1.weight{e}
            head, rest = k.split(".mlp.experts.")
            name = rest.rstrip("0123456789")
            k = f"{head}.mlp.experts.local_experts.{rest[len(name):]}.{name}"
        out[unfused.get(k, k)] = w
    return out


def is_te(gpt) -> bool:
    """Built with the Transformer-Engine spec (mcore._te_spec: its names are to_te_layout's)?"""
    return any(k.endswith(".layer_norm_weight") for k in gpt.state_dict())


# --- per-rank cuts: TP (expert TP for the experts), EP, PP, and the joins back ------------------------------------
def tp_cuts(hf):
    """shard_for_tp's rules: {key suffix: part count or part row sizes} for tensors column-cut per part, then the
    suffixes of whole column-parallel (dim 0) and row-parallel (dim 1) tensors; any other key is replicated."""
    parts = {"linear_fc1.weight": 2}  # [gate; up]
    if is_qwen35(hf):
        qk, v, nv = hf.linear_num_key_heads * hf.linear_key_head_dim, hf.linear_num_value_heads * \
            hf.linear_value_head_dim, hf.linear_num_value_heads
        parts.update({"in_proj.weight": [qk, qk, v, v, nv, nv], "conv1d.weight": [qk, qk, v]})
    cols = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "A_log", "dt_bias")
    rows = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")
    return parts, cols, rows


def is_tp_cut(k, hf):
    parts, cols, rows = tp_cuts(hf)
    return k.endswith(tuple(parts) + cols + rows)


def shard_for_tp(sd, hf, tp_rank, tp_size, etp_rank=None, etp_size=None) -> dict:
    """TP = 1 GPTModel state dict (hf_to_megatron's) -> tensor-parallel rank `tp_rank` of `tp_size`; expert tensors
    (keys with ".local_experts.", Megatron's SequentialMLP, built on the expert-TP group) by expert-TP rank `etp_rank`
    of `etp_size` (None: = tp_rank / tp_size, Megatron's default). The shared expert is dense TP (SharedExpertMLP
    takes pg_collection.tp), the router replicated. Column-parallel rows split per part so every rank holds whole
    heads: vocab (embedding, output layer); linear_qkv (whole query groups: [q.., gate.., k, v] per group);
    linear_fc1 [gate_r; up_r] (Megatron's GLU shard); GDN in_proj [q_r k_r v_r z_r b_r a_r], conv1d [q_r k_r v_r],
    A_log and dt_bias per value head. Row-parallel columns: linear_proj, linear_fc2, out_proj. The rest is
    replicated."""
    if etp_size is None:  # Megatron's default: expert_tensor_parallel_size unset = tensor_model_parallel_size
        etp_rank, etp_size = tp_rank, tp_size
    parts, cols, rows = tp_cuts(hf)
    out = {}
    for k, w in sd.items():
        rank, size = (etp_rank, etp_size) if ".local_experts." in k else (tp_rank, tp_size)
        split = next((p for n, p in parts.items() if k.endswith(n)), None)
        if size == 1:
            pass  # not cut at this size
        elif split is not None:  # each part sharded on its own, the rank's shards concatenated in the same order
            chunks = w.chunk(split) if isinstance(split, int) else w.split(split)
            w = torch.cat([c.chunk(size)[rank] for c in chunks])
        elif k.endswith(cols):
            w = w.chunk(size)[rank]
        elif k.endswith(rows):
            w = w.chunk(size, dim=1)[rank]
        out[k] = w.contiguous().clone() if size > 1 else w
    return out


def shard_for_ep(sd, num_experts, ep_rank, ep_size) -> dict:
    """Expert-parallel rank `ep_rank` of `ep_size`: its contiguous block of E / ep_size experts, renumbered
    local_experts.0.. (Megatron's SequentialMLP state dict); everything else replicated."""
    per, out = num_experts // ep_size, {}
    for k, w in sd.items():
        if ".local_experts." in k:
            head, rest = k.split(".local_experts.")
            e, tail = rest.split(".", 1)
            if int(e) // per != ep_rank:
                continue
            k = f"{head}.local_experts.{int(e) - ep_rank * per}.{tail}"
        out[k] = w
    return out


def unshard_tp(shards, hf, tp_size, etp_size=None) -> dict:
    """Inverse of shard_for_tp: shards[i] is the dict of rank i % tp_size for the dense tensors and of expert-TP rank
    i % etp_size for the expert ones (None: = tp_size), i < max(tp_size, etp_size) -> the TP = 1 dict (dense tensors
    joined over shards[:tp_size], expert tensors over shards[:etp_size]). A tensor cut per part is split back into
    its parts on every rank, each part re-joined over ranks, the parts in their order ([gate; up], GDN [q k v z b a]
    / [q k v]); column-parallel re-join on dim 0, row-parallel on dim 1; replicated tensors are shards[0]'s."""
    etp_size = tp_size if etp_size is None else etp_size
    assert len(shards) == max(tp_size, etp_size), f"unshard_tp: {len(shards)} shards, TP = {tp_size}, ETP = {etp_size}"
    parts, cols, rows = tp_cuts(hf)
    out = {}
    for k, w in shards[0].items():
        size = etp_size if ".local_experts." in k else tp_size
        ranks = shards[:size]
        split = next((p for n, p in parts.items() if k.endswith(n)), None)
        if size == 1:
            pass  # not cut at this size
        elif split is not None:  # rank r holds [part0_r; part1_r; ..]: parts back out of each rank, joined over ranks
            per_rank = [s[k].chunk(split) if isinstance(split, int) else s[k].split([n // size for n in split])
                        for s in ranks]
            w = torch.cat([torch.cat(part) for part in zip(*per_rank)])
        elif k.endswith(cols):
            w = torch.cat([s[k] for s in ranks])
        elif k.endswith(rows):
            w = torch.cat([s[k] for s in ranks], dim=1)
        out[k] = w
    return out


def unshard_ep(shards, num_experts, ep_size) -> dict:
    """Inverse of shard_for_ep: the `ep_size` ranks' dicts, in EP rank order -> all experts, numbered back
    (rank r's local expert j is expert r * E / ep_size + j); everything else is rank 0's."""
    assert len(shards) == ep_size and num_experts % ep_size == 0, f"unshard_ep: {len(shards)} shards, E = {num_experts}"
    per, out = num_experts // ep_size, {}
    for r, s in enumerate(shards):
        for k, w in s.items():
            if ".local_experts." in k:
                head, rest = k.split(".local_experts.")
                e, tail = rest.split(".", 1)
                out[f"{head}.local_experts.{r * per + int(e)}.{tail}"] = w
            elif r == 0:
                out[k] = w
    return out


def shard_for_pp(sd, first, last, pre_process, post_process) -> dict:
    """A pipeline stage's part of a (TP / EP-sharded) state dict: decoder layers [first, last) renumbered from 0
    (Megatron numbers a stage's modules locally), the embedding on the first stage, the final norm and the output
    layer on the last."""
    out = {}
    for k, w in sd.items():
        if k.startswith("decoder.layers."):
            i, rest = k[len("decoder.layers."):].split(".", 1)
            if not first <= int(i) < last:
                continue
            k = f"decoder.layers.{int(i) - first}.{rest}"
        elif (k.startswith("embedding.") and not pre_process) or \
                (k.startswith(("output_layer.", "decoder.final_layernorm.")) and not post_process):
            continue
        out[k] = w
    return out


def unshard_pp(stages) -> dict:
    """[(first layer, stage state dict)] of every pipeline stage -> the whole state dict (inverse of shard_for_pp)."""
    out = {}
    for first, sd in stages:
        for k, w in sd.items():
            if k.startswith("decoder.layers."):
                i, rest = k[len("decoder.layers."):].split(".", 1)
                k = f"decoder.layers.{int(i) + first}.{rest}"
            out[k] = w
    return out
