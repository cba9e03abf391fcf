"""Megatron-Core trainer backend: the models and the training-step interface (paper: infrastructure; T1 trains
Qwen3.5-122B-A10B with Megatron-Core: Gated DeltaNet + gated attention, MoE over DeepEP's flex dispatcher, aux
loss 0, native `RouterReplay` for R3 with router fusion off, distributed optimizer).

The backend's modules: this one (the models and what train_t1.py --backend megatron calls);
cluster/mcore_convert.py (HF <-> Megatron state dicts: names, the TE layout, per-rank cuts) and
cluster/mcore_weights.py (those weights into and out of a built model: per-rank load, streaming load, gather, save);
cluster/mcore_parallel.py (context and pipeline parallel, DDP + the distributed optimizer around Megatron-Core);
cluster/mcore_cpu.py (Megatron-Core on a CUDA-less torch). Here: `build_tiny` (a Qwen3-MoE or Qwen3.5-MoE GPTModel
from an HF config: local modules, or TE's on CUDA), `MegatronActor` (logits, vocab-parallel `token_logprobs`, R3
through `r3.routing`, under TP / SP / EP / PP / CP), `MegatronCritic` (scalar value head, critic.py's conventions),
`trainer_layout` / `trainer_models` (actor, behaviour copy and critic for the trainer, on the CPU or, as the cluster
model, on CUDA), and `qwen35_config` / `_qwen35_gpt` (a Qwen3.5 preset's shapes from infra.py with the TE spec:
tests/test_mcore_te.py on a GPU).

    python -m pytest tests/test_mcore.py -q        # CPU: build, conversion round trip, native replay, critic
    python -m pytest tests/test_mcore_qwen35.py -q # CPU: the same for Qwen3.5 (GDN, gated attention, shared expert)
    python -m pytest tests/test_mcore_parallel.py -q  # CPU: MegatronActor logprobs / R3 at TP, EP, PP, CP = 2
    python -m pytest tests/test_trainer_group.py -q   # CPU: the trainer over 2 Ray ranks (--plan) vs one rank
    python -m experiments.bench trainer --shape 122b-slice --preset qwen35-122b-a10b  # GPU: the cluster model's steps

Departures from the paper:
1. On CPU Qwen3.5 is built from local modules (`_qwen35_local_spec`), not the Transformer-Engine spec: the same
   classes, unfused norms, one module per expert (cluster/mcore_convert.py renames them for the cluster model).
   Megatron's GatedDeltaNet ignores the attention mask: right padding is safe, left padding or packed sequences would
   leak.
2. CPU shims, never on GPU (cluster/mcore_cpu.py: `init_cpu`, `cpu_shims`): current_device -> "cpu", Megatron's
   torch gated delta rule in place of flash-linear-attention, its torch.compile'd fused functions eager; `RMSNorm`
   because WrappedTorchNorm refuses zero-centred gamma. A no-op CUDA RNG tracker on both (dropout is 0 and weights
   are loaded, so Megatron's model-parallel RNG has nothing to do).
3. The critic routes live (no R3 replay): it never ran in the sampler, so there is nothing to replay. Its backbone
   starts as a copy of the SFT actor's (`MegatronCritic.from_actor`, critic.py departure 1).
4. Optimizer: fp32 at world size 1 on the CPU, torch's Adam (nothing to shard); otherwise Megatron's DDP with the
   distributed optimizer: Megatron's own on CUDA (mcore_parallel.MegatronAdam), mcore_parallel.ShardedAdam (the same
   ZeRO-1, ours) on the CPU, where Megatron's refuses CPU parameters.
5. The cluster model on CUDA (trainer_layout: bf16, TE where it imports, DeepEP's flex dispatcher where deep_ep
   imports, else all-to-all) is written against megatron-core 0.16.1. It has run on one GPU without TE or DeepEP
   (`python -m cluster.launch gpu-check`; results/LOG.md, 2026-12-04: the GPU check on one H200); the TE layers and
   DeepEP only on CPU in pieces (the optimizer under a test shim, TE names as functions).
"""

import contextlib
import types

import torch

