"""R3: rollout routing replay for the MoE actor (paper section "R3").

The sampler records R[j, l, :], the top-k expert ids chosen at every MoE layer l for every position j (1.5 KiB per
position at 48 layers x top-8 int32); every trainer forward replays them: position j goes through exactly the experts
that produced the sampled token, with gate weights from the *live* router logits renormalised over the recorded k ids,
so the router keeps its gradient. A missing capture aborts the step (never silently dropped); placeholder rows are
allowed only where m[j+1] = 0 (`check_capture`, which also says what aborts).

    w[j, l, :] = softmax(router_l(h_j))[R[j, l, :]] / sum_k softmax(router_l(h_j))[R[j, l, k]]

Use (`python -m experiments.bench r3 --quick` measures |delta log p| engine vs trainer with replay off / on):

    r3.install(model)                                    # once, after building/loading the model
    with r3.routing(model, "record") as rec:             # sampler / engine side
        model(ids)
    experts = rec.experts                                # (B, T, L, k) int32
    with r3.routing(model, "replay", experts):           # trainer side, every forward
        loss = f(model(ids).logits); loss.backward()     # backward (and recompute) inside

On an mcore.MegatronActor the same call drives the model's native RouterReplay (`megatron_routing`, experts sliced by
`slice_for_megatron`). `mismatch` is the per-step figure; SGLang's wire format is `encode_routed_experts` /
`decode_routed_experts`.

Departures from the paper:
1. The embedded trainer is HF's Qwen3_5MoeForCausalLM: its router `layer.mlp.gate` is swapped for `R3Router` (same
   Parameter, same state-dict key); a pre-hook on the MoE block gives the router the batch's (B, T). R3Router is a
   plain torch Module, not a subclass of HF's router: importing that class loads all of transformers' Qwen3.5
   modeling into every process that imports r3 (the rollout workers and the engine of a Qwen3-MoE run too).
2. A replay row of all -1 (placeholder or padding) falls back to live top-k; the replay does not know the loss mask:
   rollout.to_samples calls `check_capture` on every sample. `routing` refuses malformed tensors.
3. Backward (and activation recompute) must run inside the `routing(..., "replay")` context; record mode is
   forward-only (a recompute inside it would append a second copy of the rows).
4. One routing context per model at a time (nesting raises): the mode is an explicit argument held by the routers
   only while the context is open, never a global or an environment variable.
5. Megatron replay wraps each RouterReplay's `get_replay_topk`: all -1 rows fall back to live top-k as in the HF path,
   and a slice whose row count differs from the router's tokens raises (the native gather would route the first rows).
6. The embedded mismatch comes from bf16-rounded engine weights vs fp32 trainer weights (engine/weights.py departure 1)
   on a random-init tiny model: the figures are this setup's, not comparable with the paper's 0.021 -> 0.013.
"""

import base64
import contextlib

import numpy as np
import torch
import torch.nn.functional as F

MODES = ("off", "record", "replay")


