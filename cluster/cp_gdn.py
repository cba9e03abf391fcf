"""Context-parallel Gated DeltaNet (paper section "infrastructure": native context parallelism for the recurrent
operator): the chunked gated delta rule with its sequence split over kappa ranks, the recurrent state passed on.

The sequence is split over kappa ranks on chunk boundaries (`cp_split`, multiples of chunk_size = 64). Each rank first
computes the intra-chunk quantities of its own chunks (`gdn_intra_chunk`: UT transform, intra-chunk attention, the bulk
of the FLOPs, no dependency between ranks), then waits for the state S leaving rank r-1, scans its chunks (`gdn_scan`)
and sends S on to rank r+1; backward runs dS the other way (`cp_chunk_gated_delta_rule`). The per-chunk arithmetic is
transformers' `torch_chunk_gated_delta_rule` op for op, so the forward is bitwise that of one rank; saved activations
per rank scale as 1/kappa. mcore_parallel.context_parallel_gdn runs Megatron-Core's GatedDeltaNet layer on it.

    python -m experiments.bench cp [--kappas 1 2 4 8] [--seq-len 1024]   # exactness and saved bytes per rank vs kappa
    python -m pytest tests/test_infra.py -q -k cp               # bitwise forward, grads, 1/kappa activations

Departures from the paper:
1. State passing over gloo in the tests (CPU, exact): the intra-chunk phase runs on all ranks at once, the scans are
   serial across ranks (the price of bitwise equality: a parallel-prefix combination of per-rank affine state maps
   would reassociate the float sums).
2. The recurrence is this torch kernel on every device (FLA's Triton kernel is not state-passed here).
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _l2norm(x, dim=-1, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)  # as transformers' l2norm (FLA's)


def gdn_intra_chunk(query, key, value, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=False):
    """Phase 1 of the chunked gated delta rule on this rank's tokens: everything that does not need the
    recurrent state. Op-for-op copy of transformers' torch_chunk_gated_delta_rule (first phase).
    Inputs [B, S, H, D] / [B, S, H]; returns the per-chunk tensors the scan reads."""
    _, S, nk, _ = key.shape
    nv = value.shape[-2]
    if nk != nv:  # grouped value attention
        query = query.repeat_interleave(nv // nk, dim=2)
        key = key.repeat_interleave(nv // nk, dim=2)
    query, key, value, beta, decay = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                      for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query, dim=-1, eps=1e-6), _l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - S % chunk_size) % chunk_size  # only the last rank can have a partial chunk
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]  # (B, H, N, C, D)
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(mask, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise  # (B, H, N, C, C)
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    return dict(query=query, key=key, intra=intra, new_values=new_values, k_cumdecay=k_cumdecay,
                chunk_decay=chunk_decay, seq_len=S)


def gdn_scan(ph, state):
    """Phase 2: the sequential scan over this rank's chunks, starting from `state` [B, H, Dk, Dv] (fp32).
    Returns (out [B, S, H, Dv] fp32, final state)."""
    outs = []
    for i in range(ph["new_values"].shape[2]):
        v_new = ph["new_values"][:, :, i] - ph["k_cumdecay"][:, :, i] @ state
        inter = ph["query"][:, :, i] @ state
        outs.append(inter + ph["intra"][:, :, i] @ v_new)
        # S' = S*decay + k^T v_new
        state = state * ph["chunk_decay"][:, :, i] + ph["key"][:, :, i].transpose(-1, -2) @ v_new
    B, H = state.shape[:2]
    out = torch.stack(outs, dim=2).reshape(B, H, -1, state.shape[-1])[:, :, :ph["seq_len"]]
    return out.transpose(1, 2).contiguous(), state


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=None, use_qk_l2norm_in_kernel=False):
    """Single-rank version (kappa = 1) built from the same two phases."""
    ph = gdn_intra_chunk(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel)
    B, H = ph["key"].shape[:2]
    state = (torch.zeros(B, H, ph["key"].shape[-1], ph["new_values"].shape[-1], dtype=torch.float32)
             if initial_state is None else initial_state.to(torch.float32))
    out, state = gdn_scan(ph, state)
    return out.to(q.dtype), state


class _CPGatedDeltaRule(torch.autograd.Function):
    """One rank's share: receive S from rank-1, scan, send S to rank+1; backward passes dS the other way."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunk_size, use_l2norm, group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in (q, k, v, g, beta)]
        with torch.enable_grad():
            ph = gdn_intra_chunk(*leaves, chunk_size, use_l2norm)  # local, overlaps with other ranks
            B, H, Dk, Dv = ph["key"].shape[0], ph["key"].shape[1], ph["key"].shape[-1], ph["new_values"].shape[-1]
            state_in = torch.zeros(B, H, Dk, Dv, dtype=torch.float32)
            if rank > 0:
                dist.recv(state_in, src=dist.get_global_rank(group, rank - 1) if group else rank - 1, group=group)
                state_in.requires_grad_(True)
            out, state_out = gdn_scan(ph, state_in)
        if rank < world - 1:
            dist.send(state_out.detach().contiguous(), dst=dist.get_global_rank(group, rank + 1) if group else rank + 1,
                      group=group)
        ctx.graph = (leaves, state_in, out, state_out)
        ctx.rank, ctx.world, ctx.group = rank, world, group
        return out.detach().to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        leaves, state_in, out, state_out = ctx.graph
        rank, world, group = ctx.rank, ctx.world, ctx.group
        d_state = torch.zeros_like(state_out)
        if rank < world - 1:  # dS leaving this rank comes back from rank+1
            dist.recv(d_state, src=dist.get_global_rank(group, rank + 1) if group else rank + 1, group=group)
        inputs = [x for x in leaves if x.requires_grad] + ([state_in] if rank > 0 else [])
        grads = torch.autograd.grad([out, state_out], inputs, [dout.to(out.dtype), d_state], allow_unused=True)
        grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(inputs, grads)]
        if rank > 0:
            dist.send(grads[-1].contiguous(), dst=dist.get_global_rank(group, rank - 1) if group else rank - 1,
                      group=group)
        it = iter(grads)
        ctx.graph = None
        return tuple(next(it) if x.requires_grad else None for x in leaves) + (None, None, None)


