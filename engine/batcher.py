"""The embedded engine's continuous-batching scheduler: the queue, requests joining the running batch (prefill,
prefix-cache hits), one decode step of every row at a time, one sampling call per step, rows leaving (stop, length,
abort) into the prefix cache, routed-expert capture. Machinery, no paper section (the rollout infrastructure's
SGLang); engine/server.py puts the HTTP protocol and the weight endpoints on top, engine/kvcache.py holds the
batch's state and the prefix cache.

Departures from SGLang:
1. The prefix cache keeps states at the ends of finished requests (a hit needs the new input to extend a whole
   earlier trajectory, the agent's next turn), not SGLang's per-token radix tree; LRU under a byte cap. Hits are
   prefilled together only when they add the same number of tokens (a row's tokens stay contiguous in the
   left-padded batch); SGLang's ragged extend batches any.
2. Logprobs are log-softmax(logits / temperature) (raw logits at temperature 0), before top-p truncation; top-p
   only changes which token is drawn.
3. The running batch is one left-padded KV cache (no paged attention): while a long request runs, every row attends
   over its padded length; a row that leaves is overwritten in place by the batch's last row (kvcache.drop_rows);
   a joining row is written into the buffers' spare rows (kvcache.append_rows) unless it is wider than the batch,
   no row is spare or over half the batch's columns are padding in every row: then the batch is rebuilt (those
   columns trimmed).
4. Pausing waits for the running requests to finish (no abort/retract); abort ends a queued or running request with
   finish_reason "abort".
"""
import collections
import queue
import sys
import threading

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import r3
from engine.httpjson import BadRequest, HTTPError
from engine.kvcache import PrefixCache, _cache_state, _merged_cache, append_rows, drop_rows
from model import engine_forward, supports_engine_forward

SPLIT_LOG = 1024  # the last prefill groups re-run one request at a time (Batcher.prefill_splits)


# --- sampling -------------------------------------------------------------------------------------
def sample_rows(logits, temperature, top_p, top_k, gens):
    """One step's sampling for every row at once: logits (n, V); temperature / top_p / top_k: per-row lists;
    gens: each row's torch.Generator (a seeded request's own, else the engine's) -> [(token id, logprob) or the
    ValueError of a row whose distribution is not finite (that request's error only)].

    Per row as SGLang: temperature 0 is greedy with raw-logit logprobs; else logprob = log_softmax(logits / T), the
    top-k highest then the smallest prefix reaching top_p kept, one draw by inverse CDF from the row's generator
    (over the probabilities sorted in descending order for a row that truncates, in vocabulary order for one that
    keeps everything: the sort is the costliest operation here and depends on the row alone). One log_softmax and
    search for the batch, one sort of the truncating rows, one draw call when all rows share a generator (else one per
    row), one host sync."""
    n, V = logits.shape
    if _plain(temperature, top_p, top_k, gens):
        return _sample_plain(logits, temperature[0], gens[0])
    greedy = torch.tensor([x == 0 for x in temperature])  # (n,)
    t = torch.tensor(temperature, dtype=torch.float32)  # a denormal T is 0 here: its row's logits / T is not finite
    logp = F.log_softmax(logits.float() / torch.where(greedy, 1.0, t)[:, None], dim=-1)  # (n, V)
    probs = logp.exp()
    cut = [not g and (kk > 0 or p < 1.0) for g, kk, p in zip(greedy.tolist(), top_k, top_p)]
    kept, order = probs, None  # kept: the probabilities in draw order; order: the vocabulary id at each place
    if any(cut):
        rows = torch.tensor([i for i, c in enumerate(cut) if c])
        sorted_p, sorted_ids = torch.sort(probs[rows], dim=-1, descending=True)  # (c, V)
        rank = torch.arange(V)[None, :]
        k = torch.tensor([top_k[i] if top_k[i] > 0 else V for i in rows.tolist()])[:, None]  # (c, 1)
        sorted_p = sorted_p.masked_fill(rank >= k, 0.0)  # keep the top k
        p = torch.tensor([top_p[i] for i in rows.tolist()], dtype=torch.float32)[:, None]  # (c, 1)
        drop = ((sorted_p.cumsum(-1) - sorted_p) >= p) & (p < 1.0)  # keep the smallest prefix reaching top_p
        kept, order = probs.clone(), torch.arange(V).repeat(n, 1)
        kept[rows], order[rows] = sorted_p.masked_fill(drop, 0.0), sorted_ids
    cdf = kept.cumsum(-1)  # (n, V)
    one = all(g is gens[0] for g in gens)  # unseeded rows share the engine's generator: one call draws for all
    u = (torch.rand(n, generator=gens[0]) if one else torch.stack([torch.rand((), generator=g) for g in gens])) \
        * cdf[:, -1]  # (n,) one draw per row
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=V - 1)  # first cdf > u
    drawn = pick.squeeze(1) if order is None else order.gather(1, pick).squeeze(1)
    tok = torch.where(greedy, logp.argmax(-1), drawn)  # (n,)
    lp = logp.gather(1, tok[:, None]).squeeze(1)  # (n,)
    finite = greedy | torch.isfinite(probs).all(-1)
    out = []
    for i, (ok, ti, li) in enumerate(zip(finite.tolist(), tok.tolist(), lp.tolist())):
        out.append((ti, li) if ok else
                   ValueError(f"sampling: non-finite probabilities at temperature {temperature[i]}"))
    return out