class R3Router(torch.nn.Module):
    """Top-k softmax router that can record its choices or replay recorded ones.

    forward(hidden (N, H)) -> (router_logits (N, E), weights (N, k), indices (N, k)), like HF.
    """

    def __init__(self, router: torch.nn.Module, layer_idx: int):
        super().__init__()
        self.top_k = router.top_k
        self.num_experts = router.num_experts
        self.hidden_dim = router.hidden_dim
        self.weight = router.weight  # the SAME Parameter: optimizer state and state-dict key unchanged
        self.layer_idx = layer_idx
        self.batch_shape = None  # (B, T) of the current forward, set by the MoE block pre-hook
        self.mode = "off"
        self.sink = None  # record: list that receives (B, T, k) int32 per forward
        self.into = None  # record into a preallocated (N_max, L, k) int32 buffer instead (the engine's capture)
        self.replay = None  # replay: (B, T, k) int64 recorded ids for this layer

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # (N, H), N = B * T
        router_logits = F.linear(hidden_states, self.weight)  # (N, E)
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)  # (N, E)
        _, live_idx = torch.topk(router_probs, self.top_k, dim=-1)  # (N, k)
        idx = live_idx
        if self.mode == "replay":
            recorded = self.replay.reshape(-1, self.top_k)  # (N, k)
            if recorded.shape[0] != hidden_states.shape[0]:
                raise ValueError(
                    f"R3 replay: layer {self.layer_idx} got {hidden_states.shape[0]} token rows "
                    f"(batch_shape {self.batch_shape}) but experts hold {recorded.shape[0]}")
            placeholder = (recorded < 0).all(dim=-1, keepdim=True)  # (N, 1): -1 rows -> live top-k
            idx = torch.where(placeholder, live_idx, recorded.to(live_idx.device))
        # w = softmax(live logits) at the chosen ids, renormalised over k (gradient reaches every id)
        top_value = router_probs.gather(1, idx)  # (N, k)
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        if self.mode == "record" and self.into is not None:  # one copy per layer per forward, no allocation
            self.into[:live_idx.shape[0], self.layer_idx].copy_(live_idx)
        elif self.mode == "record":
            B, T = self.batch_shape
            self.sink.append(live_idx.reshape(B, T, self.top_k).to(torch.int32).cpu())
        return router_logits, top_value.to(router_logits.dtype), idx

    def live_route(self, hidden_states):
        """The engine's routing: hidden (N, H) -> (weights (N, k), ids (N, k)) of the live top-k, off or recorded into
        the engine's buffer (routing(..., "record", into=...)). Fewer operations than forward: top-k of the logits
        (softmax is monotonic), weights as the softmax over the k logits (forward's renormalised probabilities; equal
        to ~1e-7)."""
        if self.mode == "replay" or (self.mode == "record" and self.into is None):
            raise ValueError(f"R3 live_route: layer {self.layer_idx} is in {self.mode} mode without a buffer "
                             "(live_route records only into routing(..., into=...))")
        top, idx = torch.topk(F.linear(hidden_states, self.weight), self.top_k, dim=-1)  # (N, k) of the logits
        if self.mode == "record":
            self.into[:idx.shape[0], self.layer_idx].copy_(idx)
        return top.softmax(-1), idx