def cp_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=False, group=None):
    """Context-parallel gated delta rule: q, k, v, g, beta are this rank's slice of the sequence (see
    `cp_split`); returns this rank's output slice [B, S_r, H, Dv]. Differentiable."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    assert rank == world - 1 or q.shape[1] % chunk_size == 0, "CP slices end on chunk boundaries (cp_split)"
    return _CPGatedDeltaRule.apply(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel, group)


def cp_split(seq_len: int, kappa: int, chunk_size: int = 64) -> list:
    """Token boundaries [(start, end)] per rank, on chunk boundaries, chunks spread as evenly as possible."""
    n = math.ceil(seq_len / chunk_size)
    assert n >= kappa, f"{n} chunks cannot be spread over {kappa} ranks"
    counts = [n // kappa + (r < n % kappa) for r in range(kappa)]
    bounds, s = [], 0
    for cnt in counts:
        bounds.append((s, min(seq_len, s + cnt * chunk_size)))
        s += cnt * chunk_size
    return bounds


def gdn_inputs(B=1, S=256, nk=2, nv=4, dk=16, dv=16, seed=0, dtype=torch.float32):
    """Random GDN inputs shaped as Qwen3.5 feeds them (g = -softplus-ish decay, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    q, k, v = r(B, S, nk, dk), r(B, S, nk, dk), r(B, S, nv, dv)
    g = -F.softplus(r(B, S, nv)) * 0.5
    beta = torch.sigmoid(r(B, S, nv))
    dout = r(B, S, nv, dv)
    return (q, k, v, g, beta), dout


def saved_bytes(fn):
    """Run fn() and return (result, bytes of distinct storages saved for backward)."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def cp_rank_share(rank, kappa, shape, chunk_size):
    (q, k, v, g, beta), dout = gdn_inputs(**shape)
    s, e = cp_split(q.shape[1], kappa, chunk_size)[rank]
    local = [x[:, s:e].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    out, nbytes = saved_bytes(lambda: cp_chunk_gated_delta_rule(*local, chunk_size=chunk_size,
                                                                use_qk_l2norm_in_kernel=True))
    out.backward(dout[:, s:e])
    return out.detach().numpy().copy(), [x.grad.numpy().copy() for x in local], nbytes


def reference_gdn(shape: dict, chunk_size: int = 64):
    """Single-rank reference: transformers' torch_chunk_gated_delta_rule (Qwen3.5's torch fallback)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import torch_chunk_gated_delta_rule
    (q, k, v, g, beta), dout = gdn_inputs(**shape)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    out, nbytes = saved_bytes(lambda: torch_chunk_gated_delta_rule(*xs, chunk_size=chunk_size,
                                                                   use_qk_l2norm_in_kernel=True)[0])
    out.backward(dout)
    return out.detach(), [x.grad for x in xs], nbytes
