"""The parallelism this repo adds around Megatron-Core (paper: infrastructure: native context parallelism for the
recurrent operator, the distributed optimizer), for cluster/mcore.py's models and training-step interface.

- Context parallel: `context_parallel_gdn`: Megatron's own GatedDeltaNet layer with its sequence split over a
  context-parallel group, which megatron-core 0.16.1 refuses: a conv1d halo exchange plus cluster/cp_gdn.py's chunked
  gated delta rule (state passing). `mcore._gpt_forward` runs the whole model that way when parallel_state has CP > 1
  (`cp_rank_size_group`): contiguous chunks with the rotary table of their global positions (`cp_rope`), K / V
  all-gathered for gated attention (`cp_dot_product_attention`), outputs gathered over CP (`cp_full`) (departure 2).
- Pipeline parallel: `PipeSend` / `PipeRecv` / `pipe_result`, a forward over the stages as one autograd graph
  (departure 1).
- The distributed optimizer on CPU: `wrap_ddp` (Megatron's DDP) + `ShardedAdam` (ZeRO-1 as Megatron shards it,
  departure 3).

    python -m pytest tests/test_cp_megatron.py -q  # CPU: one Megatron GDN layer over kappa = 2, 4 gloo ranks
    python -m pytest tests/test_mcore_parallel.py -q  # CPU: MegatronActor logprobs / R3 at TP, EP, PP, CP = 2
    python -m pytest tests/test_mcore_optim.py -s  # CPU: ShardedAdam at DP / EP / TP = 2 vs one-rank torch Adam
    python -m pytest tests/test_trainer_group.py -q   # CPU: the trainer over 2 Ray ranks (--plan) vs one rank

Departures from the paper:
1. Pipeline parallel without Megatron's schedules: a forward over the PP stages is one autograd graph across processes
   (GPipe with one microbatch per call: one rank's arithmetic, no 1F1B overlap, a bubble of (PP - 1) / PP), since
   Megatron's forward_backward_func would need the loss inside the schedule at every call site of train_t1.
2. Context parallel without Megatron's CP attention (0.16.1 asserts context_parallel_size = 1 for GDN): rank r takes
   the contiguous chunk [r S, (r + 1) S), not the zig-zag (GDN state passes rank 0 -> cp - 1), and attention
   all-gathers K / V instead of TE's ring attention ("context parallel" section below). Not written: CP with PP.
3. On CPU (gloo) the distributed optimizer is ours, `ShardedAdam` (Megatron's ZeRO-1 sharding of the DDP buckets),
   because Megatron's refuses CPU parameters; fp32 or bf16 parameters (bf16: an fp32 master copy of this rank's
   shard, as Megatron's keeps), no weight decay, no loss scaling (bf16 needs none). On CUDA the trainer uses
   Megatron's own (`MegatronAdam`, the same interface).
"""

import contextlib

import torch

from cluster import cp_gdn
from cluster.mcore_cpu import cpu_shims

# --- the critic's value head (cluster/mcore.py's MegatronCritic; replicated over TP, gathers under SP) -------------
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