def _moe_blocks(model):
    """[(layer_idx, moe_block)] of every decoder layer that has a routed MoE mlp."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    return [(i, layer.mlp) for i, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "gate")]


def _remember_batch_shape(block, args):
    block.gate.batch_shape = tuple(args[0].shape[:2])  # hidden (B, T, H)


def routers(model) -> list:
    """The installed R3Routers, in layer order (index in this list = l in R[j, l, :])."""
    rs = [block.gate for _, block in _moe_blocks(model)]
    if not rs or not all(isinstance(r, R3Router) for r in rs):
        raise ValueError("model: R3 routers are not installed (call r3.install(model) first)")
    return rs


def install(model):
    """Swap every MoE router `layer.mlp.gate` for an R3Router holding the same weight and set model.backend = "hf"
    (the trainer's backend attribute; mcore.MegatronActor's is "megatron"). Idempotent."""
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError("model: no MoE layers with `mlp.gate` found")
    for l, (_, block) in enumerate(blocks):
        if isinstance(block.gate, R3Router):
            continue
        block.gate = R3Router(block.gate, layer_idx=l)
        block.register_forward_pre_hook(_remember_batch_shape)
    model.backend = "hf"
    return model


class Routing:
    """What `routing()` yields. record: `forwards` (list of (B, T_i, L, k) int32: a KV-cached engine runs a prefill
    and then one forward per decode step), `experts`; `pop()` returns the forwards and clears them."""

    def __init__(self, mode, num_layers, top_k):
        self.mode, self.num_layers, self.top_k = mode, num_layers, top_k
        self.sinks = [[] for _ in range(num_layers)]  # per layer: one (B, T_i, k) per forward
        self.forwards = []

    def _collect(self):
        n = {len(s) for s in self.sinks}
        if len(n) != 1:
            raise RuntimeError(f"R3 record: layers saw different forward counts {sorted(n)}")
        for step in zip(*self.sinks):
            self.forwards.append(torch.stack(step, dim=2))  # (B, T_i, L, k)
        for s in self.sinks:
            s.clear()

    def pop(self) -> list:
        """Return the per-forward routing recorded so far and forget it."""
        self._collect()
        out, self.forwards = self.forwards, []
        return out

    @property
    def experts(self) -> torch.Tensor:
        """(B, sum T_i, L, k) int32: all forwards in this context concatenated along time."""
        self._collect()
        if not self.forwards:
            raise RuntimeError("R3 record: no forward ran inside the routing context")
        return torch.cat(self.forwards, dim=1)


def _check_replay_experts(experts, num_layers, top_k, num_experts):
    if not isinstance(experts, torch.Tensor):
        experts = torch.as_tensor(np.asarray(experts))
    if experts.ndim != 4 or tuple(experts.shape[2:]) != (num_layers, top_k):
        raise ValueError(f"experts: expected shape (B, T, {num_layers}, {top_k}) = (B, T, L, k), "
                         f"got {tuple(experts.shape)}")
    if experts.dtype.is_floating_point or experts.dtype == torch.bool:
        raise ValueError(f"experts: expected an integer tensor, got {experts.dtype}")
    experts = experts.long()
    bad = (experts < -1) | (experts >= num_experts)
    if bad.any():
        raise ValueError(f"experts: ids must be in [0, {num_experts}) or -1, got {experts[bad][0].item()}")
    neg = experts < 0
    if (neg.any(-1) & ~neg.all(-1)).any():
        raise ValueError("experts: a row mixes -1 and expert ids (placeholders must be whole rows)")
    return experts


@contextlib.contextmanager
def routing(model, mode: str, experts=None, into=None):
    """Route every MoE layer of `model` in `mode` ("off" | "record" | "replay") inside the block.

    replay needs `experts` (B, T, L, k) int (ids or -1); each forward inside must have batch (B, T).
    record with `into` (a preallocated (N_max, L, k) int32 tensor, N_max >= B * T): each forward writes its ids to
    into[:B * T] (row b * T + t), overwriting the previous forward's; the yielded Routing then collects nothing.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if model.backend == "megatron":  # mcore.MegatronActor: native RouterReplay (HF: "hf", set by install)
        with model.routing(mode, experts) as ctx:
            yield ctx
        return
    rs = routers(model)
    if any(r.mode != "off" for r in rs):
        raise RuntimeError("routing: another R3 routing context is already open on this model")
    L, k = len(rs), rs[0].top_k
    ctx = Routing(mode, L, k)
    if mode == "replay":
        if experts is None:
            raise ValueError("experts: replay mode needs the recorded experts (B, T, L, k)")
        experts = _check_replay_experts(experts, L, k, rs[0].num_experts)
    elif experts is not None:
        raise ValueError(f"experts: only replay mode takes experts, mode is {mode!r}")
    if into is not None and (mode != "record" or into.dtype != torch.int32 or into.ndim != 3
                             or tuple(into.shape[1:]) != (L, k)):
        raise ValueError(f"into: expected a (N_max, {L}, {k}) int32 tensor in record mode, got "
                         f"{tuple(into.shape)} {into.dtype} in mode {mode!r}")
    for l, r in enumerate(rs):
        r.mode = mode
        r.sink = ctx.sinks[l] if mode == "record" else None
        r.into = into
        r.replay = experts[:, :, l, :] if mode == "replay" else None  # (B, T, k)
    try:
        yield ctx
    finally:
        for r in rs:
            r.mode, r.sink, r.replay, r.into = "off", None, None, None
    if mode == "record":  # only on a clean exit, so an error inside is never masked
        ctx._collect()