def _plain(temperature, top_p, top_k, gens):
    """Whether a step's rows share one temperature > 0 and one generator and keep the whole vocabulary (a rollout's
    unseeded rows): sample_rows' common case, which _sample_plain draws in fewer operations."""
    t, g = temperature[0], gens[0]
    return (t > 0 and all(x == t for x in temperature) and all(p >= 1.0 for p in top_p)
            and all(kk <= 0 for kk in top_k) and all(x is g for x in gens))


def _sample_plain(logits, temperature, gen):
    """sample_rows for rows that share `temperature` (> 0) and `gen` and truncate nothing: the same operations on the
    same values (logits / T, log-softmax, one uniform per row from gen scaled by the row's total, the first cdf
    entry past it) without the per-row temperature, greedy and truncation tensors. A row is finite when its total
    is: the probabilities are >= 0, so a NaN or infinite one makes the sum NaN or infinite."""
    n, V = logits.shape
    logp = F.log_softmax(logits.float() / torch.full((n, 1), temperature), dim=-1)  # (n, V); a tensor: a scalar
    cdf = logp.exp().cumsum(-1)  # divisor would be a multiplication by its reciprocal (another rounding)
    total = cdf[:, -1]
    u = torch.rand(n, generator=gen) * total  # (n,) one draw per row
    tok = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=V - 1)  # (n, 1) first cdf > u
    lp = logp.gather(1, tok).squeeze(1)  # (n,)
    return [(ti, li) if ok else ValueError(f"sampling: non-finite probabilities at temperature {temperature}")
            for ok, ti, li in zip(torch.isfinite(total).tolist(), tok.squeeze(1).tolist(), lp.tolist())]


# --- the running batch --------------------------------------------------------------------------------
class Row:
    """A running request's place in the batch: its sampler, tokens fed so far, and its capture slot."""

    def __init__(self, req, gen, slot):
        self.req, self.gen, self.slot = req, gen, slot
        self.fed = 0  # tokens whose state is in the cache (input + output[:-1] once decoding)
        self.prefix_key = None  # the prefix-cache entry this request extended (superseded by its own entry)


