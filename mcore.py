"""Megatron-Core trainer backend (paper: infrastructure; slime's Megatron-Core actor with native R3).

T1 trains Qwen3.5-122B-A10B with Megatron-Core (Gated DeltaNet + gated attention, MoE through the
flex dispatcher with DeepEP, `moe_aux_loss_coeff = 0`, native `RouterReplay` for R3 with router
fusion off, distributed optimizer). This module holds:

- `qwen35_config` / `build_qwen35`: the cluster model, written against megatron-core 0.16's API
  (GDN via `experimental_attention_variant="gated_delta_net"`, `attention_output_gate=True`); needs
  CUDA, Transformer Engine, flash-linear-attention and DeepEP, so on CPU only its config is checked
  (the builders raise a RuntimeError naming what is missing).
- `tiny_hf_config` / `tiny_qwen35_hf_config` / `build_tiny`: a tiny MoE built as a Megatron-Core GPTModel on
  CPU in one gloo process, with small shims (`init_cpu`, `cpu_shims`), in either Hugging Face layout:
  `Qwen3MoeForCausalLM` (standard attention, q/k RMSNorm, SwiGLU experts, softmax top-k renormalised) or
  `Qwen3_5MoeForCausalLM` (3 Gated DeltaNet : 1 gated attention, partial rotary 1/4, gated shared expert,
  zero-centred RMSNorm), the latter from Megatron's own GatedDeltaNet / SelfAttention / SharedExpertMLP with
  local modules in place of Transformer Engine's (`_qwen35_local_spec`).
- `hf_to_megatron` / `megatron_to_hf`: weight conversion in both directions for both layouts; `shard_for_tp` /
  `shard_for_ep` cut the TP = 1 result for one tensor- (experts: expert-tensor-) / expert-parallel rank
  (`load_hf_into_megatron` applies them);
  `unshard_tp` / `unshard_ep` join them back, `gather_full_state` collects a sharded model's TP = 1 state dict.
  `load_checkpoint_into_megatron` streams the same result from an HF checkpoint's safetensors: layer by layer, a rank
  reads only its stage's layers, its EP rank's experts and its TP blocks (tests/test_mcore_load.py: bit-identical,
  0.46-0.72 of the file bytes per rank at EP = 2 / PP = 2 on the tiny models).
- `MegatronActor`: the embedded backend's training-step interface (`actor(input_ids=, attention_mask=)
  .logits` (B, T, V), `actor.token_logprobs` from the vocab-parallel logits, and `r3.routing(actor, mode,
  experts)` with (B, T, L, k) experts, sliced per TP / SP rank and gathered back), so `train_t1.py` switches
  backend with one argument.
- `embedded_models` / `save_hf`: the backend `train_t1.py --backend megatron` trains with at the embedded
  scale (actor, behaviour copy and critic in one process; HF checkpoints out for the engines). `to_hf` / `save_hf`
  also take a TP / EP-sharded actor: every rank calls them (a gather), rank 0 writes.
- `MegatronCritic` (+ `critic_hf_to_megatron` / `critic_megatron_to_hf`, `build_qwen35_critic`): the paper's
  full-size critic, the actor's GPTModel with a scalar value head in place of the LM output layer; the same
  interface and conventions as `critic.Critic` (values[:, j] = V(tokens[:j]), values[:, 0] = 0, zero-init
  head), so `critic.compute_values` / `critic.critic_update` take it unchanged.
- `context_parallel_gdn`: Megatron's own GatedDeltaNet layer with its sequence split over a context-parallel
  group (paper: native CP for the recurrent operator), which megatron-core 0.16.1 refuses: a conv1d halo
  exchange plus infra.py's CP chunked gated delta rule (state passing, infra.py section 2). `_gpt_forward` runs the
  whole model that way when parallel_state has CP > 1 (contiguous chunks, K / V all-gathered for gated attention,
  departure 6), so `MegatronActor` / `MegatronCritic` train under --plan '{"cp": 2}'.

    python -m pytest tests/test_mcore.py -q        # CPU: build, conversion round trip, native replay, critic
    python -m pytest tests/test_mcore_qwen35.py -q # CPU: the same for Qwen3.5 (GDN, gated attention, shared expert)
    python -m pytest tests/test_cp_megatron.py -q  # CPU: one Megatron GDN layer over kappa = 2, 4 gloo ranks
    python -m pytest tests/test_mcore_tp.py -q     # CPU: tiny Qwen3.5 at TP = 2 (+ SP), EP = 2, gloo; back to HF
    python -m pytest tests/test_mcore_load.py -s   # CPU: per-rank streaming load from safetensors vs the whole dict
    python -m pytest tests/test_mcore_parallel.py -q  # CPU: MegatronActor logprobs / R3 at TP, EP, PP, CP = 2
    python -m pytest tests/test_trainer_group.py -q   # CPU: the trainer over 2 Ray ranks (--plan) vs one rank

Departures from the paper:
1. The CPU check builds Qwen3.5 from local modules, not the Transformer-Engine spec the cluster uses
   (`get_transformer_block_with_experimental_attention_variant_spec` asserts transformer_impl ==
   "transformer_engine"): the same GatedDeltaNet, gated SelfAttention and MoE classes, but unfused norms
   (TE keeps the input norm inside in_proj / linear_qkv as `layer_norm_weight`; here it is
   `input_layernorm.weight`) and one module per expert (the cluster's grouped GEMM names them
   `experts.linear_fc1.weight{e}`), so the conversion's key names are the local ones. `to_te_layout` /
   `from_te_layout` rename them to the TE spec's (rules read from the 0.16.1 source, listed above them) and
   `load_hf_into_cluster_model` loads HF weights into the cluster model with them; on CPU the renames are tested
   against names listed per layer type (tests/test_mcore_te.py), while that the built TE model has exactly those
   names and loads them is checked only on a GPU with Transformer Engine (`cluster.py gpu-check`); PP > 1 is not
   written (a stage renumbers its layers). Conversion is at TP = EP = 1, then sliced per rank (`shard_for_tp`: experts by
   expert TP, which may differ from TP (the planner's etp = 1 at tp = 2), the rest by TP; `shard_for_ep`: contiguous
   expert blocks); saving goes back the same way (`gather_full_state`: all-gather over the TP / expert-TP / EP groups,
   then `unshard_tp` / `unshard_ep`), one pipeline stage only, the whole model on every
   rank (at the cluster's scale a gather to rank 0 tensor by tensor would be needed; not written).
   Megatron's GatedDeltaNet ignores the attention mask (HF zeroes padded inputs): with right padding the causal
   recurrence leaves real tokens unchanged, so only padded positions differ; left padding or packed sequences
   would leak.
2. CPU shims (only without CUDA, never on GPU): `torch.cuda.current_device` -> "cpu" (for the whole process once
   `init_cpu` ran: the backward of tensor-parallel layers asks for it outside any block), a no-op CUDA RNG tracker (dropout is 0), `moe_utils.te_general_gemm = None` where 0.16.1 leaves the
   name undefined without Transformer Engine (a NameError in the router's gating linear); for Gated DeltaNet
   without flash-linear-attention, `HAVE_FLA = True`, fla's l2norm -> a torch one and `chunk_gated_delta_rule`
   -> Megatron's own `torch_chunk_gated_delta_rule` (its deterministic-mode kernel; causal_conv1d already
   falls back to nn.Conv1d). Not a shim but part of the local spec (`build_tiny` on CPU or one GPU; the
   cluster uses TENorm): `_RMSNorm`, a zero-centred RMSNorm, where Megatron's WrappedTorchNorm refuses
   `layernorm_zero_centered_gamma`.
3. Pipeline parallel without Megatron's schedules: train_t1's training step calls the model like any torch
   module, so a forward over the PP stages is one autograd graph across processes (`_PipeRecv` / `_PipeSend`
   move the hidden states forward and their grads back over p2p, `_PipeBroadcast` gives every stage the last
   stage's logprobs / values). That is GPipe with one microbatch per call: the same arithmetic as one rank
   (tests: bitwise), none of 1F1B's overlap of stages, so at scale the bubble is (PP - 1) / PP of the
   step. Megatron's forward_backward_func would need the loss inside the schedule, one loss function per call
   site of train_t1. (`MegatronCritic` likewise; under context parallel the shift by one would cross chunks.)
4. The critic routes live (built with `moe_enable_routing_replay=False`): the paper's R3 replays the
   sampler's experts for the actor's logprobs; it says nothing of the critic, which never ran in the
   sampler, so there is nothing to replay. Its backbone starts as a copy of the SFT actor's
   (`MegatronCritic.from_actor`, critic.py departure 1).
5. The embedded Megatron backend (`embedded_models`) at world size 1 trains with torch's Adam on the GPTModels'
   parameters (train_t1.py): DDP and the distributed optimizer shard nothing at one rank. Over ranks it builds
   this rank's TP / EP shards in the layout parallel_state holds, wrapped in Megatron's DDP (`wrap_ddp`) with
   `ShardedAdam` (below: the distributed optimizer's sharding, ours because Megatron's needs CUDA).
6. Context parallel without Megatron's CP attention: TransformerConfig.context_parallel_size stays 1 (0.16.1 asserts
   it for GDN; its local DotProductAttention asserts it too) while parallel_state holds cp > 1 (DDP reduces grads
   over its DP x CP group, the expert-DP group spans the CP ranks). `_gpt_forward` gives CP rank r the contiguous
   chunk [r S, (r + 1) S) of the right-padded sequence (Tp a multiple of cp * tp under sequence parallel, and with
   GDN of cp * 64, the kernel's chunk: the same chunking as one rank), not Megatron's load-balanced zig-zag (chunks r
   and 2cp - 1 - r), because the GDN state passing runs rank 0 -> cp - 1 in sequence order: causal attention work
   is therefore unbalanced over the CP ranks (the last does most). Per call: the rotary table of the chunk's global
   positions (`_cp_rope`: RotaryEmbedding.get_emb with offset r S, instead of its forward, which ignores position
   ids and cuts the zig-zag share), GDN layers state-passed (`context_parallel_gdn`: hooks on the unchanged
   GatedDeltaNet.forward's conv1d, its module-level kernel swapped inside the block; the recurrence is infra.py's
   torch kernel, also on GPU, FLA's is not state-passed here), gated attention through `_cp_dot_product_attention`
   (Megatron's DotProductAttention of the local queries against K / V all-gathered over CP, the mask's rows of this
   chunk against all Tp keys; backward sums K / V grads to their owners) where Megatron's TE attention runs ring
   attention (overlapped K / V exchange, O(S) memory per rank instead of the all-gather's O(Tp)). Outputs are
   gathered over CP (`_CPGather`, backward: this rank's slice only, as `_PipeBroadcast`): token_logprobs (targets
   shifted globally), logits, critic values and the R3 recording (rows of contiguous chunks), replay sliced with
   `r3.slice_for_megatron(cp_contiguous=True)`; MoE routing and experts are token-local. Not written: CP with PP.
   Measured (tests/test_mcore_parallel.py -s, tiny Qwen3.5, B = 2, T = 11 -> Tp = 128, gloo): at CP = 2 and at
   TP = 2 (+ SP) x CP = 2 logprobs, gathered logits and the replay of a shifted routing within 4.8e-7 of one rank,
   recordings equal, critic values within 1.4e-6 / 2.6e-6 (|V| up to 10.3); at CP = 2 parameter grads summed over
   the CP ranks within 5.3e-7 of max |grad| 7.6; Qwen3-MoE layout (no GDN, T = 12, chunks of 6) logprobs 4.8e-7,
   grads 1.8e-7 of 4.3, while rotary positions from 0 on every chunk put logprobs off by 1.5e-2. The trainer
   (tests/test_trainer_group.py, --plan '{"cp": 2}', warm-up + 2 steps, lr 1e-4) within 1.7e-6 (actor) / 1.2e-7
   (critic) of the one-rank trainer; with GDN chunk = S instead of 64 the actor was 2.6e-5 off (layer 0's A_log:
   grads ~1e-5 off by 1.5e-8, which Adam normalises).
7. On CPU (gloo) the distributed optimizer is ours: `ShardedAdam` over `wrap_ddp`'s Megatron DDP, the same ZeRO-1
   sharding as Megatron's DistributedOptimizer (each data-parallel / expert-data-parallel rank owns 1/dp of every
   DDP bucket; finalize_model_grads reduce-scatters the grads, start_param_sync all-gathers the params; grad norm
   summed over shards as Megatron's), because Megatron's refuses CPU parameters ('torch.cuda.FloatTensor' type
   checks, device='cuda' norm buffers). fp32 only, no weight decay, no loss scaling; the cluster keeps
   get_megatron_optimizer (`_ddp_and_optimizer`). Measured (python -m pytest tests/test_mcore_optim.py -s: 2 gloo
   ranks, 3 clipped steps, Adam eps 1e-4): DP = 2 / EP = 2 / TP = 2 + SP parameters within 3.0e-8 / 8.2e-7 / 1.4e-6
   of world-size-1 torch Adam + clip_grad_norm_ (|param| up to 2.8), grad norms within 1.2e-7 relative, each rank
   holding 0.51 / 0.51 / 0.52 of the model's Adam state. At torch's eps 1e-8, DP = 2 is bitwise equal to the
   reference, while EP = 2 / TP = 2 (3.2e-5 / 1.8e-4) sit at the fp32 floor Adam amplifies (the reference vs itself
   with the batch in two halves: 4.5e-5).

Measured (tests/test_cp_megatron.py: one tiny Qwen3.5 GDN layer, S = 250 with a partial last chunk, B = 2, fp32,
gloo): output concatenated over ranks bitwise equal to one rank at kappa = 2 and 4; input grads max |diff| 1.4e-9 /
1.9e-9; weight grads summed over ranks 8.3e-7 / 1.3e-6 at |dW| up to 4.5 (fp32 reassociation). Without the halo,
rank 1's output differs from its first token on (6e-3).

Measured (tests/test_mcore_tp.py: the tiny Qwen3.5 GPTModel, HF weights sharded per rank, B = 2, T = 12, fp32, 2 gloo
ranks, allgather dispatcher): TP = 2 with sequence parallel (MoELayer refuses TP > 1 without it in training) and EP = 2
give full-vocab logits within 1.2e-7 / 6.0e-8 of TP = EP = 1, grads within 3.1e-5 / 1.9e-5 at |grad| up to 81
(replicated grads summed over TP ranks, as finalize_model_grads does; EP experts 2x: both ranks ran the same batch).
Naive dim-0 chunks of in_proj / fc1 instead of per-part slices: logits off by 0.5.
"""