import infra
from cluster import mcore_parallel
from cluster import mcore_weights
import r3
from cluster.mcore_cpu import RMSNorm, cpu_shims, init_cpu
from cluster.mcore_parallel import _ValueHead, stage_layers
from cluster.mcore_convert import is_qwen35

# --- tiny standard-attention MoE: HF config and the Megatron-Core GPTModel ------------------------------
def tiny_hf_config(vocab_size=96):
    """Qwen3-MoE at toy size: 2 layers, hidden 32, 4 heads (2 KV groups), 4 experts top-2, aux loss 0."""
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.0,
                          rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          max_position_embeddings=256, tie_word_embeddings=False)


def tiny_qwen35_hf_config(vocab_size=96):
    """Qwen3.5-MoE text model at toy size (model.tiny_config's layout): 4 layers [GDN x3, gated attention],
    hidden 32, 4 heads (2 KV groups, head dim 16, rotary on 1/4), GDN 2 key / 4 value heads, 8 experts top-2
    + gated shared expert, aux loss 0."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4,
                                layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=16, router_aux_loss_coef=0.0, rms_norm_eps=1e-6,
                                max_position_embeddings=256, tie_word_embeddings=False)


def _rope_theta(hf):
    rp = getattr(hf, "rope_parameters", None) or {}
    return float(rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def megatron_config(hf, **overrides):
    """TransformerConfig equivalent to a Qwen3-MoE or Qwen3.5-MoE HF config (fp32, dropout 0, R3 replay on,
    fusion off, local modules)."""
    from megatron.core.transformer import TransformerConfig
    kw = dict(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
              num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
              ffn_hidden_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,  # dense: unused
              num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
              moe_ffn_hidden_size=hf.moe_intermediate_size,
              moe_router_pre_softmax=False,  # top-k on logits, softmax over the k = renormalised top-k
              moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",  # paper: balancing coefficient 0
              moe_enable_routing_replay=True, moe_router_fusion=False,  # R3: fusion bypasses RouterReplay
              moe_router_dtype="fp32", moe_token_dispatcher_type="allgather",
              normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, qk_layernorm=True,
              gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
              hidden_dropout=0.0, attention_dropout=0.0, bf16=False, params_dtype=torch.float32,
              use_cpu_initialization=True)
    if is_qwen35(hf):  # the same switches as qwen35_config, with the pattern and sizes read from `hf`
        kw.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=[int(t == "linear_attention") for t in hf.layer_types],  # 1 = GDN
                  linear_conv_kernel_dim=hf.linear_conv_kernel_dim, linear_key_head_dim=hf.linear_key_head_dim,
                  linear_value_head_dim=hf.linear_value_head_dim, linear_num_key_heads=hf.linear_num_key_heads,
                  linear_num_value_heads=hf.linear_num_value_heads, attention_output_gate=True,
                  moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size, moe_shared_expert_gate=True,
                  layernorm_zero_centered_gamma=True,  # HF Qwen3.5 RMSNorm: x / rms(x) * (1 + w)
                  transformer_impl="local")
    kw.update(overrides)
    return TransformerConfig(**kw)


def _qwen35_local_spec(cfg, cp_attention=False):
    """The block spec get_transformer_block_with_experimental_attention_variant_spec builds, with Megatron's
    local modules in place of Transformer Engine's (which that function asserts): per layer GatedDeltaNet
    (in_proj, out_norm, out_proj) or gated SelfAttention, MoE with a shared expert, zero-centred RMSNorms.
    Unfused: the norm TE folds into in_proj / linear_qkv (layer_norm_weight) sits in input_layernorm.
    cp_attention: core attention = mcore_parallel.cp_dot_product_attention() (context parallel > 1 in
    parallel_state)."""
    import copy
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    base = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")  # MoE spec has SharedExpertMLP
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear))
    layers = []
    for linear in cfg.linear_attention_freq:
        spec = copy.deepcopy(base)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = RMSNorm
        if linear:
            sub.self_attention = gdn
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = RMSNorm
            if cp_attention:
                sub.self_attention.submodules.core_attention = mcore_parallel.cp_dot_product_attention()
        layers.append(spec)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)


def _te_spec(hf, cfg):
    """The Transformer-Engine layer spec of the cluster model (mcore_convert.to_te_layout's names): Qwen3.5 as
    _qwen35_gpt builds it, Qwen3-MoE megatron-core's TE GPT spec with grouped-GEMM experts."""
    if is_qwen35(hf):
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)
        from megatron.core import parallel_state as ps  # this stage's layers
        return get_transformer_block_with_experimental_attention_variant_spec(
            cfg, pp_rank=ps.get_pipeline_model_parallel_rank() if cfg.pipeline_model_parallel_size > 1 else 0)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    return get_gpt_layer_with_transformer_engine_spec(num_experts=hf.num_experts, moe_grouped_gemm=True,
                                                      qk_layernorm=True)


