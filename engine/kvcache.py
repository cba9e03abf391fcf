"""The embedded engine's batch state (engine/batcher.py): machinery, no paper section. Per-layer state of running rows
(the attention layers' KV, the Gated DeltaNet layers' conv + recurrent state), a KV layer that grows in place
(spare columns, and spare rows that joining rows are written into), stacking rows of different lengths (left
padding) with one copy of each, rows leaving in place, and the prefix cache across an agent's turns (SGLang's
radix cache, kept at prefix ends: a Gated DeltaNet state exists only at the end of what it read).

Run: not by itself; tests/test_engine.py checks a cache hit against a cold prefill (tokens, logprobs, routing), rows
joining / leaving in place against a rebuilt batch; tests/test_engine_stress.py drives the batch with agents.
"""
import collections

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin


# --- the batch's cache: KV of the attention layers, conv + recurrent state of the Gated DeltaNet layers -------
def _is_linear(layer):
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _cache_state(cache, rows, n, copy=True):
    """Per layer, the state of batch rows `rows` (a slice) whose last n columns are real tokens: attention layers
    ("attn", keys, values) (b, H, n, D); Gated DeltaNet layers ("linear", conv, recurrent) of those rows. copy=False:
    views into the cache (for a merge that concatenates them at once)."""
    c = (lambda x: x.clone()) if copy else (lambda x: x)
    out = []
    for layer in cache.layers:
        if _is_linear(layer):
            out.append(("linear", c(layer.conv_states[0][rows]), c(layer.recurrent_states[0][rows])))
        else:
            out.append(("attn", c(layer.keys[rows, :, layer.keys.shape[2] - n:]),
                        c(layer.values[rows, :, layer.values.shape[2] - n:])))
    return out