def check_capture(experts, loss_mask) -> int:
    """Refuse a sample whose routing capture cannot be replayed (paper: missing capture aborts); -> placeholder rows.

    experts: (T, L, k) or (T-1, L, k) int (tito's layout: the last token is never forwarded, its row is omitted),
    or None when the sampler returned no capture; loss_mask: (T,) 0/1. Row j routes the forward that predicts
    token j+1, so a placeholder row (-1 at any layer) is allowed only where m[j+1] = 0; the last row (j = T-1)
    predicts nothing and may be a placeholder. Returns the number of placeholder rows (the per-step figure
    r3_placeholder_frac = placeholder rows / rows; paper: 0.003%).

    What aborts, with replay on (train_t1 --r3-mode replay): a turn's capture missing (an SGLang server started
    without --enable-return-routed-experts returns no routed_experts; the embedded engine captures whenever the
    request sets return_routed_experts, as engine.client.EngineClient does) -> tito.CaptureError naming the trial, the
    turn and the flag; a placeholder row where m[j+1] = 1 -> ValueError here; a sample or batch without routing reaching
    the trainer -> ValueError (ppo.pad_batch / batch_routing). None is dropped or trained with live routing.
    With replay off, routing is optional (only the expert_set_mismatch figure uses it).
    """
    if experts is None:
        raise ValueError("experts: routing capture is missing (R3 never silently drops it; SGLang returns it only "
                         "when started with --enable-return-routed-experts)")
    experts = torch.as_tensor(np.asarray(experts))
    mask = torch.as_tensor(np.asarray(loss_mask))
    T = mask.shape[0]
    if experts.ndim != 3 or experts.shape[0] not in (T, T - 1):
        raise ValueError(f"experts: expected (T, L, k) or (T-1, L, k) with T = len(loss_mask) = {T}, "
                         f"got {tuple(experts.shape)}")
    placeholder = (experts < 0).all(dim=-1).any(dim=-1)  # (T or T-1,) any layer missing for row j
    n = min(placeholder.shape[0], T - 1)
    bad = placeholder[:n] & (mask[1:n + 1] != 0)  # row j feeds a trained token j+1
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(f"experts: placeholder routing at row {j} but m[{j + 1}] = 1 "
                         f"({int(bad.sum())} such rows); placeholders are allowed only where m[j+1] = 0")
    return int(placeholder.sum())


def encode_routed_experts(arr: np.ndarray) -> str:
    """(N, L, k) int32 -> base64 of the little-endian int32 bytes (SGLang `routed_experts`)."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError(f"arr: expected (N, L, k), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"arr: expected integer ids, got dtype {arr.dtype}")
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(b64: str, num_layers: int, top_k: int) -> np.ndarray:
    """base64 little-endian int32 -> (N, L, k) int32; length must be a multiple of L * k."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"b64: not valid base64 ({e})") from None
    row = 4 * num_layers * top_k
    if len(raw) % row:
        raise ValueError(f"b64: {len(raw)} bytes is not a multiple of 4 * L * k = {row}")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32).reshape(-1, num_layers, top_k)


# --- R3 figures for a training step --------------------------------------------------------------
def _expert_sets_differ(a, b):
    """a, b (..., k) int -> (...) bool: the two rows name different expert SETS (order ignored)."""
    return (a.long().sort(dim=-1).values != b.long().sort(dim=-1).values).any(dim=-1)


def _trained_rows(experts, attention_mask, loss_mask):
    """(B, T) bool: rows j that route a forward predicting a trained token (m[j+1] = 1) and are recorded."""
    m_next = F.pad(torch.as_tensor(loss_mask)[:, 1:] != 0, (0, 1), value=False)  # (B, T): m[j+1]
    recorded = (torch.as_tensor(experts) >= 0).all(dim=-1).all(dim=-1)  # (B, T)
    return m_next & recorded & (torch.as_tensor(attention_mask) != 0)


@torch.no_grad()
def mismatch(model, input_ids, attention_mask, experts, loss_mask) -> float:
    """Fraction of (position, layer) pairs whose live expert SET differs from the recorded one.

    input_ids, attention_mask, loss_mask (B, T); experts (B, T, L, k) with -1 rows where nothing was
    recorded. Counted over rows j with m[j+1] = 1 (the rows whose forward produces a trained logprob).
    Runs one forward of `model` with live routing (R3 off); 0.0 when no row qualifies.
    """
    with routing(model, "record") as rec:
        model(input_ids=input_ids, attention_mask=attention_mask)
        differ, n = mismatch_counts(rec.experts, experts, attention_mask, loss_mask)
    return differ / n if n else 0.0