def build_tiny(hf, seed=0, **overrides):
    """Megatron-Core GPTModel with the architecture of the HF Qwen3-MoE or Qwen3.5-MoE config `hf` (any size: the
    name is its first use): local modules, or with transformer_impl="transformer_engine" in `overrides` the
    cluster's TE layers (CUDA; trainer_layout)."""
    init_cpu()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps
    torch.manual_seed(seed)
    cfg = megatron_config(hf, **overrides)
    first, last = stage_layers(cfg)
    # context parallel: config keeps CP = 1 (GDN asserts it), parallel_state has it
    cp_attention = mcore_parallel.cp_rank_size_group()[1] > 1
    if overrides.get("transformer_impl") == "transformer_engine":  # the cluster's layers (trainer_layout on CUDA)
        spec = _te_spec(hf, cfg)
    elif is_qwen35(hf):
        spec = _qwen35_local_spec(cfg, cp_attention)
        spec.layer_specs = spec.layer_specs[first:last]  # this pipeline stage's layers (the block builds all it gets)
    else:
        spec = get_gpt_layer_local_spec(num_experts=hf.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                        normalization="RMSNorm")
        if cp_attention:
            spec.submodules.self_attention.submodules.core_attention = mcore_parallel.cp_dot_product_attention()
    rotary_percent = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)  # Qwen3.5: 0.25
    pp = cfg.pipeline_model_parallel_size > 1
    with cpu_shims():  # GatedDeltaNet allocates on torch.cuda.current_device()
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=hf.vocab_size,
                        max_sequence_length=hf.max_position_embeddings, position_embedding_type="rope",
                        rotary_percent=rotary_percent, rotary_base=_rope_theta(hf),
                        share_embeddings_and_output_weights=hf.tie_word_embeddings,
                        pre_process=ps.is_pipeline_first_stage() if pp else True,
                        post_process=ps.is_pipeline_last_stage() if pp else True)


# --- the training-step interface of the embedded backend ----------------------------------------------
def _seq_multiple(gpt) -> int:
    """Sequence parallel splits the sequence over the TP ranks: T must be a multiple of tp (1 otherwise)."""
    c = gpt.config
    return c.tensor_model_parallel_size if c.sequence_parallel else 1


_GDN_CHUNK = 64  # the gated delta rule's chunk (torch_chunk_gated_delta_rule's default)


def _padded_len(gpt, T) -> int:
    """T right-padded for the sequence split: a multiple of cp * tp (sequence parallel); under CP with GDN layers
    every CP chunk is a multiple of the kernel's chunk (_GDN_CHUNK): cp_gdn.cp_chunk_gated_delta_rule needs the
    chunks but the last to end on one, and the same chunking as one rank keeps the decay parameters' grads (A_log,
    dt_bias: sums of cancelling terms, |grad| ~1e-5 here) at one rank's: 3.7e-10 vs 1.5e-8 with chunk = S."""
    import math
    cp = mcore_parallel.cp_rank_size_group()[1]
    m = cp * _seq_multiple(gpt)
    if cp > 1 and gpt.config.experimental_attention_variant == "gated_delta_net":
        m = cp * math.lcm(_GDN_CHUNK, _seq_multiple(gpt))
    return T + (-T % m)