import contextlib
import os
import types

import torch

import r3

# --- CPU shims (megatron-core 0.16.1 on a CUDA-less torch) -------------------------------------------
_CPU_READY = False


class _NoCudaRngTracker:
    """Stands in for CudaRNGStatesTracker on CPU: fork() is a no-op (dropout is 0 in the tiny model)."""

    def fork(self, name=None):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def reset(self):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass


def init_cpu():
    """One-process gloo group + Megatron parallel state (all sizes 1) + the process-wide CPU shims."""
    global _CPU_READY
    if _CPU_READY:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without TE: name never bound
        moe_utils.te_general_gemm = None
    from megatron.core.ssm import gated_delta_net as gdn
    if not gdn.HAVE_FLA and not torch.cuda.is_available():  # GDN without flash-linear-attention (triton):
        gdn.HAVE_FLA = True  # GatedDeltaNet.__init__ raises ImportError on this flag alone
        gdn.l2norm = _l2norm  # fla.modules.l2norm
        gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule  # Megatron's own torch reference kernel
    mrandom._CUDA_RNG_STATE_TRACKER = _NoCudaRngTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if not torch.cuda.is_available():  # the backward of TP / SP layers asks for the device outside any block
        torch.cuda.current_device = lambda: "cpu"
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # no port to collide on
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    _CPU_READY = True


def _l2norm(x, dim=-1, eps=1e-6):
    """fla's l2norm on CPU (as transformers' Qwen3.5 reference): x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


class _RMSNorm(torch.nn.Module):
    """Local stand-in for TENorm(RMSNorm) honouring `layernorm_zero_centered_gamma` (y = x / rms(x) * (1 + w)),
    which megatron-core's own WrappedTorchNorm refuses; computed in fp32 as TE and transformers do."""

    def __init__(self, config, hidden_size, eps=1e-6, **unused):
        super().__init__()
        self.zero_centered, self.eps = config.layernorm_zero_centered_gamma, eps
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # as TENorm: under sequence parallel each TP rank's grad is partial; finalize_model_grads all-reduces it
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + 1 if self.zero_centered else self.weight.float()
        return (y * w).type_as(x)


@contextlib.contextmanager
def cpu_shims():
    """torch.cuda.current_device -> "cpu" inside the block (rotary embedding, router weight moves)."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved


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


def is_qwen35(hf):
    """Qwen3.5 layout (GDN + gated attention + gated shared expert) vs Qwen3-MoE (standard attention)."""
    return getattr(hf, "model_type", "").startswith("qwen3_5")


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
    cp_attention: core attention = _cp_dot_product_attention() (context parallel > 1 in parallel_state)."""
    import copy
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    base = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")  # MoE spec has SharedExpertMLP
    gdn = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=_RMSNorm, out_proj=RowParallelLinear))
    layers = []
    for linear in cfg.linear_attention_freq:
        spec = copy.deepcopy(base)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = _RMSNorm
        if linear:
            sub.self_attention = gdn
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = _RMSNorm
            if cp_attention:
                sub.self_attention.submodules.core_attention = _cp_dot_product_attention()
        layers.append(spec)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=_RMSNorm)