class GrowingKV(DynamicLayer):
    """An attention layer's KV cache with spare columns and spare rows: a decode step writes its column in place,
    where DynamicLayer re-concatenates the whole cache every step; the column capacity doubles when full; rows that
    join the batch are written into spare rows (append_rows). keys / values are views of the filled rows and
    columns."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.n, self.kbuf, self.vbuf = 0, None, None
        n, s, B = self.n, key_states.shape[-2], key_states.shape[0]  # B: the running rows (drop_rows keeps them first)
        if self.kbuf is not None and B > self.kbuf.shape[0]:
            raise ValueError(f"key_states: {B} rows, the cache holds {self.kbuf.shape[0]} (rows join by append_rows)")
        if self.kbuf is None or n + s > self.kbuf.shape[-2]:
            cap, R = max(2 * (n + s), 64), B if self.kbuf is None else self.kbuf.shape[0]  # R: the rows' capacity
            kb = key_states.new_empty(R, *key_states.shape[1:-2], cap, key_states.shape[-1])
            vb = value_states.new_empty(R, *value_states.shape[1:-2], cap, value_states.shape[-1])
            if n:  # the B running rows only: the spare rows R - B hold nothing (a copy into all R rows failed)
                kb[:B, ..., :n, :], vb[:B, ..., :n, :] = self.kbuf[:B, ..., :n, :], self.vbuf[:B, ..., :n, :]
            self.kbuf, self.vbuf = kb, vb
        self.kbuf[:B, ..., n:n + s, :] = key_states
        self.vbuf[:B, ..., n:n + s, :] = value_states
        self.n = n + s
        self.keys, self.values = self.kbuf[:B, ..., :self.n, :], self.vbuf[:B, ..., :self.n, :]
        return self.keys, self.values

    @classmethod
    def filled(cls, like, B, T, rows=None):
        """An empty layer of B rows whose first T columns are to be written by the caller (rows, columns
        :T of kbuf / vbuf), capacity 2T columns and `rows` rows (default B); like: a key tensor (B', H, t, D) that
        gives H, D and the dtype."""
        layer = cls()
        layer.lazy_initialization(like, like)
        shape = (max(B, rows or B), like.shape[1], max(2 * T, 64), like.shape[-1])  # (rows, H, capacity, D)
        layer.n, layer.kbuf, layer.vbuf = T, like.new_empty(shape), like.new_empty(shape)
        layer.keys, layer.values = layer.kbuf[:B, :, :T], layer.vbuf[:B, :, :T]
        return layer


def _build_cache(config, state):
    """A DynamicCache holding `state` (as _cache_state returns it), through the cache's own update methods; the
    attention layers are GrowingKV."""
    cache = DynamicCache(config=config)
    for i, (kind, a, b) in enumerate(state):
        if kind == "linear":
            cache.update_conv_state(a, i, conv_kernel_size=a.shape[-1])  # copied into the layer's own tensors
            cache.update_recurrent_state(b, i)
        else:
            cache.layers[i] = GrowingKV()
            cache.layers[i].update(a, b)  # copied into the layer's buffer
    return cache


def _trimmed(parts):
    """Each part without its leading columns that are padding in all its rows (left by rows that left the batch)."""
    firsts = [int(m.any(0).long().argmax()) for _, m in parts]  # each part's first column some row uses
    return [([(kind, a, b) if kind == "linear" else (kind, a[:, :, f:], b[:, :, f:]) for kind, a, b in s], m[:, f:])
            for (s, m), f in zip(parts, firsts)]


def _write_rows(layer, r, parts, T):
    """Copy each part's keys / values into rows r.. of a GrowingKV, right-aligned at column T, the left padding
    zeroed (a masked column of NaN would still poison attention)."""
    for k, v in parts:
        b, t = k.shape[0], k.shape[2]
        layer.kbuf[r:r + b, :, :T - t].zero_()
        layer.vbuf[r:r + b, :, :T - t].zero_()
        layer.kbuf[r:r + b, :, T - t:T] = k
        layer.vbuf[r:r + b, :, T - t:T] = v
        r += b


def _merged_cache(config, parts, rows=None):
    """[(state, mask (b, t))] -> (a DynamicCache of every part's rows, mask (B, T)): the parts stacked, the shorter
    ones left-padded; one copy of each attention part, straight into its GrowingKV buffer (its rows, its columns
    right-aligned). A part's leading columns that are padding in all its rows are not copied. rows: the buffers'
    row capacity (default: the parts' rows; later joins append_rows into the spare ones)."""
    parts = _trimmed(parts)
    T = max(m.shape[1] for _, m in parts)
    mask = torch.cat([F.pad(m, (T - m.shape[1], 0)) for _, m in parts])
    cache = DynamicCache(config=config)
    for i, (kind, _, _) in enumerate(parts[0][0]):
        if kind == "linear":
            a = torch.cat([s[i][1] for s, _ in parts])
            cache.update_conv_state(a, i, conv_kernel_size=a.shape[-1])
            cache.update_recurrent_state(torch.cat([s[i][2] for s, _ in parts]), i)
            continue
        layer = cache.layers[i] = GrowingKV.filled(parts[0][0][i][1], mask.shape[0], T, rows=rows)
        _write_rows(layer, 0, [s[i][1:] for s, _ in parts], T)
    return cache, mask


def append_rows(cache, mask, parts):
    """Rows of `parts` [(state, mask (b, t))] join the batch (cache, mask (B, T)) in place: written into the
    GrowingKV buffers' spare rows, right-aligned at the batch's last column (a copy of the new rows only, where
    _merged_cache copies the whole batch again). -> the new mask (B', T), or None (nothing written) when it cannot
    be done in place: a part wider than the batch, fewer spare rows than new ones, or over half the batch's
    columns padding in every row (left by rows that left: the rebuild trims them; in place, the batch's width would
    grow by a column every step for as long as it runs, and every row attends over it)."""
    parts = _trimmed(parts)
    B, T = mask.shape
    n_new = sum(m.shape[0] for _, m in parts)
    attn = [layer for layer in cache.layers if not _is_linear(layer)]
    if any(m.shape[1] > T for _, m in parts) or any(layer.kbuf.shape[0] < B + n_new for layer in attn):
        return None
    if 2 * int(mask.any(0).long().argmax()) > T:  # the first column some row uses: past the middle
        return None
    for i, layer in enumerate(cache.layers):
        if _is_linear(layer):
            layer.conv_states[0] = torch.cat([layer.conv_states[0][:B]] + [s[i][1] for s, _ in parts])
            layer.recurrent_states[0] = torch.cat([layer.recurrent_states[0][:B]] + [s[i][2] for s, _ in parts])
            continue
        _write_rows(layer, B, [s[i][1:] for s, _ in parts], T)
        layer.keys, layer.values = layer.kbuf[:B + n_new, :, :layer.n], layer.vbuf[:B + n_new, :, :layer.n]
    return torch.cat([mask] + [F.pad(m, (T - m.shape[1], 0)) for _, m in parts])


def drop_rows(cache, n_rows, drop):
    """Rows `drop` (batch indices) of the cache's n_rows leave the batch in place: each is overwritten by the batch's
    last remaining row (one row copy per leaving row, where rebuilding the batch copied every remaining row); the
    Gated DeltaNet layers' per-row states are indexed. -> order: order[i] = the old index of new row i."""
    order = list(range(n_rows))
    for b in sorted(drop, reverse=True):
        order[b] = order[-1]
        order.pop()
    idx = torch.tensor(order)
    moved = [i for i, o in enumerate(order) if o != i]  # new rows that take an old row from past the new end:
    dst, src = torch.tensor(moved, dtype=torch.long), idx[moved]  # sources and destinations are disjoint
    for layer in cache.layers:
        if _is_linear(layer):
            layer.conv_states[0] = layer.conv_states[0][idx]
            layer.recurrent_states[0] = layer.recurrent_states[0][idx]
            continue
        if moved:  # one indexed copy per buffer
            layer.kbuf[dst, :, :layer.n] = layer.kbuf[src, :, :layer.n]
            layer.vbuf[dst, :, :layer.n] = layer.vbuf[src, :, :layer.n]
        layer.keys, layer.values = layer.kbuf[:len(order), :, :layer.n], layer.vbuf[:len(order), :, :layer.n]
    return order


class PrefixCache:
    """LRU of model states at the end of finished requests, keyed by the token ids they were computed over
    (SGLang's radix cache, kept at prefix ends: a Gated DeltaNet state exists only at the end of what it read).

    An entry = (ids, per-layer state of one row, routed experts of those ids (len, L, k) int32). lookup(ids) returns
    the longest entry that is a proper prefix of ids (at least one token is left to prefill). Evicted least
    recently used when the entries' bytes pass cap_bytes; cleared when the weights change."""

    def __init__(self, cap_bytes):
        self.cap, self.bytes = cap_bytes, 0
        self.entries = collections.OrderedDict()  # tuple(ids) -> (ids, state, routing, nbytes)
        self.hits = self.misses = self.hit_tokens = 0

    def lookup(self, ids):
        best = None
        for key, entry in self.entries.items():
            n = len(entry[0])
            if n < len(ids) and (best is None or n > len(best[0])) and ids[:n] == entry[0]:
                best = entry
        if best is None:
            self.misses += 1
            return None
        self.entries.move_to_end(tuple(best[0]))
        self.hits, self.hit_tokens = self.hits + 1, self.hit_tokens + len(best[0])
        return best

    def insert(self, ids, state, routing, supersedes=None):
        if supersedes is not None:
            self.drop(supersedes)  # the request's own prefix: its next turn extends this entry, not that one
        key = tuple(ids)
        self.drop(key)
        nbytes = sum(a.nbytes + b.nbytes for _, a, b in state) + (routing.nbytes if routing is not None else 0)
        nbytes += 8 * len(ids)
        if nbytes > self.cap:
            return
        self.entries[key] = (list(ids), state, routing, nbytes)
        self.bytes += nbytes
        while self.bytes > self.cap:
            self.drop(next(iter(self.entries)))

    def drop(self, key):
        entry = self.entries.pop(tuple(key), None)
        if entry is not None:
            self.bytes -= entry[3]

    def clear(self):
        self.entries.clear()
        self.bytes = 0