def mismatch_counts(live, experts, attention_mask, loss_mask) -> tuple[int, int]:
    """(pairs whose live expert set differs from the recorded one, pairs counted): mismatch's fraction as a sum, for
    a batch forwarded in parts (ppo.train_step); live, experts (B, T, L, k), the masks (B, T)."""
    experts = torch.as_tensor(experts)
    rows = _trained_rows(experts, attention_mask, loss_mask)  # (B, T)
    differ = _expert_sets_differ(torch.as_tensor(live)[rows], experts[rows])  # (rows, L)
    return int(differ.sum()), differ.numel()


# --- Megatron-Core backend: drive the native RouterReplay ------------------------------------------
def slice_for_megatron(experts, tp_rank=0, tp_size=1, sp=False, cp_rank=0, cp_size=1, layers=None,
                       moe_layers=None, cp_contiguous=False) -> list:
    """experts (B, T, L_moe, k) -> one (N_local, k) int64 tensor per MoE layer of this rank, rows in the
    order tokens reach that rank's router.

    Megatron-Core's tokens are sequence-major ([s, b] flattened: row = s * B + b). Context parallel
    gives rank r the sequence chunks r and 2*cp - 1 - r of 2*cp equal chunks (load-balanced causal
    split; cp_contiguous=True: the r-th of cp contiguous chunks, mcore._gpt_forward's split for the GDN
    state passing); sequence parallel (tp > 1) then gives TP rank t the t-th contiguous 1/tp of that local
    sequence; without sequence parallel every TP rank routes all local tokens. `layers` = (first,
    last + 1) global decoder-layer range of this pipeline stage (None: all); `moe_layers` = per global
    decoder layer 1 (MoE) / 0 (dense) (None: all MoE). Recorded column l counts MoE layers only.
    """
    experts = torch.as_tensor(experts)
    if experts.ndim != 4:
        raise ValueError(f"experts: expected (B, T, L, k), got shape {tuple(experts.shape)}")
    B, T, L, k = experts.shape
    moe_layers = [1] * L if moe_layers is None else [int(x) for x in moe_layers]
    if sum(moe_layers) != L:
        raise ValueError(f"moe_layers: {sum(moe_layers)} MoE layers in the pattern but experts hold L = {L}")
    first, last = (0, len(moe_layers)) if layers is None else layers
    if not 0 <= first <= last <= len(moe_layers):
        raise ValueError(f"layers: expected a range inside [0, {len(moe_layers)}], got {layers}")
    if cp_size > 1 and cp_contiguous:  # chunk r of cp
        if T % cp_size:
            raise ValueError(f"experts: T = {T} not divisible by cp_size = {cp_size}")
        experts = experts.chunk(cp_size, dim=1)[cp_rank]  # (B, T/cp, L, k)
    elif cp_size > 1:  # Megatron's causal load balancing: chunks (r, 2cp-1-r) of 2cp
        if T % (2 * cp_size):
            raise ValueError(f"experts: T = {T} not divisible by 2 * cp_size = {2 * cp_size}")
        chunks = experts.chunk(2 * cp_size, dim=1)
        experts = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)  # (B, T/cp, L, k)
    seq = experts.transpose(0, 1)  # (S, B, L, k): Megatron's [s, b] order
    if sp and tp_size > 1:
        if seq.shape[0] % tp_size:
            raise ValueError(f"experts: local sequence {seq.shape[0]} not divisible by tp_size = {tp_size}")
        seq = seq.chunk(tp_size, dim=0)[tp_rank]  # (S/tp, B, L, k)
    moe_index = [sum(moe_layers[:i]) for i in range(len(moe_layers))]  # global layer -> MoE column
    cols = [moe_index[i] for i in range(first, last) if moe_layers[i]]
    return [seq[:, :, c].reshape(-1, k).long().contiguous() for c in cols]  # each (N_local, k)


def megatron_routers(model) -> list:
    """The TopKRouters of a Megatron-Core model in layer order; refuses fusion and missing replay."""
    from megatron.core.transformer.moe.router import TopKRouter
    rs = [m for m in model.modules() if isinstance(m, TopKRouter)]
    if not rs:
        raise ValueError("model: no Megatron-Core TopKRouter found")
    for r in rs:
        if r.config.moe_router_fusion:  # the fused TE kernel never calls RouterReplay.get_replay_topk
            raise ValueError("model: moe_router_fusion=True bypasses RouterReplay; R3 needs it off")
        if r.router_replay is None:
            raise ValueError("model: built without moe_enable_routing_replay=True (no RouterReplay)")
    return rs