def build_tiny(hf, seed=0, **overrides):
    """Megatron-Core GPTModel (local modules, CPU) with the architecture of the HF Qwen3-MoE or Qwen3.5-MoE
    config `hf`."""
    init_cpu()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps
    torch.manual_seed(seed)
    cfg = megatron_config(hf, **overrides)
    first, last = _stage_layers(cfg)
    cp_attention = _cp()[1] > 1  # context parallel: config keeps CP = 1 (GDN asserts it), parallel_state has it
    if is_qwen35(hf):
        spec = _qwen35_local_spec(cfg, cp_attention)
        spec.layer_specs = spec.layer_specs[first:last]  # this pipeline stage's layers (the block builds all it gets)
    else:
        spec = get_gpt_layer_local_spec(num_experts=hf.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                        normalization="RMSNorm")
        if cp_attention:
            spec.submodules.self_attention.submodules.core_attention = _cp_dot_product_attention()
    rotary_percent = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)  # Qwen3.5: 0.25
    pp = cfg.pipeline_model_parallel_size > 1
    with cpu_shims():  # GatedDeltaNet allocates on torch.cuda.current_device()
        return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=hf.vocab_size,
                        max_sequence_length=hf.max_position_embeddings, position_embedding_type="rope",
                        rotary_percent=rotary_percent, rotary_base=_rope_theta(hf),
                        share_embeddings_and_output_weights=hf.tie_word_embeddings,
                        pre_process=ps.is_pipeline_first_stage() if pp else True,
                        post_process=ps.is_pipeline_last_stage() if pp else True)


def _stage_layers(cfg) -> tuple:
    """(first, last + 1) global decoder layers of this pipeline stage (all of them without PP)."""
    if cfg.pipeline_model_parallel_size == 1:
        return 0, cfg.num_layers
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    rank = ps.get_pipeline_model_parallel_rank()
    first = get_transformer_layer_offset(cfg, pp_rank=rank)
    return first, first + get_num_layers_to_build(cfg, pp_rank=rank)


# --- context-parallel Gated DeltaNet: Megatron's layer, infra.py's CP recurrence -----------------------------
# Paper: "native context parallelism for the recurrent operator". megatron-core 0.16.1 refuses it
# (TransformerConfig.__post_init__: "Gated delta net does not support context parallel for now"; gated_delta_net.py
# keeps `# TODO: support CP`). Inside GatedDeltaNet.forward only two things cross tokens: the causal depthwise
# conv1d (kernel K reads K-1 earlier tokens) and the recurrence; in_proj, l2norm, g/beta, gated norm and out_proj
# are token-local. `context_parallel_gdn` patches exactly those two and leaves the forward's code as it is.
class _ConvHalo(torch.autograd.Function):
    """(B, D, S_r) -> (B, D, K-1 + S_r): prepend the previous CP rank's last K-1 pre-conv columns (zeros on rank 0,
    i.e. the conv's own causal padding). Backward returns the halo's gradient to its owner, which adds it."""

    @staticmethod
    def forward(ctx, x, width, group):
        import torch.distributed as dist
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        peer = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
        halo = torch.zeros(*x.shape[:-1], width, dtype=x.dtype)
        send = dist.isend(x[..., -width:].contiguous(), peer(rank + 1), group=group) if rank < world - 1 else None
        if rank > 0:
            dist.recv(halo, peer(rank - 1), group=group)
        if send is not None:
            send.wait()
        ctx.width, ctx.group, ctx.rank, ctx.world, ctx.peer = width, group, rank, world, peer
        return torch.cat([halo, x], dim=-1)

    @staticmethod
    def backward(ctx, dy):
        import torch.distributed as dist
        w, rank, world, peer = ctx.width, ctx.rank, ctx.world, ctx.peer
        dx = dy[..., w:].clone()  # (B, D, S_r)
        send = dist.isend(dy[..., :w].contiguous(), peer(rank - 1), group=ctx.group) if rank > 0 else None
        if rank < world - 1:  # my last K-1 columns were rank+1's halo: their gradient comes back from there
            d_tail = torch.zeros_like(dx[..., -w:])
            dist.recv(d_tail, peer(rank + 1), group=ctx.group)
            dx[..., -w:] += d_tail
        if send is not None:
            send.wait()
        return dx, None, None


@contextlib.contextmanager
def context_parallel_gdn(model, group=None, chunk_size=64):
    """Inside the block every Megatron GatedDeltaNet in `model` runs as one rank of the context-parallel `group`
    (default: the layer's own pg_collection.cp, Megatron's CP group) on this rank's slice of the sequence,
    hidden_states [S_r, B, H] with the slices cut by infra.cp_split (chunk boundaries). Outputs and input
    gradients are this rank's slices; parameter gradients are partial sums (Megatron's DDP reduces them over
    DP x CP). How (module departure 6):
      1. conv1d: a forward pre-hook prepends the K-1 halo columns (_ConvHalo), a forward hook drops the K-1
         extra leading outputs, so the forward's own `[..., :seq_len]` slice is exact.
      2. recurrence: the module-level `chunk_gated_delta_rule` / `torch_chunk_gated_delta_rule` the forward
         calls -> infra.cp_chunk_gated_delta_rule (state S rank r -> r+1, dS back), swapped for the block only;
         `causal_conv1d_fn` -> None for the block so the (hooked) nn.Conv1d path runs on GPU too.
      3. TransformerConfig keeps context_parallel_size = 1 (it asserts that for GDN); the CP group is passed here.
    """
    import infra
    from megatron.core.ssm import gated_delta_net as gdn
    layers = [m for m in model.modules() if isinstance(m, gdn.GatedDeltaNet)]
    group = group if group is not None else layers[0].pg_collection.cp

    def recurrence(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   **unused):  # as GatedDeltaNet.forward calls either kernel
        assert initial_state is None and not output_final_state  # training forward: the sequence starts on rank 0
        return infra.cp_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel, group), None

    hooks = []
    for m in layers:
        w = m.conv1d.kernel_size[0] - 1  # K - 1 = 3 for Qwen3.5
        hooks += [m.conv1d.register_forward_pre_hook(lambda mod, args, w=w: (_ConvHalo.apply(args[0], w, group),)),
                  m.conv1d.register_forward_hook(lambda mod, args, out, w=w: out[..., w:])]  # (B, D, S_r + K-1)
    saved = gdn.chunk_gated_delta_rule, gdn.torch_chunk_gated_delta_rule, gdn.causal_conv1d_fn
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule = recurrence
    gdn.causal_conv1d_fn = None
    try:
        yield
    finally:
        gdn.chunk_gated_delta_rule, gdn.torch_chunk_gated_delta_rule, gdn.causal_conv1d_fn = saved
        for h in hooks:
            h.remove()


# --- HF <-> Megatron weights (Qwen3-MoE and Qwen3.5-MoE layouts, TP = EP = 1, local module names) -----------
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
        out.update(_hf_layer_to_megatron(sd, hf, i))
    return {k: v.detach().clone() for k, v in out.items()}


def _hf_layer_to_megatron(sd, hf, i, experts=None) -> dict:
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


# --- the Transformer-Engine layout: the cluster model's parameter names -----------------------------------------
# hf_to_megatron writes the local modules' names (build_tiny). The cluster model (_qwen35_gpt: megatron-core 0.16.1's
# get_transformer_block_with_experimental_attention_variant_spec, TESpecProvider, moe_grouped_gemm=True) differs in
# two places only, both read from the 0.16.1 source:
# 1. input norm: models/gpt/experimental_attention_variant_module_specs.py (get_transformer_block_with_experimental_
#    attention_variant_spec) sets input_layernorm = IdentityOp when the attention spec's metainfo
#    "fuse_input_layernorm" is True: GDN (get_gated_delta_net_module_spec: in_proj = TELayerNormColumnParallelLinear)
#    and attention (_get_self_attention_module_spec: TESpecProvider.fuse_layernorm_and_linear() is True; linear_qkv
#    = TELayerNormColumnParallelLinear, gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec). That class is
#    te.pytorch.LayerNormLinear (extensions/transformer_engine.py), which registers `layer_norm_weight` (and
#    `layer_norm_bias` only for LayerNorm, not RMSNorm) and takes zero_centered_gamma from the config as _RMSNorm
#    does, so the value copies: input_layernorm.weight -> self_attention.{in_proj | linear_qkv}.layer_norm_weight.
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


def to_te_layout(sd, hf) -> dict:
    """Local-module GPTModel state dict (hf_to_megatron's, after shard_for_ep / shard_for_tp) -> the TE-spec model's
    names (rules 1-2 above); tensors are not copied. Inverse: from_te_layout."""
    fused = {f"decoder.layers.{i}.input_layernorm.weight": _fused_input_norm(hf, i)
             for i in range(hf.num_hidden_layers)}
    if not fused.keys() <= sd.keys():
        raise KeyError(f"to_te_layout: no {sorted(fused.keys() - sd.keys())[:3]}")
    out = {}
    for k, w in sd.items():
        if ".mlp.experts.local_experts." in k:  # {m}.mlp.experts.local_experts.{e}.linear_fc1.weight
            head, rest = k.split(".local_experts.")
            e, tail = rest.split(".", 1)
            k = f"{head}.{tail}{e}"  # {m}.mlp.experts.linear_fc1.weight{e}
        out[fused.get(k, k)] = w
    return out