def _gpt_forward(gpt, input_ids, attention_mask=None):
    """GPTModel on (B, T) ids with a 1/0 right-padding mask -> its output layer's (B, T, *) output (vocab-parallel
    logits: this TP rank's V / tp columns). Under sequence parallel T is right-padded to a multiple of tp (mask 0,
    so real tokens are unchanged) and the output cut back to T. Under context parallel (cluster/mcore_parallel.py
    departure 2) T is padded to Tp (_padded_len) and this CP rank runs the contiguous chunk [r * S, (r + 1) * S),
    S = Tp / cp: its ids, its rows of the causal x key-padding mask against all Tp keys
    (mcore_parallel.cp_dot_product_attention gathers K / V), rotary embeddings of its global positions
    (mcore_parallel.cp_rope), GDN layers state-passed (mcore_parallel.context_parallel_gdn); the result is this
    chunk's (B, S, *) output (callers gather it over CP: mcore_parallel.cp_full). Under pipeline parallel
    (cluster/mcore_parallel.py departure 1) a stage receives its input with PipeRecv and sends its output with
    PipeSend."""
    B, T = input_ids.shape
    dev = next(gpt.parameters()).device  # the model's (every pipeline stage's: ids, positions and mask go there)
    input_ids = input_ids.to(dev)
    key_ok = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.to(dev).bool()
    Tp = _padded_len(gpt, T)
    if Tp > T:
        input_ids = torch.nn.functional.pad(input_ids, (0, Tp - T))
        key_ok = torch.nn.functional.pad(key_ok, (0, Tp - T))
    allowed = torch.tril(torch.ones(Tp, Tp, dtype=torch.bool, device=dev))[None] & key_ok[:, None, :]  # (B, Tp, Tp)
    mask = ~allowed[:, None]  # (B, 1, Tp, Tp): Megatron masks where True
    pos = torch.arange(Tp, device=dev)[None].expand(B, Tp)  # (B, Tp)
    r, cp, group = mcore_parallel.cp_rank_size_group()
    if cp > 1:
        if gpt.config.pipeline_model_parallel_size > 1:
            raise NotImplementedError("context parallel with pipeline parallel: not written (train_t1 refuses it)")
        S = Tp // cp
        lo = r * S  # this rank's chunk [lo, lo + S) of the padded sequence
        input_ids, mask, pos = input_ids[:, lo:lo + S], mask[:, :, lo:lo + S], pos[:, lo:lo + S]  # mask (B, 1, S, Tp)
        gdn = any(type(m).__name__ == "GatedDeltaNet" for m in gpt.modules())
        with cpu_shims(), mcore_parallel.cp_rope(gpt, lo), (
                mcore_parallel.context_parallel_gdn(gpt, group, chunk_size=_GDN_CHUNK) if gdn
                else contextlib.nullcontext()):
            return gpt(input_ids.to(torch.long), pos, attention_mask=mask)  # (B, S, *)
    with cpu_shims():
        if gpt.config.pipeline_model_parallel_size == 1:
            return gpt(input_ids.to(torch.long), pos, attention_mask=mask)[:, :T]
        if not gpt.pre_process:  # the previous stage's hidden states (S / tp, B, H) become this stage's input
            shape = (Tp // _seq_multiple(gpt), B, gpt.config.hidden_size)
            link = torch.zeros((), requires_grad=torch.is_grad_enabled())  # so that backward reaches the recv
            gpt.set_input_tensor(mcore_parallel.PipeRecv.apply(link, shape, gpt.config.params_dtype))
        out = gpt(input_ids.to(torch.long), pos, attention_mask=mask)
        if not gpt.post_process:  # hidden states (S / tp, B, H) on to the next stage; the link carries their grad
            gpt.pipe_link = mcore_parallel.PipeSend.apply(out)
            return None
        return out[:, :T]


class MegatronActor(torch.nn.Module):
    """GPTModel behind the embedded backend's interface: forward(input_ids, attention_mask) -> .logits.

    attention_mask (B, T) 1/0 (right padding, as ppo.pad_batch); logits (B, T, V) fp32 (gathered over the
    TP ranks when the output layer is vocab-parallel). `token_logprobs` is the training path: log pi of the next
    token straight from the vocab-parallel logits (Megatron's vocab-parallel cross entropy), never the (B, T, V)
    gather. `r3.routing(actor, mode, experts)` works as for the HF actor: it calls `self.routing`, which slices
    (B, T, L, k) experts for this rank (`r3.slice_for_megatron`, layout from parallel_state unless given) and
    drives RouterReplay; a recording is gathered back to (B, T, L, k) over the sequence-parallel ranks (and the
    context-parallel ranks: contiguous chunks). Under CP every rank returns the whole (B, T-1) / (B, T, V).
    """

    backend = "megatron"  # the trainer's backend attribute (HF actors: "hf", set by r3.install)

    def __init__(self, gpt, layout=None):
        super().__init__()
        self.gpt = gpt
        c = gpt.config
        cp_rank, cp, _ = mcore_parallel.cp_rank_size_group()
        if layout is None and (c.tensor_model_parallel_size > 1 or c.pipeline_model_parallel_size > 1 or cp > 1):
            from megatron.core import parallel_state as ps
            layout = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=c.tensor_model_parallel_size,
                          sp=c.sequence_parallel)
            if cp > 1:  # _gpt_forward's contiguous chunks, not Megatron's zig-zag
                layout.update(cp_rank=cp_rank, cp_size=cp, cp_contiguous=True)
            if c.pipeline_model_parallel_size > 1:  # this stage's layers (every layer is MoE in both layouts)
                layout.update(layers=stage_layers(c), moe_layers=[1] * c.num_layers)
        self.layout = dict(layout or {})  # kwargs of r3.slice_for_megatron (tp/cp ranks, layers, moe_layers)
        self.batch_shape = None

    def forward(self, input_ids, attention_mask=None):
        self.batch_shape = tuple(input_ids.shape)  # (B, T)
        logits = _gpt_forward(self.gpt, input_ids, attention_mask)  # (B, T, V / tp); None before the last stage
        if logits is not None and self.gpt.config.tensor_model_parallel_size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
            with cpu_shims():
                logits = gather_from_tensor_model_parallel_region(logits)  # (B, T, V); CP: (B, S, V)
        logits = None if logits is None else mcore_parallel.cp_full(logits.float(), input_ids.shape[1])  # (B, T, V)
        logits = mcore_parallel.pipe_result(self.gpt, None if logits is None else logits.float(),
                                            (*input_ids.shape, self.gpt.vocab_size))
        return types.SimpleNamespace(logits=logits.float().to(input_ids.device))  # on the caller's device

    def token_logprobs(self, input_ids, attention_mask=None, temperature=1.0):
        """(B, T-1): log pi(tokens[j+1] | tokens[:j+1]) at temperature, from this rank's vocab shard:
        log p = -CE = z_target - log sum exp z (max, sum and target logit all-reduced over TP)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        self.batch_shape = tuple(input_ids.shape)
        B, T = input_ids.shape
        logits, lp = _gpt_forward(self.gpt, input_ids, attention_mask), None  # (B, T, V / tp) on the last stage
        r, cp, _ = mcore_parallel.cp_rank_size_group()
        if logits is not None and cp > 1:  # this chunk's (B, S, V / tp): targets are the ids shifted globally
            S = logits.shape[1]
            targets = torch.nn.functional.pad(input_ids, (0, cp * S + 1 - T))[:, r * S + 1:(r + 1) * S + 1]  # (B, S)
            with cpu_shims():
                lp = -vocab_parallel_cross_entropy(logits.float() / temperature, targets.to(logits.device).long())
            lp = mcore_parallel.cp_full(lp, T - 1)  # (B, T-1) on every CP rank
        elif logits is not None:
            with cpu_shims():  # CE works in place on its input: the division made a fresh tensor; the targets on
                # the logits' device (its backward indexes the grad with them: found on the first GPU run)
                lp = -vocab_parallel_cross_entropy(logits[:, :-1].float() / temperature,
                                                   input_ids[:, 1:].to(logits.device).long())
        lp = mcore_parallel.pipe_result(self.gpt, lp, (B, T - 1))  # (B, T-1) on every pipeline stage
        return lp.to(input_ids.device)  # on the caller's device (the trainer's tensors stay on the host)

    @contextlib.contextmanager
    def routing(self, mode, experts=None):
        rs = r3.megatron_routers(self.gpt)
        layer_experts = None
        if mode == "replay" and experts is not None:
            n_moe = sum(self.layout.get("moe_layers") or [1] * len(rs))
            experts = r3._check_replay_experts(experts, n_moe, rs[0].topk, rs[0].config.num_moe_experts)
            pad = _padded_len(self.gpt, experts.shape[1]) - experts.shape[1]  # _gpt_forward's; -1 rows route live
            experts = torch.nn.functional.pad(experts, (0, 0, 0, 0, 0, pad), value=-1) if pad else experts
            dev = next(self.gpt.parameters()).device
            layer_experts = [e.to(dev) for e in r3.slice_for_megatron(experts, **self.layout)]
        with r3.megatron_routing(self.gpt, mode, layer_experts) as ctx:
            ctx.batch_shape = self._routed_shape
            if _seq_multiple(self.gpt) > 1 or self.gpt.config.pipeline_model_parallel_size > 1 or \
                    mcore_parallel.cp_rank_size_group()[1] > 1:
                ctx.gather = self._gather_recording
            yield ctx

    def _routed_shape(self):
        """(B, T_routed, T): the routers saw the padded length; the recording is cut back to T."""
        if self.batch_shape is None:
            return None
        B, T = self.batch_shape
        return B, _padded_len(self.gpt, T), T

    def _gather_recording(self, ex):
        """(N / (tp cp), L_stage, k) rows of this TP rank's sequence slice of this CP rank's chunk and this stage's
        layers -> (N, L, k): the TP ranks' slices in order (sequence parallel), the CP ranks' chunks in order (rows
        s * B + b of contiguous chunks: concatenation), then the pipeline stages' layers in order."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        if _seq_multiple(self.gpt) > 1:
            parts = [torch.empty_like(ex) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, ex.contiguous(), group=ps.get_tensor_model_parallel_group())
            ex = torch.cat(parts)
        _, cp, group = mcore_parallel.cp_rank_size_group()
        if cp > 1:
            parts = [torch.empty_like(ex) for _ in range(cp)]
            dist.all_gather(parts, ex.contiguous(), group=group)
            ex = torch.cat(parts)
        if self.gpt.config.pipeline_model_parallel_size > 1:  # stages may hold different layer counts
            parts = [None] * self.gpt.config.pipeline_model_parallel_size
            dist.all_gather_object(parts, ex, group=ps.get_pipeline_model_parallel_group())
            ex = torch.cat(parts, dim=1)
        return ex


