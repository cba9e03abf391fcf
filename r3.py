"""R3: rollout routing replay for the MoE actor (paper section "R3").

Paper: the sampler records R[j, l, :], the top-k expert ids chosen at every MoE layer l for every
position j (1.5 KiB per position at 48 layers x top-8 int32), and every trainer forward replays
them: position j goes through exactly the experts that produced the sampled token, while the gate
weights are the softmax of the *live* router logits gathered at the recorded k ids and renormalised
over those k, so the router keeps its gradient. A missing capture aborts the step (never silently
dropped); placeholder rows are allowed only where m[j+1] = 0 (positions whose next token is not
trained on).

    w[j, l, :] = softmax(router_l(h_j))[R[j, l, :]] / sum_k softmax(router_l(h_j))[R[j, l, k]]

Use:

    r3.install(model)                                    # once, after building/loading the model
    with r3.routing(model, "record") as rec:             # sampler / engine side
        model(ids)
    experts = rec.experts                                # (B, T, L, k) int32
    with r3.routing(model, "replay", experts):           # trainer side, every forward
        loss = f(model(ids).logits); loss.backward()     # backward (and recompute) inside

`rec.forwards` keeps one (B, T_i, L, k) tensor per forward run inside the context (a KV-cached
engine runs a prefill and then one forward per decode step); `rec.pop()` returns and clears them.
The wire format of SGLang's `routed_experts` (base64 of little-endian int32 [N, L, k]) is
`encode_routed_experts` / `decode_routed_experts`.

Departures from the paper:
1. The trainer is Hugging Face's Qwen3_5MoeForCausalLM, not Megatron-Core's `RouterReplay`; the
   router module `layer.mlp.gate` is swapped for `R3Router` (same weight Parameter, same
   state-dict key), and a forward pre-hook on the MoE block tells the router the (B, T) of the
   batch so that flattened token rows can be matched to recorded rows.
2. A replay row of all -1 (a placeholder or padding) falls back to live top-k for that row. The
   replay itself does not know the loss mask; the sample assembler calls `check_capture(experts,
   loss_mask)`, which aborts on a missing capture and on placeholders where m[j+1] = 1. `routing`
   refuses malformed tensors (wrong shape, ids out of range, partly -1 rows).
3. Activation recompute (gradient checkpointing): the recomputed forward reads the routers' replay
   state when backward runs, so backward must run inside the `routing(..., "replay")` context.
   Record mode is meant for forward-only use (no_grad); a recompute inside a record context would
   append a second copy of the rows.
4. One routing context per model at a time (nesting raises): the mode is an explicit argument held
   by the routers only while the context is open, never a global or an environment variable.
"""

import base64
import contextlib

import numpy as np
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

MODES = ("off", "record", "replay")


class R3Router(Qwen3_5MoeTopKRouter):
    """Top-k softmax router that can record its choices or replay recorded ones.

    forward(hidden (N, H)) -> (router_logits (N, E), weights (N, k), indices (N, k)), like HF.
    """

    def __init__(self, router: Qwen3_5MoeTopKRouter, layer_idx: int):
        torch.nn.Module.__init__(self)
        self.top_k = router.top_k
        self.num_experts = router.num_experts
        self.hidden_dim = router.hidden_dim
        self.weight = router.weight  # the SAME Parameter: optimizer state and state-dict key unchanged
        self.layer_idx = layer_idx
        self.batch_shape = None  # (B, T) of the current forward, set by the MoE block pre-hook
        self.mode = "off"
        self.sink = None  # record: list that receives (B, T, k) int32 per forward
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
        if self.mode == "record":
            B, T = self.batch_shape
            self.sink.append(live_idx.reshape(B, T, self.top_k).to(torch.int32).cpu())
        return router_logits, top_value.to(router_logits.dtype), idx


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
    """Swap every MoE router `layer.mlp.gate` for an R3Router holding the same weight. Idempotent."""
    blocks = _moe_blocks(model)
    if not blocks:
        raise ValueError("model: no MoE layers with `mlp.gate` found")
    for l, (_, block) in enumerate(blocks):
        if isinstance(block.gate, R3Router):
            continue
        block.gate = R3Router(block.gate, layer_idx=l)
        block.register_forward_pre_hook(_remember_batch_shape)
    return model


class Routing:
    """What `routing()` yields. record: `forwards` (list of (B, T_i, L, k) int32), `experts`."""

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
def routing(model, mode: str, experts=None):
    """Route every MoE layer of `model` in `mode` ("off" | "record" | "replay") inside the block.

    replay needs `experts` (B, T, L, k) int (ids or -1); each forward inside must have batch (B, T).
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
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
    for l, r in enumerate(rs):
        r.mode = mode
        r.sink = ctx.sinks[l] if mode == "record" else None
        r.replay = experts[:, :, l, :] if mode == "replay" else None  # (B, T, k)
    try:
        yield ctx
    finally:
        for r in rs:
            r.mode, r.sink, r.replay = "off", None, None
    if mode == "record":  # only on a clean exit, so an error inside is never masked
        ctx._collect()


def check_capture(experts, loss_mask):
    """Refuse a sample whose routing capture cannot be replayed (paper: missing capture aborts).

    experts: (T, L, k) int (or None when the sampler returned no capture); loss_mask: (T,) 0/1.
    Row j routes the forward that predicts token j+1, so a placeholder row (all -1) is allowed only
    where m[j+1] = 0; the last row (j = T-1) predicts nothing and may be a placeholder.
    """
    if experts is None:
        raise ValueError("experts: routing capture is missing (R3 never silently drops it)")
    experts = torch.as_tensor(np.asarray(experts))
    mask = torch.as_tensor(np.asarray(loss_mask))
    if experts.ndim != 3 or experts.shape[0] != mask.shape[0]:
        raise ValueError(f"experts: expected (T, L, k) with T = len(loss_mask) = {mask.shape[0]}, "
                         f"got {tuple(experts.shape)}")
    placeholder = (experts < 0).all(dim=-1).any(dim=-1)  # (T,) any layer missing for row j
    bad = placeholder[:-1] & (mask[1:] != 0)  # row j feeds a trained token j+1
    if bad.any():
        j = int(bad.nonzero()[0])
        raise ValueError(f"experts: placeholder routing at row {j} but m[{j + 1}] = 1 "
                         f"({int(bad.sum())} such rows); placeholders are allowed only where m[j+1] = 0")


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