def from_te_layout(sd, hf) -> dict:
    """TE-spec GPTModel state dict (without `_extra_state`) -> the local-module names: the inverse of to_te_layout."""
    unfused = {_fused_input_norm(hf, i): f"decoder.layers.{i}.input_layernorm.weight"
               for i in range(hf.num_hidden_layers)}
    out = {}
    for k, w in sd.items():
        if ".mlp.experts.linear_fc" in k:  # {m}.mlp.experts.linear_fc1.weight{e}
            head, rest = k.split(".mlp.experts.")
            name = rest.rstrip("0123456789")
            k = f"{head}.mlp.experts.local_experts.{rest[len(name):]}.{name}"
        out[unfused.get(k, k)] = w
    return out


def load_hf_into_cluster_model(gpt, hf_state_dict, hf):
    """HF weights into the cluster GPTModel (_qwen35_gpt: TE modules, grouped-GEMM experts): hf_to_megatron, this
    rank's shard (shard_for_ep, shard_for_tp), the TE names (to_te_layout), then a strict load (only `_extra_state`
    may be missing). Needs CUDA + Transformer Engine (the model does); on CPU its renames are tested as functions."""
    from megatron.core import parallel_state as ps
    c = gpt.config
    assert c.moe_grouped_gemm, "to_te_layout writes TEGroupedMLP names (moe_grouped_gemm=True)"
    assert c.pipeline_model_parallel_size == 1, "PP > 1: a stage's layers are renumbered from 0, not written here"
    sd = hf_to_megatron(hf_state_dict, hf)
    sd = shard_for_ep(sd, hf.num_experts, ps.get_expert_model_parallel_rank(), c.expert_model_parallel_size)
    sd = shard_for_tp(sd, hf, ps.get_tensor_model_parallel_rank(), c.tensor_model_parallel_size,
                      ps.get_expert_tensor_parallel_rank(), c.expert_tensor_parallel_size)
    sd = to_te_layout(sd, hf)
    missing, unexpected = gpt.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"load_hf_into_cluster_model: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    return gpt


def _tp_cuts(hf):
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


def _is_tp_cut(k, hf):
    parts, cols, rows = _tp_cuts(hf)
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
    parts, cols, rows = _tp_cuts(hf)
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
    parts, cols, rows = _tp_cuts(hf)
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


def load_hf_into_megatron(gpt, hf_state_dict, hf):
    """Copy converted HF weights into `gpt`; every real parameter must be covered (only _extra_state left)."""
    c = gpt.config
    sd = hf_to_megatron(hf_state_dict, hf)
    if max(c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size) > 1:
        from megatron.core import parallel_state as ps  # this rank's shard: experts cut by expert TP, the rest by TP
        sd = shard_for_ep(sd, hf.num_experts, ps.get_expert_model_parallel_rank(), c.expert_model_parallel_size)
        sd = shard_for_tp(sd, hf, ps.get_tensor_model_parallel_rank(), c.tensor_model_parallel_size,
                          ps.get_expert_tensor_parallel_rank(), c.expert_tensor_parallel_size)
    if c.pipeline_model_parallel_size > 1:  # this stage's layers
        sd = shard_for_pp(sd, *_stage_layers(c), gpt.pre_process, gpt.post_process)
    missing, unexpected = gpt.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"hf_to_megatron: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")
    return gpt