# --- context parallel: contiguous sequence chunks over parallel_state's CP group (departure 2) -----------------
# Context parallel without Megatron's CP attention: TransformerConfig.context_parallel_size stays 1 (0.16.1 asserts
# it for GDN; its local DotProductAttention asserts it too) while parallel_state holds cp > 1 (DDP reduces grads
# over its DP x CP group, the expert-DP group spans the CP ranks). `mcore._gpt_forward` gives CP rank r the
# contiguous chunk [r S, (r + 1) S) of the right-padded sequence (Tp a multiple of cp * tp under sequence parallel,
# and with GDN of cp * 64, the kernel's chunk: the same chunking as one rank), not Megatron's load-balanced zig-zag
# (chunks r and 2cp - 1 - r), because the GDN state passing runs rank 0 -> cp - 1 in sequence order: causal
# attention work is therefore unbalanced over the CP ranks (the last does most). Per call: the rotary table of the
# chunk's global positions (`cp_rope`: RotaryEmbedding.get_emb with offset r S, instead of its forward, which
# ignores position ids and cuts the zig-zag share), GDN layers state-passed (`context_parallel_gdn`: hooks on the
# unchanged GatedDeltaNet.forward's conv1d, its module-level kernel swapped inside the block; the recurrence is
# cluster/cp_gdn.py's torch kernel, also on GPU, FLA's is not state-passed here), gated attention through
# `cp_dot_product_attention` (Megatron's DotProductAttention of the local queries against K / V all-gathered over
# CP, the mask's rows of this chunk against all Tp keys; backward sums K / V grads to their owners) where
# Megatron's TE attention runs ring attention (overlapped K / V exchange, O(S) memory per rank instead of the
# all-gather's O(Tp)). Outputs are gathered over CP (`_CPGather`, backward: this rank's slice only, as
# `_PipeBroadcast`): token_logprobs (targets shifted globally), logits, critic values and the R3 recording (rows of
# contiguous chunks), replay sliced with `r3.slice_for_megatron(cp_contiguous=True)`; MoE routing and experts are
# token-local. Not written: CP with PP.
def cp_rank_size_group():
    """(rank, size, group) of parallel_state's context-parallel group; (0, 1, None) without CP. The models'
    TransformerConfig keeps context_parallel_size = 1 (0.16.1 asserts it for GDN): parallel_state holds the CP."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized() or ps.get_context_parallel_world_size() == 1:
        return 0, 1, None
    return ps.get_context_parallel_rank(), ps.get_context_parallel_world_size(), ps.get_context_parallel_group()


@contextlib.contextmanager
def cp_rope(gpt, offset):
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


def cp_full(x, T):
    """(B, S, *) of this CP rank's chunk -> (B, T, *) on every CP rank (_CPGather, grad counted once); x as is
    without CP (mcore._gpt_forward already cut it to T)."""
    _, cp, group = cp_rank_size_group()
    return x if cp == 1 else _CPGather.apply(x, 1, group, False)[:, :T]


_CP_ATTENTION = []  # the class, built once on first use (megatron is imported lazily)


def cp_dot_product_attention():
    """The CP core attention class (a DotProductAttention subclass; defined here so this module imports without
    megatron). mcore's local specs plug it in as core_attention when parallel_state has CP > 1."""
    if _CP_ATTENTION:
        return _CP_ATTENTION[0]
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class CPDotProductAttention(DotProductAttention):
        """Megatron's local DotProductAttention (its scale 1/sqrt(d), fp32 softmax of the masked scores, GQA by
        repeat_interleave) of this CP rank's queries [S, B, np, d] against the keys / values of all CP ranks,
        all-gathered along the sequence (contiguous chunks in rank order: [Tp, B, ng, d]); the mask mcore._gpt_forward
        passes is this chunk's rows (B, 1, S, Tp), causal by global position and over padded keys. The gather's
        backward sums K / V grads over the ranks and returns each its own. Used only with parallel_state's CP > 1
        (the config keeps CP = 1, which the parent asserts); Megatron's TE attention runs ring attention instead."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            _, cp, group = cp_rank_size_group()
            if cp > 1:
                key, value = _CPGather.apply(key, 0, group, True), _CPGather.apply(value, 0, group, True)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    _CP_ATTENTION.append(CPDotProductAttention)
    return CPDotProductAttention


# --- context-parallel Gated DeltaNet: Megatron's layer, cluster/cp_gdn.py's CP recurrence ---------------------------
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
    hidden_states [S_r, B, H] with the slices cut by cp_gdn.cp_split (chunk boundaries). Outputs and input
    gradients are this rank's slices; parameter gradients are partial sums (Megatron's DDP reduces them over
    DP x CP). How (departure 2):
      1. conv1d: a forward pre-hook prepends the K-1 halo columns (_ConvHalo), a forward hook drops the K-1
         extra leading outputs, so the forward's own `[..., :seq_len]` slice is exact.
      2. recurrence: the module-level `chunk_gated_delta_rule` / `torch_chunk_gated_delta_rule` the forward
         calls -> cp_gdn.cp_chunk_gated_delta_rule (state S rank r -> r+1, dS back), swapped for the block only;
         `causal_conv1d_fn` -> None for the block so the (hooked) nn.Conv1d path runs on GPU too.
      3. TransformerConfig keeps context_parallel_size = 1 (it asserts that for GDN); the CP group is passed here.
    """
    from megatron.core.ssm import gated_delta_net as gdn
    layers = [m for m in model.modules() if isinstance(m, gdn.GatedDeltaNet)]
    group = group if group is not None else layers[0].pg_collection.cp

    def recurrence(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   **unused):  # as GatedDeltaNet.forward calls either kernel
        assert initial_state is None and not output_final_state  # training forward: the sequence starts on rank 0
        return cp_gdn.cp_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel, group), None

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