# --- the critic: the actor's GPTModel with a scalar value head (paper: full-size critic) -------------------
def _same_architecture(gpt, **config_overrides):
    """A fresh GPTModel built like `gpt` (its config with overrides, layer spec, sizes, rope, stage, groups)."""
    import dataclasses
    from megatron.core.models.gpt import GPTModel
    with cpu_shims():  # GatedDeltaNet allocates on torch.cuda.current_device()
        return GPTModel(config=dataclasses.replace(gpt.config, **config_overrides),
                        transformer_layer_spec=gpt.transformer_layer_spec, vocab_size=gpt.vocab_size,
                        max_sequence_length=gpt.max_sequence_length, pre_process=gpt.pre_process,
                        post_process=gpt.post_process, position_embedding_type=gpt.position_embedding_type,
                        rotary_percent=gpt.rotary_percent, rotary_base=gpt.rotary_base,
                        pg_collection=gpt.pg_collection, vp_stage=gpt.vp_stage)


class MegatronCritic(torch.nn.Module):
    """critic.Critic on Megatron-Core: forward(input_ids, attention_mask) -> values (B, T) fp32 with
    values[:, j] = V(tokens[:j]) = head(h_{j-1}), values[:, 0] = 0; works with critic.compute_values / critic_update.

    `gpt`: a GPTModel of the actor's architecture; its LM output layer is replaced by the scalar head (the
    vocab-size layer is built, then freed). Routing is live: build `gpt` with moe_enable_routing_replay=False
    (as from_actor does). R3 pins the actor's logprobs to the sampler's experts; the
    critic never ran in the sampler, so there is no recording to replay and its router trains freely.
    """

    backend = "megatron"  # critic.Critic: "hf"

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        if gpt.post_process:  # last pipeline stage
            gpt.output_layer = _ValueHead(gpt.config).to(next(gpt.parameters()).device)  # on the model's device

    @classmethod
    def from_actor(cls, megatron_actor) -> "MegatronCritic":
        """Critic with a copy of the actor's backbone and a zero head (critic.py departure 1: init from SFT)."""
        actor = megatron_actor.gpt
        gpt = _same_architecture(actor, moe_enable_routing_replay=False).to(next(actor.parameters()).device)
        backbone = {k: v for k, v in actor.state_dict().items() if not k.startswith("output_layer.")}
        missing, unexpected = gpt.load_state_dict(backbone, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state") and not k.startswith("output_layer.")]
        if missing or unexpected:
            raise ValueError(f"from_actor: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
        return cls(gpt)

    def forward(self, input_ids, attention_mask=None):
        v = _gpt_forward(self.gpt, input_ids, attention_mask)  # (B, T, 1) on the last pipeline stage; CP: (B, S, 1)
        v = None if v is None else mcore_parallel.cp_full(v, input_ids.shape[1])  # (B, T, 1) on every CP rank
        v = mcore_parallel.pipe_result(self.gpt, None if v is None else v.squeeze(-1).float(),
                                       tuple(input_ids.shape))  # (B, T):
        v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # V of prefix ending at t; shift: V(s_j)
        return v.to(input_ids.device)


# --- the trainer's models, both scales (train_t1.py --backend megatron) -----------------------------------------
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def trainer_layout(dtype: str = "fp32", recompute: bool = False) -> dict:
    """TransformerConfig overrides of the trainer's models on this rank: the layout parallel_state holds (TP / EP /
    ETP / PP; sequence parallel with TP, which Megatron's MoE needs in training), calculate_per_token_loss for DDP
    (mcore_parallel.wrap_ddp), the parameter dtype (--param-dtype), and what this node has: on CUDA Transformer
    Engine's layers when transformer_engine imports (grouped-GEMM experts; Megatron's local modules otherwise: the
    same numbers, slower), DeepEP's flex dispatcher when deep_ep imports (all-to-all otherwise); on the CPU local
    modules, the all-gather dispatcher (gloo), CPU initialisation. recompute (the planner's, --plan): full
    activation recompute of every layer (Megatron's "full" / "uniform" / 1), CUDA only (it saves and restores the
    CUDA RNG state)."""
    import importlib.util
    from megatron.core import parallel_state as ps
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {'|'.join(DTYPES)}, got {dtype!r}")
    tp = ps.get_tensor_model_parallel_world_size()
    out = dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
               expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(), sequence_parallel=tp > 1,
               pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
               calculate_per_token_loss=True, params_dtype=DTYPES[dtype], pipeline_dtype=DTYPES[dtype],
               bf16=dtype == "bf16")
    if torch.cuda.is_available():
        if mcore_parallel.cp_rank_size_group()[1] > 1:
            raise NotImplementedError("--plan: cp > 1 on a CUDA node: mcore_parallel's context-parallel Gated "
                                      "DeltaNet (cluster/cp_gdn.py) allocates its state on the CPU; not written for "
                                      "CUDA "
                                      "(use tp / pp / ep / etp / dp)")
        te = importlib.util.find_spec("transformer_engine") is not None
        deepep = importlib.util.find_spec("deep_ep") is not None
        out.update(use_cpu_initialization=False, transformer_impl="transformer_engine" if te else "local",
                   moe_grouped_gemm=te, moe_token_dispatcher_type="flex" if deepep else "alltoall")
        if deepep:
            out["moe_flex_dispatcher_backend"] = "deepep"
        if recompute:
            out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute:
        raise NotImplementedError("--plan: recompute true on the CPU: Megatron's full recompute checkpoints the CUDA "
                                  "RNG state; plan without it (the CPU rehearsal's planner does)")
    return out


def trainer_models(hf_actor, path=None, dtype: str = "fp32", recompute: bool = False):
    """(actor, behaviour, critic) for train_t1's Trainer from an HF Qwen3-MoE or Qwen3.5-MoE actor: two MegatronActors
    with its weights (the behaviour copy holds the weights that sampled a batch) and a MegatronCritic from the actor's
    backbone, built per trainer_layout (this rank's TP / EP / PP shards; on a CUDA node on its GPU, with TE and
    DeepEP where they import). `hf_actor`: the HF model (its state dict converted), or with `path` (its HF checkpoint
    directory) only its config: then each rank reads just its shards from the files
    (mcore_weights.load_checkpoint_into_megatron)."""
    cfg = hf_actor if path is not None else hf_actor.config
    if getattr(cfg, "model_type", "") not in ("qwen3_moe", "qwen3_5_moe_text"):
        raise ValueError(f"hf_actor: the Megatron backend converts the Qwen3-MoE and Qwen3.5-MoE text layouts, got "
                         f"{getattr(cfg, 'model_type', type(hf_actor).__name__)!r}")
    init_cpu()  # shims (CPU only); parallel state of one rank unless the trainer set its plan
    layout = trainer_layout(dtype, recompute)

    def load(gpt):
        gpt = gpt.cuda() if torch.cuda.is_available() else gpt
        if path is not None:
            return mcore_weights.load_checkpoint_into_megatron(gpt, path, cfg)
        return mcore_weights.load_hf_into_megatron(gpt, hf_actor.state_dict(), cfg)
    actor, behaviour = (MegatronActor(load(build_tiny(cfg, **layout))) for _ in range(2))
    return actor, behaviour, MegatronCritic.from_actor(actor)


# --- the cluster model: Qwen3.5 with Megatron-Core (GPU nodes only) ------------------------------------
def megatron_shape(c: infra.ModelConfig) -> dict:
    """Megatron's names for a model shape of infra.py's memory model (the one source of the Qwen3.5 shapes)."""
    return dict(num_layers=c.n_layers, hidden_size=c.hidden, num_attention_heads=c.n_heads,
                num_query_groups=c.n_kv_heads, kv_channels=c.head_dim, num_moe_experts=c.n_experts,
                moe_router_topk=c.top_k, moe_ffn_hidden_size=c.moe_ffn,
                moe_shared_expert_intermediate_size=c.shared_ffn,
                linear_num_key_heads=c.lin_k_heads, linear_num_value_heads=c.lin_v_heads,
                linear_key_head_dim=c.lin_k_dim, linear_value_head_dim=c.lin_v_dim, vocab_size=c.vocab)



def qwen35_config(preset, tp=1, pp=1, cp=1, ep=1, etp=1, **overrides):
    """TransformerConfig of a Qwen3.5 preset: GDN 3:1 with gated attention, MoE + gated shared expert,
    flex dispatcher with DeepEP, aux loss 0, router replay on, router fusion off. -> (config, vocab_size)."""
    from megatron.core.transformer import TransformerConfig
    p = megatron_shape(infra.MODEL_SHAPES[preset])  # the paper's model or its sibling
    vocab = p.pop("vocab_size")
    kw = dict(p, ffn_hidden_size=p["moe_ffn_hidden_size"],
              experimental_attention_variant="gated_delta_net", linear_attention_freq=4,  # 3 GDN : 1 attention
              linear_conv_kernel_dim=4, attention_output_gate=True,  # gated attention
              moe_shared_expert_gate=True, moe_router_pre_softmax=False, moe_router_dtype="fp32",
              moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",  # paper: coefficient 0
              moe_enable_routing_replay=True, moe_router_fusion=False,  # R3 (fusion bypasses RouterReplay)
              moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
              moe_grouped_gemm=True, moe_permute_fusion=True,
              normalization="RMSNorm", layernorm_zero_centered_gamma=True, layernorm_epsilon=1e-6,
              qk_layernorm=True, rotary_interleaved=False, gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, add_bias_linear=False, hidden_dropout=0.0,
              attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, sequence_parallel=tp > 1,
              recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
              transformer_impl="transformer_engine")
    kw.update(overrides)
    return TransformerConfig(**kw), vocab


def _qwen35_gpt(preset, **config):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)
    from megatron.core import parallel_state
    cfg, vocab = qwen35_config(preset, **config)
    spec = get_transformer_block_with_experimental_attention_variant_spec(
        cfg, pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=262144,
                    position_embedding_type="rope", rotary_percent=0.25, rotary_base=10_000_000,
                    share_embeddings_and_output_weights=False,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())