class _CheckpointReader:
    """An HF checkpoint directory's safetensors (`model.safetensors`, or the shards `model.safetensors.index.json`
    lists) as the state dict _hf_layer_to_megatron reads: sd[key] under the in-memory names (experts fused
    (E, 2I, H) / (E, H, I), read from fused tensors or from each expert's gate / up / down_proj as save_pretrained
    writes them; the `model.language_model.` prefix of Qwen3.5's multimodal checkpoints accepted), as float32 (what
    model.load_actor gives), fetched on access with safe_open + get_slice and only this rank's part: the routed
    experts `experts` (this EP rank's contiguous range) and, for the tensors shard_for_tp cuts whole (CUT_ON_READ,
    the 1:1 copies of hf_to_megatron; experts' down_proj by expert TP), this TP rank's block. read_bytes counts
    what was fetched (numel * element size of every tensor or slice, in the file's dtype)."""
    CUT_ON_READ = {"model.embed_tokens.weight": 0, "lm_head.weight": 0, "self_attn.o_proj.weight": 1,
                   "linear_attn.out_proj.weight": 1, "linear_attn.A_log": 0, "linear_attn.dt_bias": 0,
                   "mlp.shared_expert.down_proj.weight": 1}  # HF key suffix: dim of its TP cut

    def __init__(self, path, files, experts, tp_rank, tp_size, etp_rank, etp_size):
        import json
        from safetensors import safe_open
        path = str(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]  # key -> file name
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"path: no model.safetensors or model.safetensors.index.json in {path!r}")
        self.where, self.experts, self.read_bytes = where, experts, 0
        self.tp, self.etp = (tp_rank, tp_size), (etp_rank, etp_size)
        names = sorted(set(where.values()))  # files: an ExitStack that closes them
        self.files = {n: files.enter_context(safe_open(os.path.join(path, n), framework="pt")) for n in names}
        self.file_bytes = sum(os.path.getsize(os.path.join(path, n)) for n in names)

    def _name(self, key):
        if key not in self.where and key.startswith("model."):
            return "model.language_model." + key[len("model."):]
        return key

    def __contains__(self, key):
        return self._name(key) in self.where

    def _read(self, key, cuts=(), experts=False):
        """cuts: ((dim, (rank, size)), ..): that rank's torch.chunk block along each dim; experts: rows self.experts."""
        name = self._name(key)
        if name not in self.where:
            raise KeyError(f"checkpoint: no tensor {key!r}")
        w = self.files[self.where[name]].get_slice(name)
        shape = w.get_shape()
        index = [slice(None)] * len(shape)
        if experts:
            index[0] = slice(self.experts.start, self.experts.stop)
        for dim, (rank, size) in cuts:
            per = -(-shape[dim] // size)  # torch.chunk's block size
            index[dim] = slice(min(rank * per, shape[dim]), min((rank + 1) * per, shape[dim]))
        w = w[tuple(index)]
        self.read_bytes += w.numel() * w.element_size()
        return w.to(torch.float32)

    def __getitem__(self, key):
        if key.endswith("mlp.experts.gate_up_proj"):  # (E_local, 2I, H); fc1 is cut per part ([gate; up]): whole
            if key in self:
                return self._read(key, experts=True)
            h = key[:-len("gate_up_proj")]
            return torch.stack([torch.cat([self._read(f"{h}{e}.gate_proj.weight"), self._read(f"{h}{e}.up_proj.weight")])
                                for e in self.experts])
        if key.endswith("mlp.experts.down_proj"):  # (E_local, H, I / etp): row-parallel, this expert-TP rank's columns
            if key in self:
                return self._read(key, ((2, self.etp),), experts=True)
            h = key[:-len("down_proj")]
            return torch.stack([self._read(f"{h}{e}.down_proj.weight", ((1, self.etp),)) for e in self.experts])
        dim = next((d for s, d in self.CUT_ON_READ.items() if key.endswith(s)), None)
        return self._read(key, () if dim is None else ((dim, self.tp),))


def load_checkpoint_into_megatron(gpt, path, hf, stats=None):
    """load_hf_into_megatron from the HF checkpoint directory `path` without the whole model in memory: layer by
    layer, this rank reads only its part of the safetensors (_CheckpointReader): its pipeline stage's layers (the
    embedding on the first stage, the final norm and output layer on the last), its EP rank's experts, and its TP /
    expert-TP block of the tensors shard_for_tp cuts whole (vocab rows of embedding and output layer, A_log /
    dt_bias, the row-parallel columns of o_proj / out_proj / down_proj); tensors cut per part (linear_qkv's query
    groups, GDN in_proj / conv1d, fc1 [gate; up]) are read whole for one layer and cut by shard_for_tp. The
    conversion is hf_to_megatron's per layer (_hf_layer_to_megatron), then shard_for_ep / shard_for_tp /
    shard_for_pp, each layer loaded into `gpt` as it is read; the result is bit-identical to load_hf_into_megatron
    of model.load_actor(path)'s state dict (tests/test_mcore_load.py), with the same strict check. stats (a dict,
    optional) gets read_bytes (fetched from the files) and file_bytes (the files' size)."""
    c = gpt.config
    tp, ep, etp = c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size
    tp_rank = ep_rank = etp_rank = 0
    if max(tp, ep, etp) > 1:
        from megatron.core import parallel_state as ps
        tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        etp_rank = ps.get_expert_tensor_parallel_rank()
    per = hf.num_experts // ep
    experts = range(ep_rank * per, (ep_rank + 1) * per)  # shard_for_ep's contiguous block
    first, last = _stage_layers(c)
    _, cols, rows = _tp_cuts(hf)
    cut_on_read = tuple(k for k in cols + rows if k != "linear_qkv.weight")  # Megatron names of CUT_ON_READ's
    expected = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    loaded, unexpected = set(), []

    def load(part):  # part of hf_to_megatron's dict (global layer numbers, this rank's experts) -> this rank's, into gpt
        part = shard_for_ep(part, hf.num_experts, ep_rank, ep)
        done = {k: w for k, w in part.items() if k.endswith(cut_on_read)}  # cut at read
        part = {**shard_for_tp({k: w for k, w in part.items() if k not in done}, hf, tp_rank, tp, etp_rank, etp), **done}
        part = shard_for_pp(part, first, last, gpt.pre_process, gpt.post_process)
        unexpected.extend(gpt.load_state_dict(part, strict=False).unexpected_keys)
        loaded.update(part)

    with contextlib.ExitStack() as files:
        sd = _CheckpointReader(path, files, experts, tp_rank, tp, etp_rank, etp)
        ends = {}
        if gpt.pre_process:
            ends["embedding.word_embeddings.weight"] = sd["model.embed_tokens.weight"]
        if gpt.post_process:
            ends["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
            ends["output_layer.weight"] = sd["lm_head.weight" if "lm_head.weight" in sd else "model.embed_tokens.weight"]
        load(ends)
        for i in range(first, last):
            load(_hf_layer_to_megatron(sd, hf, i, experts))
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"load_checkpoint_into_megatron: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if stats is not None:
        stats.update(read_bytes=sd.read_bytes, file_bytes=sd.file_bytes)
    return gpt


# --- the training-step interface of the embedded backend ----------------------------------------------
def _seq_multiple(gpt) -> int:
    """Sequence parallel splits the sequence over the TP ranks: T must be a multiple of tp (1 otherwise)."""
    c = gpt.config
    return c.tensor_model_parallel_size if c.sequence_parallel else 1


def _cp():
    """(rank, size, group) of parallel_state's context-parallel group; (0, 1, None) without CP. The models'
    TransformerConfig keeps context_parallel_size = 1 (0.16.1 asserts it for GDN): parallel_state holds the CP."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return 0, 1, None
    return ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(), ps.get_context_parallel_group()


_GDN_CHUNK = 64  # the gated delta rule's chunk (torch_chunk_gated_delta_rule's default)


def _padded_len(gpt, T) -> int:
    """T right-padded for the sequence split: a multiple of cp * tp (sequence parallel); under CP with GDN layers
    every CP chunk is a multiple of the kernel's chunk (_GDN_CHUNK): infra.cp_chunk_gated_delta_rule needs the
    chunks but the last to end on one, and the same chunking as one rank keeps the decay parameters' grads (A_log,
    dt_bias: sums of cancelling terms, |grad| ~1e-5 here) at one rank's: 3.7e-10 vs 1.5e-8 with chunk = S."""
    import math
    cp = _cp()[1]
    m = cp * _seq_multiple(gpt)
    if cp > 1 and gpt.config.experimental_attention_variant == "gated_delta_net":
        m = cp * math.lcm(_GDN_CHUNK, _seq_multiple(gpt))
    return T + (-T % m)


def _gpt_forward(gpt, input_ids, attention_mask=None):
    """GPTModel on (B, T) ids with a 1/0 right-padding mask -> its output layer's (B, T, *) output (vocab-parallel
    logits: this TP rank's V / tp columns). Under sequence parallel T is right-padded to a multiple of tp (mask 0,
    so real tokens are unchanged) and the output cut back to T. Under context parallel (mcore.py departure 6)
    T is padded to Tp (_padded_len) and this CP rank runs the contiguous chunk [r * S, (r + 1) * S), S = Tp / cp:
    its ids, its rows of the causal x key-padding mask against all Tp keys (_cp_dot_product_attention gathers K / V),
    rotary embeddings of its global positions (_cp_rope), GDN layers state-passed (context_parallel_gdn); the
    result is this chunk's (B, S, *) output (callers gather it over CP: _cp_full)."""
    B, T = input_ids.shape
    dev = input_ids.device
    key_ok = torch.ones(B, T, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.bool()
    Tp = _padded_len(gpt, T)
    if Tp > T:
        input_ids = torch.nn.functional.pad(input_ids, (0, Tp - T))
        key_ok = torch.nn.functional.pad(key_ok, (0, Tp - T))
    allowed = torch.tril(torch.ones(Tp, Tp, dtype=torch.bool, device=dev))[None] & key_ok[:, None, :]  # (B, Tp, Tp)
    mask = ~allowed[:, None]  # (B, 1, Tp, Tp): Megatron masks where True
    pos = torch.arange(Tp, device=dev)[None].expand(B, Tp)  # (B, Tp)
    r, cp, group = _cp()
    if cp > 1:
        if gpt.config.pipeline_model_parallel_size > 1:
            raise NotImplementedError("context parallel with pipeline parallel: not written (train_t1 refuses it)")
        S = Tp // cp
        lo = r * S  # this rank's chunk [lo, lo + S) of the padded sequence
        input_ids, mask, pos = input_ids[:, lo:lo + S], mask[:, :, lo:lo + S], pos[:, lo:lo + S]  # mask (B, 1, S, Tp)
        gdn = any(type(m).__name__ == "GatedDeltaNet" for m in gpt.modules())
        with cpu_shims(), _cp_rope(gpt, lo), (context_parallel_gdn(gpt, group, chunk_size=_GDN_CHUNK) if gdn
                                             else contextlib.nullcontext()):
            return gpt(input_ids.to(torch.long), pos, attention_mask=mask)  # (B, S, *)
    with cpu_shims():
        if gpt.config.pipeline_model_parallel_size == 1:
            return gpt(input_ids.to(torch.long), pos, attention_mask=mask)[:, :T]
        if not gpt.pre_process:  # the previous stage's hidden states (S / tp, B, H) become this stage's input
            shape = (Tp // _seq_multiple(gpt), B, gpt.config.hidden_size)
            link = torch.zeros((), requires_grad=torch.is_grad_enabled())  # so that backward reaches the recv
            gpt.set_input_tensor(_PipeRecv.apply(link, shape, gpt.config.params_dtype))
        out = gpt(input_ids.to(torch.long), pos, attention_mask=mask)
        if not gpt.post_process:  # hidden states (S / tp, B, H) on to the next stage; the link carries their grad
            gpt.pipe_link = _PipeSend.apply(out)
            return None
        return out[:, :T]


# --- context parallel: contiguous sequence chunks over parallel_state's CP group (mcore.py departure 6) -------
@contextlib.contextmanager
def _cp_rope(gpt, offset):
    """GPTModel builds its rotary table for positions 0..S-1 of the length it sees (position_ids only feed
    learned / multimodal embeddings) and RotaryEmbedding.forward cuts Megatron's zig-zag share for
    parallel_state's CP group; here the chunk starts at global position `offset`: the table of positions
    offset..offset+S-1 (RotaryEmbedding.get_emb's own offset), for this call only."""
    rope = gpt.rotary_pos_emb
    rope.forward = lambda max_seq_len, *unused, **unused_kw: rope.get_emb(max_seq_len, offset)  # [S, 1, 1, dim]
    try:
        yield
    finally:
        del rope.forward  # back to the class's forward


class _CPGather(torch.autograd.Function):
    """x, this CP rank's contiguous part along `dim` -> every rank's parts concatenated in rank order. Backward,
    sum_grads=True (K / V, read by every rank's queries): the grads of all ranks' copies summed (all-reduce), this
    rank's part; sum_grads=False (a result every CP rank turns into the same loss): this rank's part of its own
    grad only (summing the others' would multiply the grad by cp, as for _PipeBroadcast)."""

    @staticmethod
    def forward(ctx, x, dim, group, sum_grads):
        import torch.distributed as dist
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.dim, ctx.group, ctx.sum_grads, ctx.n = dim, group, sum_grads, x.shape[dim]
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        if ctx.sum_grads:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad.narrow(ctx.dim, r * ctx.n, ctx.n).contiguous(), None, None, None


def _cp_full(x, T):
    """(B, S, *) of this CP rank's chunk -> (B, T, *) on every CP rank (_CPGather, grad counted once); x as is
    without CP (_gpt_forward already cut it to T)."""
    _, cp, group = _cp()
    return x if cp == 1 else _CPGather.apply(x, 1, group, False)[:, :T]


_CP_ATTENTION = []  # the class, built once on first use (megatron is imported lazily)


def _cp_dot_product_attention():
    """The CP core attention class (a DotProductAttention subclass; defined here so mcore imports without megatron)."""
    if _CP_ATTENTION:
        return _CP_ATTENTION[0]
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CPDotProductAttention(DotProductAttention):
        """Megatron's local DotProductAttention (its scale 1/sqrt(d), fp32 softmax of the masked scores, GQA by
        repeat_interleave) of this CP rank's queries [S, B, np, d] against the keys / values of all CP ranks,
        all-gathered along the sequence (contiguous chunks in rank order: [Tp, B, ng, d]); the mask _gpt_forward
        passes is this chunk's rows (B, 1, S, Tp), causal by global position and over padded keys. The gather's
        backward sums K / V grads over the ranks and returns each its own. Used only with parallel_state's CP > 1
        (the config keeps CP = 1, which the parent asserts); Megatron's TE attention runs ring attention instead."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            _, cp, group = _cp()
            if cp > 1:
                key, value = _CPGather.apply(key, 0, group, True), _CPGather.apply(value, 0, group, True)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    _CP_ATTENTION.append(CPDotProductAttention)
    return CPDotProductAttention


# --- pipeline parallel: one forward through the stages as one autograd graph over the PP group -------------
# Megatron's schedules (1F1B over microbatches) drive a training step from the outside; the training step here is
# train_t1's, unchanged, so a forward over PP stages is written as autograd functions instead: stage s receives
# the hidden states of stage s - 1 (_PipeRecv, whose backward sends their grad back), runs its layers and sends
# its output to stage s + 1 (_PipeSend, whose backward receives that grad); the last stage's result (logprobs,
# values, logits) is broadcast to every stage (_PipeBroadcast) so each rank returns the same tensor and computes
# the same loss; backward counts the last stage's copy only. One microbatch at a time: GPipe without the overlap
# (mcore.py departure 3). gpt.pipe_link carries the send's autograd link (a 0-d tensor) from the stage's forward to
# the broadcast, which on a non-last stage takes it as its input so the backward of the loss reaches the send.
class _PipeSend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        dist.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        ctx.shape, ctx.dtype = hidden.shape, hidden.dtype
        return hidden.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        grad = torch.empty(ctx.shape, dtype=ctx.dtype)
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        return grad


class _PipeRecv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link, shape, dtype):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        hidden = torch.empty(shape, dtype=dtype)
        dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
        return hidden

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        dist.send(grad.contiguous(), ps.get_pipeline_model_parallel_prev_rank())
        return None, None, None


class _PipeBroadcast(torch.autograd.Function):
    """The last stage's tensor on every stage; backward: the last stage keeps its own grad (every stage computes
    the same loss from the copy: counting theirs too would multiply the grad by PP), the others pass nothing."""

    @staticmethod
    def forward(ctx, x, shape, dtype):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        ctx.last = ps.is_pipeline_last_stage()
        out = x.detach().clone() if ctx.last else torch.empty(shape, dtype=dtype)
        dist.broadcast(out, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.last else torch.zeros(())), None, None


def _pipe_result(gpt, out, shape, dtype=torch.float32):
    """`out` of the last stage (None elsewhere) -> the same tensor on every stage of the pipeline."""
    if gpt.config.pipeline_model_parallel_size == 1:
        return out
    return _PipeBroadcast.apply(out if gpt.post_process else gpt.pipe_link, shape, dtype)


class MegatronActor(torch.nn.Module):
    """GPTModel behind the embedded backend's interface: forward(input_ids, attention_mask) -> .logits.

    attention_mask (B, T) 1/0 (right padding, as train_t1.pad_batch); logits (B, T, V) fp32 (gathered over the
    TP ranks when the output layer is vocab-parallel). `token_logprobs` is the training path: log pi of the next
    token straight from the vocab-parallel logits (Megatron's vocab-parallel cross entropy), never the (B, T, V)
    gather. `r3.routing(actor, mode, experts)` works as for the HF actor: it calls `self.routing`, which slices
    (B, T, L, k) experts for this rank (`r3.slice_for_megatron`, layout from parallel_state unless given) and
    drives RouterReplay; a recording is gathered back to (B, T, L, k) over the sequence-parallel ranks (and the
    context-parallel ranks: contiguous chunks). Under CP every rank returns the whole (B, T-1) / (B, T, V).
    """

    r3_backend = "megatron"

    def __init__(self, gpt, layout=None):
        super().__init__()
        self.gpt = gpt
        c = gpt.config
        cp_rank, cp, _ = _cp()
        if layout is None and (c.tensor_model_parallel_size > 1 or c.pipeline_model_parallel_size > 1 or cp > 1):
            from megatron.core import parallel_state as ps
            layout = dict(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=c.tensor_model_parallel_size,
                          sp=c.sequence_parallel)
            if cp > 1:  # _gpt_forward's contiguous chunks, not Megatron's zig-zag
                layout.update(cp_rank=cp_rank, cp_size=cp, cp_contiguous=True)
            if c.pipeline_model_parallel_size > 1:  # this stage's layers (every layer is MoE in both layouts)
                layout.update(layers=_stage_layers(c), moe_layers=[1] * c.num_layers)
        self.layout = dict(layout or {})  # kwargs of r3.slice_for_megatron (tp/cp ranks, layers, moe_layers)
        self.batch_shape = None

    def forward(self, input_ids, attention_mask=None):
        self.batch_shape = tuple(input_ids.shape)  # (B, T)
        logits = _gpt_forward(self.gpt, input_ids, attention_mask)  # (B, T, V / tp); None before the last stage
        if logits is not None and self.gpt.config.tensor_model_parallel_size > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
            with cpu_shims():
                logits = gather_from_tensor_model_parallel_region(logits)  # (B, T, V); CP: (B, S, V)
        logits = None if logits is None else _cp_full(logits.float(), input_ids.shape[1])  # (B, T, V)
        logits = _pipe_result(self.gpt, None if logits is None else logits.float(), (*input_ids.shape, self.gpt.vocab_size))
        return types.SimpleNamespace(logits=logits.float())

    def token_logprobs(self, input_ids, attention_mask=None, temperature=1.0):
        """(B, T-1): log pi(tokens[j+1] | tokens[:j+1]) at temperature, from this rank's vocab shard:
        log p = -CE = z_target - log sum exp z (max, sum and target logit all-reduced over TP)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
        self.batch_shape = tuple(input_ids.shape)
        B, T = input_ids.shape
        logits, lp = _gpt_forward(self.gpt, input_ids, attention_mask), None  # (B, T, V / tp) on the last stage
        r, cp, _ = _cp()
        if logits is not None and cp > 1:  # this chunk's (B, S, V / tp): targets are the ids shifted globally
            S = logits.shape[1]
            targets = torch.nn.functional.pad(input_ids, (0, cp * S + 1 - T))[:, r * S + 1:(r + 1) * S + 1]  # (B, S)
            with cpu_shims():
                lp = -vocab_parallel_cross_entropy(logits.float() / temperature, targets.long())  # (B, S)
            lp = _cp_full(lp, T - 1)  # (B, T-1) on every CP rank
        elif logits is not None:
            with cpu_shims():  # CE works in place on its input: the division made a fresh tensor
                lp = -vocab_parallel_cross_entropy(logits[:, :-1].float() / temperature, input_ids[:, 1:].long())
        return _pipe_result(self.gpt, lp, (B, T - 1))  # (B, T-1) on every pipeline stage

    @contextlib.contextmanager
    def routing(self, mode, experts=None):
        rs = r3.megatron_routers(self.gpt)
        layer_experts = None
        if mode == "replay" and experts is not None:
            n_moe = sum(self.layout.get("moe_layers") or [1] * len(rs))
            experts = r3._check_replay_experts(experts, n_moe, rs[0].topk, rs[0].config.num_moe_experts)
            pad = _padded_len(self.gpt, experts.shape[1]) - experts.shape[1]  # _gpt_forward's; -1 rows route live
            experts = torch.nn.functional.pad(experts, (0, 0, 0, 0, 0, pad), value=-1) if pad else experts
            layer_experts = r3.slice_for_megatron(experts, **self.layout)
        with r3.megatron_routing(self.gpt, mode, layer_experts) as ctx:
            ctx.batch_shape = self._routed_shape
            if _seq_multiple(self.gpt) > 1 or self.gpt.config.pipeline_model_parallel_size > 1 or _cp()[1] > 1:
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
        _, cp, group = _cp()
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
class _ValueHead(torch.nn.Module):
    """Scalar head in GPTModel's output_layer slot: (S, B, H) -> ((S, B, 1), None). Replicated on every TP
    rank; under sequence parallel it gathers the sequence, backward only splits (no reduce: grads are whole)."""

    def __init__(self, config):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))  # zero init,
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))  # as critic.Critic: V = 0 at start
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


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
    (as from_actor and build_qwen35_critic do). R3 pins the actor's logprobs to the sampler's experts; the
    critic never ran in the sampler, so there is no recording to replay and its router trains freely.
    """

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        if gpt.post_process:  # last pipeline stage
            gpt.output_layer = _ValueHead(gpt.config)

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
        v = None if v is None else _cp_full(v, input_ids.shape[1])  # (B, T, 1) on every CP rank
        v = _pipe_result(self.gpt, None if v is None else v.squeeze(-1).float(), tuple(input_ids.shape))  # (B, T):
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # V of prefix ending at t; shift: V(s_j)


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



# --- the embedded Megatron backend: world size 1 on this machine (train_t1.py --backend megatron) ---------
def embedded_models(hf_actor, path=None):
    """(actor, behaviour, critic) for train_t1's Trainer from an HF Qwen3-MoE or Qwen3.5-MoE actor: two MegatronActors
    with its weights (the behaviour copy holds the weights that sampled a batch) and a MegatronCritic
    from the actor's backbone. Local modules (CPU or GPU), in the layout parallel_state holds (the trainer rank
    initialises it per --plan; one process otherwise): this rank's TP / EP / PP shards, sequence parallel with TP
    (Megatron's MoE refuses TP without it in training), calculate_per_token_loss for DDP (wrap_ddp).
    `hf_actor`: the HF model (its state dict converted), or with `path` (its HF checkpoint directory) only its config:
    then each rank reads just its shards from the files (load_checkpoint_into_megatron)."""
    cfg = hf_actor if path is not None else hf_actor.config
    if getattr(cfg, "model_type", "") not in ("qwen3_moe", "qwen3_5_moe_text"):
        raise ValueError(f"hf_actor: the embedded Megatron backend converts the Qwen3-MoE and Qwen3.5-MoE text "
                         f"layouts, got {getattr(cfg, 'model_type', type(hf_actor).__name__)!r}")
    init_cpu()  # shims; parallel state of one rank unless the trainer set its plan
    from megatron.core import parallel_state as ps
    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    layout = dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                  expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(), sequence_parallel=tp > 1,
                  pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                  pipeline_dtype=torch.float32, calculate_per_token_loss=True)
    def load(gpt):
        if path is not None:
            return load_checkpoint_into_megatron(gpt, path, cfg)
        return load_hf_into_megatron(gpt, hf_actor.state_dict(), cfg)
    actor, behaviour = (MegatronActor(load(build_tiny(cfg, **layout))) for _ in range(2))
    return actor, behaviour, MegatronCritic.from_actor(actor)


def gather_full_state(gpt, hf) -> dict:
    """This rank's GPTModel -> the TP = EP = 1 state dict (no _extra_state), what megatron_to_hf /
    critic_megatron_to_hf take. Sharded (TP or EP > 1, parallel_state initialised) it is a collective: every rank
    of the model-parallel job calls it and every rank gets the whole dict. Dense tensors cut by shard_for_tp's
    rules are all-gathered over the TP group; expert tensors over the expert-TP group (its own size, ETP, which
    may differ from TP), then over the expert-parallel group; then unshard_tp / unshard_ep. Replicated
    tensors are this rank's, not sent (equal over ranks once grads are all-reduced). A MegatronCritic's value head
    (_ValueHead, weight (1, H) and bias) is replicated, not vocab-parallel: taken as it is. Pipeline stages: each
    stage's TP / EP-gathered part is all-gathered over the PP group and renumbered (unshard_pp).
    At TP = EP = ETP = PP = 1 it is the local state dict, no communication."""
    c = gpt.config
    tp, ep, etp = c.tensor_model_parallel_size, c.expert_model_parallel_size, c.expert_tensor_parallel_size
    sd = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    if tp == 1 and ep == 1 and etp == 1 and c.pipeline_model_parallel_size == 1:
        return sd
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    value_head = isinstance(getattr(gpt, "output_layer", None), _ValueHead)
    head = {k: sd.pop(k) for k in list(sd) if value_head and k.startswith("output_layer.")}
    experts = {k: sd.pop(k) for k in list(sd) if ".local_experts." in k}

    def all_gather(part, group, size, which):  # {k: this rank's tensor} -> [{k: rank r's tensor}] in group order
        ranks = [{} for _ in range(size)]
        for k, w in part.items():  # the same keys in the same order on every rank of the group
            ws = [w] * size
            if which(k):
                ws = [torch.empty_like(w) for _ in range(size)]
                dist.all_gather(ws, w.contiguous(), group=group)
            for r in range(size):
                ranks[r][k] = ws[r]
        return ranks

    def cut(k):
        return _is_tp_cut(k, hf)
    if tp > 1:  # dense tensors (the shared expert too) over the TP group
        sd = unshard_tp(all_gather(sd, ps.get_tensor_model_parallel_group(), tp, cut), hf, tp)
    if etp > 1:  # expert tensors over the expert-TP group
        experts = unshard_tp(all_gather(experts, ps.get_expert_tensor_parallel_group(), etp, cut), hf, etp, etp)
    if ep > 1:
        experts = unshard_ep(all_gather(experts, ps.get_expert_model_parallel_group(), ep, lambda k: True),
                             hf.num_experts, ep)
    out = {**sd, **experts, **head}
    if c.pipeline_model_parallel_size > 1:  # every stage's layers (the stage's first global layer numbers them)
        stages = [None] * c.pipeline_model_parallel_size
        dist.all_gather_object(stages, (_stage_layers(c)[0], out), group=ps.get_pipeline_model_parallel_group())
        out = unshard_pp(stages)
    return out


def to_hf(actor, hf_config):
    """The MegatronActor's weights in a Hugging Face model of `hf_config`. Sharded over TP / EP ranks: a collective
    (gather_full_state), every rank calls it and gets the whole model."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    hf.load_state_dict(megatron_to_hf(gather_full_state(actor.gpt, hf_config), hf_config), strict=True)
    return hf


def save_hf(actor, hf_config, tokenizer, path):
    """The MegatronActor's weights as a Hugging Face checkpoint (what the engines load). Under torch.distributed with
    world size > 1 every rank calls it (the gather is a collective); global rank 0 writes, and no rank returns
    before the checkpoint is on disk."""
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if world > 1 and dist.get_rank() != 0:
        gather_full_state(actor.gpt, hf_config)  # this rank's part of the gather; rank 0 writes
    else:
        hf = to_hf(actor, hf_config)
        os.makedirs(path, exist_ok=True)
        hf.save_pretrained(path)
        tokenizer.save_pretrained(path)
    if world > 1:
        dist.barrier()


# --- the cluster model: Qwen3.5 with Megatron-Core (GPU nodes only) ------------------------------------
QWEN35_PRESETS = {  # paper model and its smaller sibling (num layers, hidden, heads, experts, ...)
    "qwen35-122b-a10b": dict(num_layers=48, hidden_size=3072, num_attention_heads=32, num_query_groups=2,
                             kv_channels=256, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=1024,
                             moe_shared_expert_intermediate_size=1024, linear_num_key_heads=16,
                             linear_num_value_heads=64, linear_key_head_dim=128, linear_value_head_dim=128,
                             vocab_size=248320),
    "qwen35-35b-a3b": dict(num_layers=40, hidden_size=2048, num_attention_heads=16, num_query_groups=2,
                           kv_channels=256, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=512,
                           moe_shared_expert_intermediate_size=512, linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                           vocab_size=248320),
}


def qwen35_config(preset, tp=1, pp=1, cp=1, ep=1, etp=1, **overrides):
    """TransformerConfig of a Qwen3.5 preset: GDN 3:1 with gated attention, MoE + gated shared expert,
    flex dispatcher with DeepEP, aux loss 0, router replay on, router fusion off. -> (config, vocab_size)."""
    from megatron.core.transformer import TransformerConfig
    p = dict(QWEN35_PRESETS[preset])
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


def require_cluster(what):
    """Fail early, naming what is missing, instead of deep inside Megatron (no CUDA / TE / FLA / DeepEP)."""
    import importlib.util
    missing = [] if torch.cuda.is_available() else ["CUDA"]
    missing += [m for m in ("transformer_engine", "fla", "deep_ep") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{what}: needs a GPU node with {', '.join(missing)} (requirements-cluster.txt); "
                           "on CPU use build_tiny")


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


def _ddp_and_optimizer(model, cfg, lr):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     overlap_grad_reduce=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, bf16=True, use_distributed_optimizer=True,
                                                 weight_decay=0.0, clip_grad=1.0), [ddp])
    return ddp, opt