# --- pipeline parallel: one forward through the stages as one autograd graph over the PP group -------------
# Megatron's schedules (1F1B over microbatches) drive a training step from the outside; the training step here is
# train_t1's, unchanged, so a forward over PP stages is written as autograd functions instead: stage s receives
# the hidden states of stage s - 1 (PipeRecv, whose backward sends their grad back), runs its layers and sends
# its output to stage s + 1 (PipeSend, whose backward receives that grad); the last stage's result (logprobs,
# values, logits) is broadcast to every stage (_PipeBroadcast) so each rank returns the same tensor and computes
# the same loss; backward counts the last stage's copy only. One microbatch at a time: GPipe without the overlap
# (departure 1). gpt.pipe_link carries the send's autograd link (a 0-d tensor) from the stage's forward to
# the broadcast, which on a non-last stage takes it as its input so the backward of the loss reaches the send.
def _device():
    """Where this rank's model lives: the current GPU (nccl) on a CUDA node, else the CPU (gloo)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class PipeSend(torch.autograd.Function):
    """This stage's output hidden states -> the next stage (p2p); returns a 0-d link whose backward receives their
    grad from there (mcore._gpt_forward keeps it in gpt.pipe_link for pipe_result)."""

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
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=_device())
        dist.recv(grad, ps.get_pipeline_model_parallel_next_rank())
        return grad


class PipeRecv(torch.autograd.Function):
    """The previous stage's hidden states of `shape` (p2p; `link`, a 0-d tensor, only puts the recv on the autograd
    graph); backward sends their grad back to that stage."""

    @staticmethod
    def forward(ctx, link, shape, dtype):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        hidden = torch.empty(shape, dtype=dtype, device=_device())
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
        out = x.detach().clone() if ctx.last else torch.empty(shape, dtype=dtype, device=_device())
        dist.broadcast(out, ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
        return out

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.last else torch.zeros((), device=grad.device)), None, None


def pipe_result(gpt, out, shape, dtype=torch.float32):
    """`out` of the last stage (None elsewhere) -> the same tensor on every stage of the pipeline."""
    if gpt.config.pipeline_model_parallel_size == 1:
        return out
    return _PipeBroadcast.apply(out if gpt.post_process else gpt.pipe_link, shape, dtype)


def stage_layers(cfg) -> tuple:
    """(first, last + 1) global decoder layers of this pipeline stage (all of them without PP)."""
    if cfg.pipeline_model_parallel_size == 1:
        return 0, cfg.num_layers
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    rank = ps.get_pipeline_model_parallel_rank()
    first = get_transformer_layer_offset(cfg, pp_rank=rank)
    return first, first + get_num_layers_to_build(cfg, pp_rank=rank)


# --- the distributed optimizer on CPU: ZeRO-1 as Megatron shards it (DDP grad buffers, gloo) ----------------
# Megatron's DistributedOptimizer (get_megatron_optimizer(use_distributed_optimizer=True), what MegatronAdam below
# steps on CUDA) is ZeRO-1 over DDP's contiguous grad buffers: each bucket is cut into dp
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
    bf16 parameters (the cluster's precision, Megatron's mixed-precision recipe): this rank's shard of each bf16 bucket
    has an fp32 master copy; Adam steps the master and the bf16 parameter is its rounding (grads are fp32: wrap_ddp
    reduces in fp32), so updates smaller than a bf16 ulp accumulate instead of vanishing.
    state_dict() / load_state_dict(): this rank's shard (step, hyperparameters, exp_avg / exp_avg_sq per bucket, and
    the fp32 masters of bf16 buckets); the parameters are checkpointed with the model's own (sharded) state dict."""

    def __init__(self, ddp, lr, betas=(0.9, 0.999), eps=1e-8):
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared
        self.ddp, self.lr, self.betas, self.eps, self.step_count = ddp, lr, tuple(betas), eps, 0
        self.shards = []  # one per bucket: this rank's views of its grads / params and its Adam state
        expert_ids = {id(p) for n, p in ddp.module.named_parameters() if ".local_experts." in n}
        for buf in ddp.buffers + ddp.expert_parallel_buffers:
            if buf.param_dtype not in (torch.float32, torch.bfloat16) or buf.grad_dtype != torch.float32:
                raise ValueError(f"ShardedAdam: fp32 or bf16 params with fp32 grads, got {buf.param_dtype} / "
                                 f"{buf.grad_dtype}")
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
                param = bucket.param_data[lo:hi]
                master = None if param.dtype == torch.float32 else param.detach().float()  # fp32 copy of the shard
                self.shards.append(dict(grad=bucket.grad_data[lo:hi], param=param, master=master,
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
            p = s["param"] if s["master"] is None else s["master"]
            p.addcdiv_(m, denom, value=-self.lr / bias_correction1)  # p -= lr m_hat / (sqrt(v_hat) + eps)
            if s["master"] is not None:
                s["param"].copy_(p)  # the bf16 parameter: its master rounded
        with cpu_shims():
            self.ddp.start_param_sync(force_sync=True)  # all-gather every bucket's param shards
        return norm.item()

    def state_dict(self):
        return dict(step=self.step_count, lr=self.lr, betas=self.betas, eps=self.eps,
                    exp_avg=[s["exp_avg"].clone() for s in self.shards],
                    exp_avg_sq=[s["exp_avg_sq"].clone() for s in self.shards],
                    master=[None if s["master"] is None else s["master"].clone() for s in self.shards])

    def set_lr(self, lr):
        self.lr = lr

    def load_state_dict(self, sd):
        shapes = [tuple(s["exp_avg"].shape) for s in self.shards]
        if [tuple(t.shape) for t in sd["exp_avg"]] != shapes:
            raise ValueError(f"ShardedAdam.load_state_dict: shard shapes {[tuple(t.shape) for t in sd['exp_avg']]} "
                             f"!= {shapes} (another parallel layout or model?)")
        self.step_count, self.lr, self.betas, self.eps = sd["step"], sd["lr"], tuple(sd["betas"]), sd["eps"]
        masters = sd.get("master", [None] * len(self.shards))
        if [m is None for m in masters] != [s["master"] is None for s in self.shards]:
            raise ValueError("ShardedAdam.load_state_dict: the checkpoint's fp32 masters do not match this model's "
                             "bf16 buckets (saved with another --param-dtype?)")
        for s, m, v, w in zip(self.shards, sd["exp_avg"], sd["exp_avg_sq"], masters):
            s["exp_avg"].copy_(m)
            s["exp_avg_sq"].copy_(v)
            if w is not None:  # the fp32 master, exact; the bf16 parameter is its rounding (the model's own
                s["master"].copy_(w)  # checkpoint may differ: HF keeps some weights offset, e.g. norms as 1 + w)
                s["param"].copy_(w)
        if any(m is not None for m in masters):
            with cpu_shims():  # every rank's shard of the rounded masters into every replica (a collective)
                self.ddp.start_param_sync(force_sync=True)


class MegatronAdam:
    """Megatron's own distributed optimizer (get_megatron_optimizer with use_distributed_optimizer=True: ZeRO-1 over
    the same DDP buckets, fp32 master shards of bf16 parameters, dense and expert optimizers chained) behind
    ShardedAdam's interface: what the trainer steps on CUDA. Adam without weight decay at a constant lr; the grad norm
    and its clip are Megatron's (the same formula as ShardedAdam's). state_dict(): Megatron's non-parameter state plus,
    per parameter this rank holds a range of, its fp32 master shard and Adam moments (this rank's file, resumable on
    the same plan, as ShardedAdam's). Megatron's refuses CPU parameters (see above); tests/test_mcore_optim.py runs it
    on CPU under a test-only shim that maps its CUDA buffers to the CPU, against ShardedAdam."""

    def __init__(self, ddp, lr, betas=(0.9, 0.999), eps=1e-8):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        c = ddp.module.config
        self.ddp, self.lr = ddp, lr
        self.opt = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=lr, min_lr=lr, weight_decay=0.0, adam_beta1=betas[0], adam_beta2=betas[1],
            adam_eps=eps, bf16=c.bf16, params_dtype=c.params_dtype, use_distributed_optimizer=True, clip_grad=0.0),
            [ddp])
        self.parts = getattr(self.opt, "chained_optimizers", [self.opt])  # dense, then expert
        self.params = dict(ddp.module.named_parameters())

    def zero_grad(self):
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, max_grad_norm=None):
        """finalize_model_grads, Megatron's step (norm, clip, Adam on the shards, param all-gather) -> the grad norm."""
        from megatron.core.distributed import finalize_model_grads
        finalize_model_grads([self.ddp])
        for part in self.parts:
            part.config.clip_grad = float(max_grad_norm or 0.0)
        ok, norm, _ = self.opt.step()
        if not ok:
            raise RuntimeError("MegatronAdam: Megatron's optimizer skipped the step (inf / nan in the grads)")
        return float(norm)

    def _shards(self):
        """(part index, name) -> {"param": fp32 master shard, "exp_avg", "exp_avg_sq"} of this rank (live tensors)."""
        return {(i, n): part._get_main_param_and_optimizer_states(self.params[n])
                for i, part in enumerate(self.parts) for n in self.params
                if self.params[n] in getattr(part, "model_param_group_index_map", {})}

    def state_numel(self) -> dict:
        """Adam elements per moment this rank holds: {"expert", "dense"} (ShardedAdam's, without bucket padding)."""
        out = {"dense": 0, "expert": 0}
        for (_, n), t in self._shards().items():
            out["expert" if ".local_experts." in n or ".experts.linear_fc" in n else "dense"] += t["param"].numel()
        return out

    def state_dict(self):
        return {"megatron": self.opt.state_dict(), "lr": self.lr,
                "shards": {k: {s: v.detach().clone() for s, v in t.items() if torch.is_tensor(v)}
                           for k, t in self._shards().items()}}

    def set_lr(self, lr):
        self.lr = lr
        for part in self.parts:  # no OptimizerParamScheduler here: the param groups' lr is the lr Adam steps at
            for group in part.optimizer.param_groups:
                group["lr"] = lr

    @torch.no_grad()
    def load_state_dict(self, sd):
        self.opt.load_state_dict(sd["megatron"])  # allocates the moments (Megatron's init_state_fn)
        for part in self.parts:  # that load gives every parameter the same `step` tensor (torch's Adam then counts
            for st in part.optimizer.state.values():  # it once per parameter): one each, as a fresh run has
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()
        live = self._shards()
        if live.keys() != sd["shards"].keys():
            raise ValueError("MegatronAdam.load_state_dict: the checkpoint's shards are not this rank's (another "
                             "parallel layout or model?)")
        for k, t in live.items():
            for s, v in t.items():
                if torch.is_tensor(v) and v.shape != sd["shards"][k][s].shape:
                    raise ValueError(f"MegatronAdam.load_state_dict: {k[1]} {s} has shape {tuple(v.shape)} here, "
                                     f"{tuple(sd['shards'][k][s].shape)} in the checkpoint")
            self.parts[k[0]]._set_main_param_and_optimizer_states(self.params[k[1]], sd["shards"][k])  # its owner
        for part in self.parts:  # the model's bf16 params from the restored masters
            if hasattr(part, "_copy_main_params_to_model_params"):
                part._copy_main_params_to_model_params()
        self.ddp.start_param_sync(force_sync=True)