def _replay_topk(replay, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """RouterReplay.get_replay_topk plus two checks: row count must match; all -1 rows use live top-k."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    action = replay.router_replay_action
    if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        return RouterReplay.get_replay_topk(replay, scores, topk, num_groups, group_topk, default_compute_topk)
    idx = replay.target_topk_idx if action == RouterReplayAction.REPLAY_FORWARD else replay.replay_backward_list.pop(0)
    idx = idx.to(scores.device).long()  # (N, k)
    if idx.shape != (scores.shape[0], topk):
        raise ValueError(f"R3 replay: router got {scores.shape[0]} tokens x top-{topk} but the replay slice "
                         f"is {tuple(idx.shape)} (check slice_for_megatron's parallel layout)")
    hole = (idx < 0).all(dim=-1, keepdim=True)  # (N, 1) placeholder rows
    if hole.any():
        _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        idx = torch.where(hole, live, idx)
    return scores.gather(1, idx), idx  # w = softmax over the k gathered live logits (pre_softmax off)


class MegatronRouting:
    """What `megatron_routing()` yields. record: `experts` (N, L_local, k) int32 after the forward."""

    def __init__(self, replays, mode):
        self.replays, self.mode = replays, mode
        self.batch_shape = lambda: None  # mcore.MegatronActor sets it: (B, T_routed, T) of the last forward
        self.gather = lambda ex: ex  # mcore.MegatronActor under sequence parallel: all TP ranks' rows, in order

    def backward_mode(self):
        """Switch replay to REPLAY_BACKWARD before a backward that recomputes (pops in forward order)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
        if self.mode == "replay":
            for rp in self.replays:
                rp.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    @property
    def experts(self) -> torch.Tensor:
        got = [rp.get_recorded_indices() for rp in self.replays]
        if any(g is None for g in got):
            raise RuntimeError("R3 record: no forward ran inside the routing context")
        ex = self.gather(torch.stack([g.to(torch.int32).cpu() for g in got], dim=1))  # (N, L_local, k), rows s * B + b
        bt = self.batch_shape()
        if bt is not None and ex.shape[0] == bt[0] * bt[1]:  # whole sequence on this rank -> (B, T, L, k)
            ex = ex.reshape(bt[1], bt[0], *ex.shape[1:]).transpose(0, 1)[:, :bt[-1]]  # padded tail cut off
        return ex


@contextlib.contextmanager
def megatron_routing(model, mode: str, layer_experts=None):
    """Route every MoE layer of a Megatron-Core `model` in `mode` through its native RouterReplay.

    replay: `layer_experts` = slice_for_megatron(...) output (one (N, k) tensor per local MoE layer).
    Drives this model's own RouterReplay instances (not the process-wide static list, which also holds
    the critic's and any other model's routers).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    replays = [r.router_replay for r in megatron_routers(model)]
    if any(rp.router_replay_action is not None for rp in replays):
        raise RuntimeError("routing: another R3 routing context is already open on this model")
    if mode == "replay":
        if layer_experts is None or len(layer_experts) != len(replays):
            raise ValueError(f"layer_experts: replay needs one (N, k) tensor per MoE layer ({len(replays)}), "
                             f"got {None if layer_experts is None else len(layer_experts)}")
    elif layer_experts is not None:
        raise ValueError(f"layer_experts: only replay mode takes experts, mode is {mode!r}")
    action = {"off": None, "record": RouterReplayAction.RECORD, "replay": RouterReplayAction.REPLAY_FORWARD}[mode]
    for l, rp in enumerate(replays):
        rp.clear_indices()
        if mode == "replay":
            rp.set_target_indices(layer_experts[l])
            rp.get_replay_topk = lambda *a, _rp=rp, **kw: _replay_topk(_rp, *a, **kw)
        if action is not None:
            rp.set_router_replay_action(action)
    ctx = MegatronRouting(replays, mode)
    try:
        yield ctx
    finally:
        for rp in replays:
            rp.clear_router_replay_action()
            rp.__dict__.pop("get_replay_topk", None)
            if mode != "record":
                rp.clear_indices()