def build_qwen35(preset, lr=1e-6, **parallel):
    """(GPTModel wrapped in DDP, distributed optimizer) for a Qwen3.5 preset. Needs CUDA + TE + FLA + DeepEP,
    and torch.distributed / parallel_state initialised by the launcher (one process per GPU)."""
    require_cluster("build_qwen35")
    gpt = _qwen35_gpt(preset, **parallel).cuda()
    return _ddp_and_optimizer(gpt, gpt.config, lr)


def build_qwen35_critic(preset, lr=1.5e-5, **parallel):
    """(MegatronCritic wrapped in DDP, distributed optimizer): the actor's architecture with the scalar head,
    live routing (replay off), paper lr 1.5e-5 (30x the actor's). Same needs as build_qwen35; load the
    backbone from the SFT actor's checkpoint (critic.py departure 1)."""
    require_cluster("build_qwen35_critic")
    critic = MegatronCritic(_qwen35_gpt(preset, moe_enable_routing_replay=False, **parallel)).cuda()
    return _ddp_and_optimizer(critic, critic.gpt.config, lr)


# --- the distributed optimizer on CPU: ZeRO-1 as Megatron shards it (DDP grad buffers, gloo) ----------------
# Megatron's DistributedOptimizer (get_megatron_optimizer(use_distributed_optimizer=True), what build_qwen35 /
# _ddp_and_optimizer use on the cluster) is ZeRO-1 over DDP's contiguous grad buffers: each bucket is cut into dp
# equal shards (DDP pads it to a multiple of lcm(dp, 128)); finalize_model_grads reduce-scatters the grads so the
# rank r of the bucket's data-parallel group holds the summed grads of shard r; the optimizer keeps fp32 state for
# that shard only, updates that shard of the params, and DDP all-gathers the params (start_param_sync). Expert
# buckets shard the same way over the expert-data-parallel group. It cannot run on CPU in megatron-core 0.16.1:
# DistributedOptimizer._build_model_and_main_param_groups accepts only params of type 'torch.cuda.FloatTensor' /
# 'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor' (a CPU param raises TypeError); the grad norm
# (clip_grads.get_grad_norm_fp32) and the mixed-precision optimizer make their buffers with device='cuda'
# (overflow buffer, norm, found_inf, loss scale); its FusedAdam and multi-tensor l2norm / scale come from
# Transformer Engine or apex (without them it falls back to torch's Adam and local loops, but the two CUDA-only
# points above remain). ShardedAdam is the same sharding, step for step, over the same DDP buffers, in plain
# torch (gloo); Adam as torch.optim.Adam, without weight decay. The cluster keeps get_megatron_optimizer.
def wrap_ddp(model):
    """Megatron DistributedDataParallel (use_distributed_optimizer=True, overlap_grad_reduce=False, fp32 grad
    buffers) around a GPTModel, or around the `.gpt` of a MegatronActor / MegatronCritic, which then keeps calling
    its GPTModel directly: DDP's grad hooks sit on the parameters' grad accumulators, so any backward through them
    fills `param.main_grad` (param.grad stays None), and the parameters become views of DDP's param buffer.

    Needs the model built with calculate_per_token_loss=True (ValueError otherwise): DDP then leaves the reduced
    grads summed over the data-parallel ranks instead of dividing them by dp, as the trainer's losses are already
    normalised by the global token count (sum of per-rank losses = the one-rank loss of the global batch)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    gpt = getattr(model, "gpt", model)
    if not gpt.config.calculate_per_token_loss:
        raise ValueError("wrap_ddp: build the model with calculate_per_token_loss=True (build_tiny(hf, "
                         "calculate_per_token_loss=True)); otherwise DDP divides the grads of a globally "
                         "normalised loss by the data-parallel size")
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                        grad_reduce_in_fp32=True)
    with cpu_shims():  # the buffers are allocated on torch.cuda.current_device()
        return DistributedDataParallel(gpt.config, cfg, gpt)


class ShardedAdam:
    """ZeRO-1 Adam over a `wrap_ddp` model, sharded as Megatron's distributed optimizer: this rank owns shard r of
    every DDP bucket (r, dp: its rank and size in the bucket's data-parallel group: dense buckets over DP x CP,
    expert buckets over expert-DP) and keeps exp_avg / exp_avg_sq for that shard only.

        opt.zero_grad()                # DDP grad buffers to 0, before the backward passes of a step
        grad_norm = opt.step(max_norm) # finalize_model_grads, global-norm clip, Adam on the shard, param all-gather

    Grad norm as Megatron's (MegatronOptimizer.get_main_grads_for_grad_norm + get_grad_norm_fp32): the squares of
    this rank's reduced grad shards, counting a parameter only if it is not a TP duplicate (the
    `tensor_model_parallel` attribute, else TP rank 0) and not shared, summed over the intra-distributed-optimizer
    group (all ranks of a DP x TP x PP x CP instance, the group Megatron's dense and expert optimizers share), so
    it equals the one-rank norm of the global batch; clipped as torch's clip_grad_norm_ (max_norm / (norm + 1e-6)
    when below 1). fp32 parameters only (the shard is its own master copy; bf16 params would need an fp32 one).
    Every element of a shard steps each call: a parameter with no gradient this step (e.g. padding, an expert no
    token reached) steps with g = 0 as in Megatron's optimizer and in torch.optim.Adam given a zero grad (which
    SequentialMLP's empty expert matmul produces on one rank), not skipped as torch skips grad None.
    state_dict() / load_state_dict(): this rank's shard (step, hyperparameters, exp_avg / exp_avg_sq per bucket);
    the parameters are checkpointed with the model's own (sharded) state dict."""

    def __init__(self, ddp, lr, betas=(0.9, 0.999), eps=1e-8):
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared
        self.ddp, self.lr, self.betas, self.eps, self.step_count = ddp, lr, tuple(betas), eps, 0
        self.shards = []  # one per bucket: this rank's views of its grads / params and its Adam state
        expert_ids = {id(p) for n, p in ddp.module.named_parameters() if ".local_experts." in n}
        for buf in ddp.buffers + ddp.expert_parallel_buffers:
            if buf.param_dtype != torch.float32 or buf.grad_dtype != torch.float32:
                raise ValueError(f"ShardedAdam: fp32 params and grads only, got {buf.param_dtype} / {buf.grad_dtype}")
            dp, r = buf.data_parallel_group.size(), buf.data_parallel_group.rank()
            for bucket in buf.buckets:
                n = bucket.grad_data.numel() // dp  # DDP pads each bucket to a multiple of dp
                lo, hi = r * n, (r + 1) * n  # this rank's shard, bucket-local
                norm_ranges = []  # shard-local [a, b) of the parameters the grad norm counts
                n_expert = 0  # elements of routed-expert parameters in this shard
                for p in bucket.params_list:
                    start, end, _ = buf.param_index_map[p]  # buffer indices; the bucket starts at bucket.offset
                    a, b = max(start - bucket.offset, lo), min(end - bucket.offset, hi)
                    if a < b and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                        norm_ranges.append((a - lo, b - lo))
                    n_expert += max(b - a, 0) if id(p) in expert_ids else 0
                self.shards.append(dict(grad=bucket.grad_data[lo:hi], param=bucket.param_data[lo:hi],
                                        norm_ranges=norm_ranges, exp_avg=torch.zeros_like(bucket.grad_data[lo:hi]),
                                        exp_avg_sq=torch.zeros_like(bucket.grad_data[lo:hi]), n_expert=n_expert))

    def state_numel(self) -> dict:
        """Elements of each Adam moment this rank holds for routed-expert parameters and for the rest (bucket padding
        counts as dense). Proposition 7.1 (infra.py): the expert part is P_expert / W on each of W ranks, whatever
        the plan."""
        expert = sum(s["n_expert"] for s in self.shards)
        return {"expert": expert, "dense": sum(s["exp_avg"].numel() for s in self.shards) - expert}

    def zero_grad(self):
        self.ddp.zero_grad_buffer()

    @torch.no_grad()
    def grad_norm(self):
        """Global L2 norm of the reduced grads, an fp32 0-dim tensor (call after finalize_model_grads)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        sq = torch.zeros((), dtype=torch.float32)
        for s in self.shards:
            for a, b in s["norm_ranges"]:
                sq += s["grad"][a:b].pow(2).sum()
        dist.all_reduce(sq, group=ps.get_intra_distributed_optimizer_instance_group())  # all shards, all MP ranks
        return sq.sqrt()  # ||g|| = sqrt(sum over ranks of their shards' sum g^2)

    @torch.no_grad()
    def step(self, max_grad_norm=None):
        """finalize_model_grads (reduce-scatter over DP / expert-DP, sequence-parallel grads all-reduced over TP),
        clip by the global norm, Adam on this rank's shards, all-gather the params. -> grad norm before clipping."""
        from megatron.core.distributed import finalize_model_grads
        with cpu_shims():
            finalize_model_grads([self.ddp])
        norm = self.grad_norm()
        if max_grad_norm is not None and max_grad_norm > 0:  # as torch's clip_grad_norm_ (fp32 coefficient)
            clip_coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)  # min(1, max_norm / (||g|| + 1e-6))
            for s in self.shards:
                s["grad"].mul_(clip_coef)
        self.step_count += 1
        beta1, beta2 = self.betas
        bias_correction1 = 1 - beta1 ** self.step_count
        bias_correction2_sqrt = (1 - beta2 ** self.step_count) ** 0.5
        for s in self.shards:  # torch.optim.Adam's single-tensor update, elementwise on the flat shard
            g, m, v = s["grad"], s["exp_avg"], s["exp_avg_sq"]
            m.lerp_(g, 1 - beta1)  # m = b1 m + (1 - b1) g
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)  # v = b2 v + (1 - b2) g^2
            denom = (v.sqrt() / bias_correction2_sqrt).add_(self.eps)  # sqrt(v_hat) + eps
            s["param"].addcdiv_(m, denom, value=-self.lr / bias_correction1)  # p -= lr m_hat / (sqrt(v_hat) + eps)
        with cpu_shims():
            self.ddp.start_param_sync(force_sync=True)  # all-gather every bucket's param shards
        return norm.item()

    def state_dict(self):
        return dict(step=self.step_count, lr=self.lr, betas=self.betas, eps=self.eps,
                    exp_avg=[s["exp_avg"].clone() for s in self.shards],
                    exp_avg_sq=[s["exp_avg_sq"].clone() for s in self.shards])

    def load_state_dict(self, sd):
        shapes = [tuple(s["exp_avg"].shape) for s in self.shards]
        if [tuple(t.shape) for t in sd["exp_avg"]] != shapes:
            raise ValueError(f"ShardedAdam.load_state_dict: shard shapes {[tuple(t.shape) for t in sd['exp_avg']]} "
                             f"!= {shapes} (another parallel layout or model?)")
        self.step_count, self.lr, self.betas, self.eps = sd["step"], sd["lr"], tuple(sd["betas"]), sd["eps"]
        for s, m, v in zip(self.shards, sd["exp_avg"], sd["exp_avg_sq"]):
            s["exp_avg"].copy_(m)
            s["exp_avg_sq"].copy_(v)