class Batcher:
    """Continuous batching over one loaded model: callers submit() Requests from any thread; one scheduler thread
    (_scheduler) runs every forward.

    One iteration = one decode step of the running batch: (1) the running rows are decoded together (one token each,
    left-padded KV + attention mask + explicit position ids); (2) queued requests join while the batch has room
    (max_batch): requests whose ids extend prefix-cache entries by the same number of new tokens are prefilled
    together on top of their entries' states (only the new suffixes are forwarded), the others together,
    left-padded, in forwards of at most max_prefill_tokens padded tokens; their states are merged into the batch;
    (3) one batched sampling call (sample_rows) draws the next token of every row; (4) a row that stops leaves at
    once, its state saved in the prefix cache (PrefixCache: the agent's next turn re-sends this trajectory plus the
    tool output). Requests never wait for a wave. Work that changes the model (run_when_idle: weight reloads) and
    pause() stop admission and wait for the running rows to finish, so one request sees one weight_version.

    Routed experts (SGLang's --enable-return-routed-experts; capture_routing=False turns capture off): every
    forward's top-k ids are copied by the routers into one preallocated buffer (r3.routing(..., into=)), then in
    one indexed copy into each row's slot of a (max_batch, max_positions, L, k) int32 buffer; row j = the experts
    chosen when token j was the input (prompt rows from prefill or from the prefix cache, which keeps the rows the
    first forward computed; output rows from decode steps; the last output token is never forwarded, so a
    request returns len(input) + len(output) - 1 rows).

    Threads: every forward runs on the scheduler thread with `threads` torch (OpenMP) threads, set there: OpenMP's
    thread count is per calling thread, and a second thread's multi-threaded ops run 3-4x slower when the process's
    main thread already owns a team of OpenMP workers (a decode step of 8 rows: 2.6 ms with one team, 10 ms with
    two; 3.1 ms single-threaded; results/LOG.md, 2026-12-02: the engine's threads). So EngineServer's default is 1
    (safe in any process: tests, benchmarks beside HF on the main thread); `python -m engine.server serve` and
    EngineActor, which own their process, keep the main thread at one thread and give the scheduler `--threads`.

    The forwards of a Qwen3-MoE model go through model.engine_forward (forward="own": the engine's own forward, as
    SGLang has its own model code; fewer operations than the transformers forward, logits equal to ~1e-6); other
    layouts (Qwen3.5's hybrid), or forward="hf", through the transformers forward.

    Failures: a request that fails inside the engine fails alone where it can: its prefill or seeding (before it
    joins the batch), or its row's sampling. A batched decode forward that raises fails the rows running in it, and
    any other fault of a step fails every running request (Request.fail: each gets its error); the scheduler goes on
    with the queue, so no caller is left waiting.
    """

    def __init__(self, model, max_batch, seed, prefix_cache_mb, capture_routing, threads, forward,
                 max_prefill_tokens):
        """model: loaded, in eval mode. The settings are EngineServer's, checked there before the model loads."""
        self.model = model
        self.torch_threads = threads  # torch (OpenMP) threads of the scheduler thread: the class docstring
        self.max_batch = max_batch
        self.own_forward = forward == "own" and supports_engine_forward(model)  # model.engine_forward
        cfg = model.config
        self.num_layers, self.top_k = len(r3.routers(model)), cfg.num_experts_per_tok
        self.capture, self._capture_ctx = capture_routing, None
        self.max_prefill_tokens = max_prefill_tokens
        n_max = max(cfg.max_position_embeddings, max_batch, max_prefill_tokens)  # the most token rows of a forward
        self.step_buf = torch.zeros(n_max, self.num_layers, self.top_k, dtype=torch.int32)  # one forward's ids
        self.slot_buf = torch.empty(max_batch, cfg.max_position_embeddings, self.num_layers, self.top_k,
                                    dtype=torch.int32)  # per running row: its routed experts so far
        self.free_slots = list(range(max_batch))[::-1]
        self.prefix = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb > 0 else None
        self.weight_version = "0"  # stamped on each request that finishes
        self.gen = torch.Generator().manual_seed(seed)
        self.queue = []  # waiting Requests
        self.commands = queue.Queue()  # (fn, result dict, Event) run when nothing is running
        self.cv = threading.Condition()
        self.paused, self.stopping = False, False
        self.closed = None  # while set, submit() refuses with HTTP 409 and this message (memory released)
        self.running = {}  # rid -> Request admitted and not finished
        self.rows, self.cache, self.mask = [], None, None  # the running batch: Rows, DynamicCache, (B, T) mask
        self.prefill_splits = collections.deque(maxlen=SPLIT_LOG)  # why a group prefill was re-run one by one

    def cache_stats(self):
        p = self.prefix
        return {"enabled": p is not None, "hits": p.hits if p else 0, "misses": p.misses if p else 0,
                "hit_tokens": p.hit_tokens if p else 0, "entries": len(p.entries) if p else 0,
                "bytes": p.bytes if p else 0}

    # -- called from other threads (HTTP) --
    def submit(self, req):
        with self.cv:
            if self.stopping:
                req.finish = {"type": "abort", "message": "engine is stopping"}
                return req
            if req.rid in self.running or any(r.rid == req.rid for r in self.queue):
                raise BadRequest(f"rid: {req.rid!r} is already queued or running")
            if req.aborted:  # its client hung up before it was queued
                req.finish = {"type": "abort"}
                return req
            if self.closed:
                raise HTTPError(409, self.closed)
            self.queue.append(req)
            self.cv.notify_all()
        req.done.wait()
        return req

    def run_when_idle(self, fn):
        """Run fn() on the scheduler thread once no request is running (admission stops meanwhile); returns its
        result or raises its error."""
        box, ev = {}, threading.Event()
        with self.cv:
            self.commands.put((fn, box, ev))
            self.cv.notify_all()
        ev.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def pause(self):
        """Stop admitting requests and wait until the running ones have finished."""
        with self.cv:
            self.paused = True
            while self.running:
                self.cv.wait()

    def resume(self):
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def abort(self, rid):
        with self.cv:
            for req in [r for r in self.queue if r.rid == rid]:
                self.queue.remove(req)
                req.finish = {"type": "abort"}
                req.done.set()
                return True
            if rid in self.running:
                self.running[rid].aborted = True
                return True
        return False

    def set_capture(self, on: bool):
        """Routed-expert capture on / off (experiments/bench.py's overhead measurement); clears the prefix cache."""
        def flip():
            self.capture = bool(on)
            self._capture_context(self.capture)
            if self.prefix is not None:
                self.prefix.clear()
        return self.run_when_idle(flip)

    # -- scheduler thread --
    def _scheduler(self):
        torch.set_num_threads(self.torch_threads)  # per thread (OpenMP): every forward and weight load runs here
        self._capture_context(self.capture)
        try:
            self._schedule()
        finally:
            self._capture_context(False)

    def _schedule(self):
        while True:
            with self.cv:
                while (not self.stopping and not self.running and self.commands.empty()
                       and (self.paused or not self.queue)):
                    self.cv.wait(timeout=0.1)
                if self.stopping:
                    for req in self.queue + list(self.running.values()):
                        req.finish = {"type": "abort", "message": "engine is stopping"}
                        req.done.set()
                    return
                admit = []
                if self.commands.empty() and not self.paused and self.free_slots:
                    n = min(len(self.free_slots), self.max_batch - len(self.rows))
                    admit, self.queue = self.queue[:n], self.queue[n:]
                    self.running.update((r.rid, r) for r in admit)
                idle = not self.running
            if idle:
                while not self.commands.empty():
                    fn, box, ev = self.commands.get()
                    try:
                        box["result"] = fn()
                    except Exception as e:  # reported to the caller
                        box["error"] = e
                    ev.set()
                continue
            try:
                self._step(admit)
            except Exception as e:  # a fault outside a forward: fail what runs, start over, keep serving
                with self.cv:  # the engine's state is clean before any client hears of the fault
                    failed = list(self.running.values())
                    self.running = {}
                    self.rows, self.cache, self.mask = [], None, None
                    self.free_slots = list(range(self.max_batch))[::-1]
                for req in failed:
                    if not req.done.is_set():
                        req.fail(e)
            with self.cv:
                if not self.running:
                    self.cv.notify_all()  # pause() waits for this

    def _forward(self, ids, mask, pos, cache):
        """A forward of the engine's model -> the last column's logits (B, V) (model.engine_forward or the
        transformers forward); with capture on the routers are in record mode into step_buf (the scheduler thread
        holds that routing context open: entering it per forward cost ~50 us, ~0.7% of a step)."""
        if self.own_forward:
            return engine_forward(self.model, ids, pos, mask, cache)
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                          logits_to_keep=1).logits[:, -1]

    def _capture_context(self, on):
        """Open (on) or close the routing context in which every forward records into step_buf."""
        if on and self._capture_ctx is None:
            self._capture_ctx = r3.routing(self.model, "record", into=self.step_buf)
            self._capture_ctx.__enter__()
        elif not on and self._capture_ctx is not None:
            ctx, self._capture_ctx = self._capture_ctx, None
            ctx.__exit__(None, None, None)

    def _join(self, admit):
        """Prefill the admitted requests -> [(Rows, logits (g, V), state, mask (g, t))]. Requests whose ids extend a
        prefix-cache entry by the same number of new tokens are prefilled together on top of their entries' states
        (the agents' next turns, each after a tool reply of that length); the others together, left-padded (their
        state starts at zero, which padding keeps: attention masks it, the Gated DeltaNet layers zero padded inputs).
        A request that cannot be seeded or prefilled fails alone (a failed group is re-run one request at a time;
        prefill_splits says why). Groups hold at most max_prefill_tokens padded new tokens: a group over the capture
        buffer failed and was re-run one by one, twice the prefill time at 32 concurrent requests (results/LOG.md,
        2026-12-03: a prefill group that overflowed the capture buffer)."""
        parts, kinds = [], {}  # kinds: None -> the cold requests; n -> the hits with n new tokens
        for req in admit:
            try:
                gen = torch.Generator().manual_seed(req.seed) if req.seed is not None else self.gen
                entry = self.prefix.lookup(req.input_ids) if self.prefix is not None else None
                kinds.setdefault(None if entry is None else len(req.input_ids) - len(entry[0]), []).append(
                    (req, gen, entry))
            except Exception as e:
                self._fail_admitted(req, e)
        for items in kinds.values():
            for group in self._prefill_groups(items):
                if len(group) > 1:
                    try:
                        parts.append(self._prefill(group))
                        continue
                    except Exception as e:  # re-run one at a time: the request at fault fails alone
                        why = f"{len(group)} requests: {type(e).__name__}: {str(e)[:200]}"
                        self.prefill_splits.append(why)
                        print(f"[engine] WARNING a prefill group is re-run one request at a time ({why})",
                              file=sys.stderr, flush=True)
                for item in group:
                    try:
                        parts.append(self._prefill([item]))
                    except Exception as e:
                        self._fail_admitted(item[0], e)
        return parts

    def _prefill_groups(self, items):
        """[(Request, Generator, entry)] in admission order, cut into groups of at most max_prefill_tokens padded new
        tokens (rows x the longest suffix past the entry), one forward each; a longer request is a group of its own."""
        groups, longest = [], 0
        for item in items:
            n = len(item[0].input_ids) - (len(item[2][0]) if item[2] else 0)
            if groups and (len(groups[-1]) + 1) * max(longest, n) <= self.max_prefill_tokens:
                groups[-1].append(item)
                longest = max(longest, n)
            else:
                groups.append([item])
                longest = n
        return groups

    def _prefill(self, group):
        """One prefill forward for [(Request, Generator, prefix-cache entry)]: every entry None (cold: left-padded ids
        on an empty cache) or every request a hit with the same number of new tokens S (the entries' states stacked,
        left-padded, then S real columns per row: each row's tokens stay the last `fed` columns of the batch, which
        drop_rows, merges and the prefix cache's insert read)."""
        cfg, G = self.model.config, len(group)
        lens = [len(req.input_ids) for req, _, _ in group]
        p = [len(e[0]) if e else 0 for _, _, e in group]
        new = [n - q for n, q in zip(lens, p)]
        S = max(new)  # columns forwarded
        if group[0][2] is not None:
            assert all(e is not None for _, _, e in group) and min(new) == S, "a hit group: the same new tokens each"
            cache, mask = _merged_cache(cfg, [(e[1], torch.ones(1, len(e[0]), dtype=torch.long)) for _, _, e in group])
        else:
            cache, mask = DynamicCache(config=cfg), torch.zeros(G, 0, dtype=torch.long)
        ids = torch.zeros(G, S, dtype=torch.long)  # (G, S) left-padded with <|endoftext|>
        new_mask = torch.zeros(G, S, dtype=torch.long)
        for b, (req, _, _) in enumerate(group):
            ids[b, S - new[b]:] = torch.tensor(req.input_ids[p[b]:])
            new_mask[b, S - new[b]:] = 1
        mask = torch.cat([mask, new_mask], dim=1)  # (G, T): T = the longest entry + S
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -S:]  # (G, S) explicit position ids
        last = self._forward(ids, mask, pos, cache)  # (G, V)
        rows, routed = [], self.step_buf[:G * S].view(G, S, self.num_layers, self.top_k)
        for b, (req, gen, entry) in enumerate(group):
            row = Row(req, gen, self.free_slots.pop())
            if self.capture:
                if entry:
                    self.slot_buf[row.slot, :p[b]] = entry[2]  # the rows the prefix's first forward computed
                self.slot_buf[row.slot, p[b]:lens[b]] = routed[b, S - new[b]:]
            row.fed, req.cached_tokens = lens[b], p[b]
            row.prefix_key = entry[0] if entry else None
            rows.append(row)
        return rows, last, _cache_state(cache, slice(None), mask.shape[1], copy=False), mask

    def _fail_admitted(self, req, e):
        req.fail(e)
        with self.cv:
            self.running.pop(req.rid, None)

    def _release(self, row):
        self.free_slots.append(row.slot)
        with self.cv:
            self.running.pop(row.req.rid, None)

    @torch.inference_mode()
    def _step(self, admit):
        """One decode step of the running rows, the admitted requests' prefills, one sampling call for all rows."""
        version, cfg = self.weight_version, self.model.config
        logits = []
        if self.rows:  # (1) decode: every running row feeds its last sampled token
            B = len(self.rows)
            pos = torch.tensor([[r.fed] for r in self.rows])  # (B, 1)
            self.mask = torch.cat([self.mask, torch.ones(B, 1, dtype=torch.long)], dim=1)  # (B, T + 1)
            try:
                last = self._forward(torch.tensor([[r.req.output_ids[-1]] for r in self.rows]), self.mask, pos,
                                     self.cache)  # (B, V)
            except Exception as e:  # the batch's rows fail together (each client gets its error)
                for r in self.rows:
                    r.req.fail(e)
                    self._release(r)
                self.rows, self.cache, self.mask = [], None, None
            else:
                if self.capture:
                    self.slot_buf[torch.tensor([r.slot for r in self.rows]), pos[:, 0]] = self.step_buf[:B]
                for r in self.rows:
                    r.fed += 1
                logits.append(last)
        running, parts = bool(self.rows), []
        for rows, lg, state, mask in self._join(admit):  # (2) join: prefill, then into the batch
            self.rows += rows
            logits.append(lg)
            parts.append((state, mask))
        if parts:  # the new rows into the batch's spare rows, else one copy of every part into a new batch cache
            mask = append_rows(self.cache, self.mask, parts) if running else None
            if mask is not None:
                self.mask = mask
            else:
                if running:
                    parts.insert(0, (_cache_state(self.cache, slice(None), self.mask.shape[1], copy=False), self.mask))
                B = len(self.rows)
                self.cache, self.mask = _merged_cache(cfg, parts, rows=max(B, min(2 * B, self.max_batch)))
        if not self.rows:
            return
        # (3) sample every row at once; abort / stop / length / a row's own sampling error end a row
        rows = self.rows
        drawn = sample_rows(torch.cat(logits), [r.req.temperature for r in rows], [r.req.top_p for r in rows],
                            [r.req.top_k for r in rows], [r.gen for r in rows])
        keep = []
        for b, (row, res) in enumerate(zip(rows, drawn)):
            req = row.req
            if req.aborted:
                req.finish = {"type": "abort"}
            elif isinstance(res, Exception):
                req.fail(res)
                self._release(row)
                continue
            else:
                tok, lp = res
                req.output_ids.append(tok)
                req.logprobs.append(lp)
                if tok in req.stop_ids:
                    req.finish = {"type": "stop", "matched": tok}
                elif len(req.output_ids) >= req.max_new_tokens:
                    req.finish = {"type": "length", "length": req.max_new_tokens}
            if req.finish is None:
                keep.append(b)
                continue
            # (4) leave: routing out of the slot, state into the prefix cache, reply
            if self.capture:
                req.routing = self.slot_buf[row.slot, :row.fed].clone()
            if self.prefix is not None and req.finish["type"] != "abort":
                ids = req.input_ids + req.output_ids[:-1]  # what the cached state has read
                self.prefix.insert(ids, _cache_state(self.cache, slice(b, b + 1), row.fed), req.routing,
                                   supersedes=row.prefix_key)
            req.weight_version = version
            self._release(row)
            req.done.set()
        if len(keep) < len(rows):
            if not keep:
                self.rows, self.cache, self.mask = [], None, None
                return
            kept = set(keep)
            order = drop_rows(self.cache, len(rows), [b for b in range(len(rows)) if b not in kept])  # in place
            self.rows, self.mask = [rows[b] for b in order], self.mask[torch.tensor(order)]
