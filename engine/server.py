"""The embedded inference engine: a small torch server speaking SGLang's HTTP protocol (paper: rollout infrastructure).

T1 samples from SGLang servers started with routed-expert capture. The embedded scale serves model.py's tiny
Qwen3.5-MoE with this engine: the same `/generate` protocol (input_ids in; output_ids, logprobs, routed experts out)
and the same weight and pause endpoints (/update_weights_from_disk; /init_weights_update_group +
/update_weights_from_distributed + /destroy_weights_update_group, the cluster publish over a gloo group), so
rollout.py has one client for both scales and cluster.WeightPublisher can publish into it. Its HTTP layer
(engine/httpjson.py) is engine/gateway.py's too; the batch state and prefix cache are engine/kvcache.py.

    python -m engine.server serve --model-path DIR --port 30000 [--max-batch 64] [--weight-dtype bf16|fp32]
                           [--prefix-cache-mb 512] [--no-routed-experts]
    python -m experiments.bench engine         # engine vs HF generate (8 / 32 concurrent; multi-turn, cache on / off;
    capture)

In-process: `EngineServer(model_path, port=0).start()` -> `.url`; `.stop()`. train_t1.py runs it inside a Ray actor
(EngineActor). How the engine batches (continuous batching, a prefix cache across an agent's turns, one sampling
call per step, routed-expert capture into a preallocated buffer) and what it refuses: EngineServer's docstring.

Departures from the paper:
1. The prefix cache keeps states at the ends of finished requests (a hit needs the new input to extend a whole
   earlier trajectory, the agent's next turn), not SGLang's per-token radix tree; LRU under a byte cap. Hits are
   prefilled together only when they add the same number of tokens (a row's tokens stay contiguous in the
   left-padded batch); SGLang's ragged extend batches any.
2. Precision: the trainer runs fp32; the engine by default serves bf16-ROUNDED weights in fp32 compute
   (--weight-dtype bf16), a cheap emulation of the bf16-inference vs fp32-trainer mismatch PPO and R3 must absorb.
3. Logprobs are log-softmax(logits / temperature) (raw logits at temperature 0), before top-p truncation; top-p
   only changes which token is drawn.
4. /pause_generation waits for the running requests to finish (no abort/retract); /abort_request ends a queued or
   running request with finish_reason "abort".
5. A distributed publish is applied once every weight of the model has arrived (SGLang loads each bucket as it
   comes), through the checkpoint loader (a temporary safetensors file) for the Hub-to-fused expert conversion.
6. The running batch is one left-padded KV cache (no paged attention): while a long request runs, every row attends
   over its padded length; a row that leaves is overwritten in place by the batch's last row (kvcache.drop_rows);
   a joining row is written into the buffers' spare rows (kvcache.append_rows) unless it is wider than the batch,
   no row is spare or over half the batch's columns are padding in every row: then the batch is rebuilt (those
   columns trimmed).
7. HTTP: httpjson.JSONServer on the standard library's http.server, not SGLang's FastAPI + uvicorn (not in the
   environment: installing them moves opentelemetry-api off the version Ray's SDK pins), same checks answering 400.
"""

import argparse
import collections
import math
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid

import safetensors.torch
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import infra
import r3
from engine.httpjson import BadRequest, HTTPError, JSONHandler, JSONServer
from engine.kvcache import PrefixCache, _cache_state, _merged_cache, append_rows, drop_rows
from model import (drop_engine_layers, engine_forward, hub_state_dict, load_actor, load_weights_from_disk,
                   round_to_bf16, supports_engine_forward)

# --- embedded engine ----------------------------------------------------------------------------
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a temperature in [0, 1e-6) samples greedily (raw-logit logprobs)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed")
MEMORY_TAGS = ("weights", "kv_cache")  # SGLang's GPU memory tags
INIT_GROUP_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
UPDATE_FIELDS = ("names", "dtypes", "shapes", "group_name", "flush_cache", "weight_version")
GENERATE_FIELDS = ("input_ids", "sampling_params", "rid", "return_logprob", "return_routed_experts", "stream")
DISCONNECT_LOG = 1024  # the last requests aborted because their client hung up (EngineServer.disconnects)
MAX_PREFILL_TOKENS = 16384  # padded tokens (rows x columns) of one prefill forward (SGLang's --max-prefill-tokens)
MAX_BATCH = 64  # rows decoded together (paper silent; SGLang's default max_running_requests is larger)
PREFIX_CACHE_MB = 512  # prefix cache capacity (SGLang sizes its radix cache from free GPU memory)


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


class Request:
    def __init__(self, rid, input_ids, temperature, top_p, max_new_tokens, stop_ids, seed, top_k=-1):
        self.rid, self.input_ids = rid, input_ids
        self.temperature, self.top_p, self.top_k, self.max_new_tokens = temperature, top_p, top_k, max_new_tokens
        self.stop_ids, self.seed = stop_ids, seed
        self.want_routing = True  # return_routed_experts (the engine captures for every request when it captures)
        self.done = threading.Event()
        self.aborted, self.weight_version = False, None  # weight_version: set when the request finishes
        self.output_ids, self.logprobs, self.routing = [], [], None  # routing: (n_in + n_out - 1, L, k) int32
        self.finish, self.error = None, None  # error: this request's own failure inside the engine (-> HTTP 500)
        self.traceback = None  # the error's traceback (logged with the 500)
        self.cached_tokens = 0  # prompt tokens whose state came from the prefix cache (meta_info.cached_tokens)

    def fail(self, e):
        self.error = f"{type(e).__name__}: {e}"
        self.traceback = "".join(traceback.format_exception(e))  # a row's sampling error was never raised: one line
        self.finish = {"type": "abort", "message": f"engine error: {self.error}"}
        self.done.set()


class Row:
    """A running request's place in the batch: its sampler, tokens fed so far, and its capture slot."""

    def __init__(self, req, gen, slot):
        self.req, self.gen, self.slot = req, gen, slot
        self.fed = 0  # tokens whose state is in the cache (input + output[:-1] once decoding)
        self.prefix_key = None  # the prefix-cache entry this request extended (superseded by its own entry)


def _field(d, name, types, default=None, required=False, where=""):
    if name not in d or d[name] is None:
        if required:
            raise BadRequest(f"{where}{name}: required")
        return default
    v = d[name]
    if isinstance(v, bool) and bool not in types or not isinstance(v, types):
        raise BadRequest(f"{where}{name}: expected {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _known_fields(d, fields, where=""):
    """An unknown field is refused, never ignored (400 naming it and the fields served)."""
    for k in d:
        if k not in fields:
            raise BadRequest(f"{where}{str(k)[:50]}: not supported by this engine (fields: {', '.join(fields)})")


def _finite(d, name, default, where=""):
    v = _field(d, name, (int, float), default, where=where)
    try:
        f = float(v)
    except OverflowError:
        raise BadRequest(f"{where}{name}: out of range (an integer of {v.bit_length()} bits)") from None
    if not math.isfinite(f):
        raise BadRequest(f"{where}{name}: must be a finite number, got {f}")
    return f


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def parse_generate(body, vocab_size, max_positions, eos_id):
    """Validate a /generate body -> Request; BadRequest names the offending field. Every check happens here,
    before the request can join a batch."""
    if body is None:
        raise BadRequest("body: empty (is Content-Length missing?); expected a JSON object")
    if not isinstance(body, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    _known_fields(body, GENERATE_FIELDS)
    ids = _field(body, "input_ids", (list,), required=True)
    if not ids or not all(_is_int(i) and 0 <= i < vocab_size for i in ids):
        raise BadRequest(f"input_ids: expected a non-empty list of token ids in [0, {vocab_size})")
    if _field(body, "stream", (bool,), False):
        raise BadRequest("stream: not supported by this engine")
    sp = _field(body, "sampling_params", (dict,), default={})
    w = "sampling_params."
    _known_fields(sp, SAMPLING_FIELDS, where=w)
    temperature = _finite(sp, "temperature", 1.0, where=w)
    if temperature < 0 or 0 < temperature < sys.float_info.min:
        raise BadRequest(f"{w}temperature: must be 0 or a normal float > 0, got {temperature!r}")
    if temperature < GREEDY_BELOW:
        temperature = 0.0  # greedy, as SGLang
    top_p = _finite(sp, "top_p", 1.0, where=w)
    if not 0 < top_p <= 1:
        raise BadRequest(f"{w}top_p: must be in (0, 1], got {top_p}")
    top_k = _field(sp, "top_k", (int,), -1, where=w)
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"{w}top_k: must be -1 (off) or >= 1, got {top_k}")
    max_new = _field(sp, "max_new_tokens", (int,), 128, where=w)
    if max_new < 1 or len(ids) + max_new > max_positions:
        raise BadRequest(f"{w}max_new_tokens: must be >= 1 and len(input_ids) + max_new_tokens "
                         f"<= {max_positions}, got {max_new} with {len(ids)} input ids")
    stop = _field(sp, "stop_token_ids", (list,), [], where=w)
    if not all(_is_int(i) and 0 <= i < vocab_size for i in stop):
        raise BadRequest(f"{w}stop_token_ids: expected a list of token ids in [0, {vocab_size})")
    seed = _field(sp, "seed", (int,), None, where=w)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise BadRequest(f"{w}seed: must be in [0, 2**64 - 1], got {seed}")
    stop_ids = set(stop)
    if not _field(sp, "ignore_eos", (bool,), False, where=w):
        stop_ids.add(eos_id)
    rid = _field(body, "rid", (str,), None) or uuid.uuid4().hex
    for flag in ("return_logprob", "return_routed_experts"):
        _field(body, flag, (bool,), False)
    req = Request(rid, ids, temperature, top_p, max_new, stop_ids, seed, top_k)
    req.want_routing = bool(body.get("return_routed_experts", False))
    return req


class EngineServer:
    """SGLang-protocol server over a tiny Qwen MoE: HTTP threads + one scheduler thread (continuous batching).

    Scheduler, one iteration = one decode step of the running batch: (1) the running rows are decoded together
    (one token each, left-padded KV + attention mask + explicit position ids); (2) queued requests join while the
    batch has room (max_batch): requests whose ids extend prefix-cache entries by the same number of new tokens are
    prefilled together on top of their entries' states (only the new suffixes are forwarded), the others together,
    left-padded, in forwards of at most max_prefill_tokens padded tokens; their states are merged into the batch;
    (3) one batched sampling call (sample_rows) draws the next token of every row; (4) a row that stops leaves at
    once, its state saved in the prefix cache (PrefixCache: the agent's next turn re-sends this trajectory plus the
    tool output). Requests never wait for a wave. Weight reloads (and /pause_generation) stop admission and wait for
    the running rows to finish, so one request sees one weight_version; a reload clears the prefix cache.
    Routed experts (SGLang's --enable-return-routed-experts; capture_routing=False turns capture off): every
    forward's top-k ids are copied by the routers into one preallocated buffer (r3.routing(..., into=)), then in
    one indexed copy into each row's slot of a (max_batch, max_positions, L, k) int32 buffer; row j = the experts
    chosen when token j was the input (prompt rows from prefill or from the prefix cache, which keeps the rows the
    first forward computed; output rows from decode steps; the last output token is never forwarded, so a
    request returns len(input) + len(output) - 1 rows).

    Threads: every forward runs on the scheduler thread with `threads` torch (OpenMP) threads, set there: OpenMP's
    thread count is per calling thread, and a second thread's multi-threaded ops run 3-4x slower when the process's
    main thread already owns a team of OpenMP workers (a decode step of 8 rows: 2.6 ms with one team, 10 ms with
    two; 3.1 ms single-threaded; RESULTS.md). So the default is 1 (safe in any process: tests, benchmarks beside HF
    on the main thread); `engine/server.py serve` and EngineActor, which own their process, keep the main thread at one
    thread and give the scheduler `--threads`.

    The forwards of a Qwen3-MoE model go through model.engine_forward (forward="own": the engine's own forward, as
    SGLang has its own model code; fewer operations than the transformers forward, logits equal to ~1e-6); other
    layouts (Qwen3.5's hybrid), or forward="hf", through the transformers forward.

    Request policy (what is refused; the gateway shares the HTTP layer, JSONHandler):
    - /generate: every field is checked before the request may join a batch; 400 {"error": "<field>: ..."} for
      input_ids not a non-empty list of ints in [0, vocab); temperature not finite, negative or denormal
      (0 <= t < GREEDY_BELOW = 1e-6 is greedy, SGLang's rule); top_p outside (0, 1]; top_k not -1 or >= 1;
      max_new_tokens < 1 or past the context; stop_token_ids not ids in [0, vocab); seed outside [0, 2**64 - 1];
      a rid already queued or running; stream; return_routed_experts on an engine started without capture; any
      field SGLang has that this engine does not implement (GENERATE_FIELDS / SAMPLING_FIELDS list what is
      served: an unknown field is refused, never ignored).
    - A request that still fails inside the engine fails alone where it can: its prefill or seeding (before it
      joins the batch), or its row's sampling. A batched decode forward that raises fails the rows running in it,
      and any other fault of a step fails every running request (each gets HTTP 500 with the error); the
      scheduler goes on with the queue, so no client is left hanging. Every 500 the engine answers is logged on
      stderr with its full traceback (a request that failed on the scheduler thread: that thread's) and the
      request's rid and client (and its lengths and sampling), and counted (errors_500 in /health and
      /get_server_info).
    - Body framing: Transfer-Encoding 411; Content-Length not one non-negative integer 400; over MAX_BODY_BYTES
      (8 MiB) 413, unread; shorter than announced 400 (client closed) or 408 (the whole request not arrived within
      httpjson.READ_TIMEOUT_S = 30 s of its first byte; it waits in httpjson's waiting room, holding no thread);
      not JSON (or > 4300-digit integers, deep nesting, bad UTF-8) 400. No Content-Length = empty body.
    - Listen backlog LISTEN_BACKLOG = 1024 (>= the paper's 560 trials per step); a client that hangs up mid-request
      has its generation aborted (EngineServer.disconnects logs each such request); /health answers 503 when the
      scheduler thread is not running.
    """

    def __init__(self, model_path, host="127.0.0.1", port=0, max_batch=MAX_BATCH, weight_dtype="bf16", seed=0,
                 prefix_cache_mb=PREFIX_CACHE_MB, capture_routing=True, threads=1, forward="own",
                 max_prefill_tokens=MAX_PREFILL_TOKENS):
        if weight_dtype not in ("bf16", "fp32"):
            raise ValueError(f"weight_dtype: expected bf16|fp32, got {weight_dtype!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch: must be >= 1, got {max_batch}")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb: must be >= 0 (0 = off), got {prefix_cache_mb}")
        if threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        if forward not in ("own", "hf"):
            raise ValueError(f"forward: expected own|hf, got {forward!r}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens: must be >= 1, got {max_prefill_tokens}")
        self.torch_threads = threads  # torch (OpenMP) threads of the scheduler thread: the class docstring
        self.model_path, self.host, self.port = model_path, host, port
        self.max_batch, self.weight_dtype = max_batch, weight_dtype
        self.model, self.tokenizer = load_actor(model_path)
        self.model.eval()
        self.own_forward = forward == "own" and supports_engine_forward(self.model)  # model.engine_forward
        if weight_dtype == "bf16":
            round_to_bf16(self.model)
        cfg = self.model.config
        self.num_layers, self.top_k = len(r3.routers(self.model)), cfg.num_experts_per_tok
        self.capture, self._capture_ctx = capture_routing, None
        self.hub_shapes = {k: tuple(v.shape) for k, v in hub_state_dict(self.model).items()}  # what a publish sends
        self.hub_bytes = 4 * sum(math.prod(s) for s in self.hub_shapes.values())
        self.weight_groups, self.pending = {}, {}  # group name -> process group; -> tensors received so far
        self.max_prefill_tokens = max_prefill_tokens
        n_max = max(cfg.max_position_embeddings, max_batch, max_prefill_tokens)  # the most token rows of a forward
        self.step_buf = torch.zeros(n_max, self.num_layers, self.top_k, dtype=torch.int32)  # one forward's ids
        self.slot_buf = torch.empty(max_batch, cfg.max_position_embeddings, self.num_layers, self.top_k,
                                    dtype=torch.int32)  # per running row: its routed experts so far
        self.free_slots = list(range(max_batch))[::-1]
        self.prefix = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb > 0 else None
        self.weight_version, self.n_updates = "0", 0
        self.gen = torch.Generator().manual_seed(seed)
        self.queue = []  # waiting Requests
        self.commands = queue.Queue()  # (fn, result dict, Event) run when nothing is running
        self.cv = threading.Condition()
        self.paused, self.stopping = False, False
        self.released, self.weights_stale = set(), False  # /release_memory_occupation tags; weights not reloaded
        self.running = {}  # rid -> Request admitted and not finished
        self.rows, self.cache, self.mask = [], None, None  # the running batch: Rows, DynamicCache, (B, T) mask
        self.disconnects = collections.deque(maxlen=DISCONNECT_LOG)  # {rid, finish, completion_tokens} per hang-up
        self.prefill_splits = collections.deque(maxlen=DISCONNECT_LOG)  # why a group prefill was re-run one by one
        self.errors_500, self._errors_lock = 0, threading.Lock()  # HTTP 500 replies (/health, /get_server_info)
        self.httpd, self.threads = None, []

    # -- lifecycle --
    @property
    def url(self):
        return f"http://{self.host}:{self.httpd.server_address[1]}"

    def start(self):
        self.httpd = JSONServer((self.host, self.port), _make_handler(self))
        self.threads = [threading.Thread(target=self.httpd.serve_forever, daemon=True),
                        threading.Thread(target=self._scheduler, daemon=True)]
        for t in self.threads:
            t.start()
        deadline = time.time() + 30
        while True:  # return when healthy
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"engine at {self.url} did not become healthy")
                time.sleep(0.05)

    def stop(self):
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        for t in self.threads:
            t.join(timeout=30)

    def health(self):
        """None when serving, else why not (/health answers 503 with it)."""
        if self.stopping:
            return "engine is stopping"
        if len(self.threads) < 2 or not self.threads[1].is_alive():
            return "the scheduler thread is not running"
        return None

    def report_500(self, what, error, tb):
        """Count an HTTP 500 reply and log it on stderr: `what` (the endpoint and the request's identity), the error
        and its full traceback (for a request that failed on the scheduler thread, that thread's)."""
        with self._errors_lock:
            self.errors_500 += 1
            n = self.errors_500
        print(f"[engine] HTTP 500 (#{n}) {what}: {error}\n{(tb or '').rstrip()}", file=sys.stderr, flush=True)

    def cache_stats(self):
        p = self.prefix
        return {"enabled": p is not None, "hits": p.hits if p else 0, "misses": p.misses if p else 0,
                "hit_tokens": p.hit_tokens if p else 0, "entries": len(p.entries) if p else 0,
                "bytes": p.bytes if p else 0}

    # -- called from HTTP threads --
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
            if self.released or self.weights_stale:
                raise HTTPError(409, f"engine: memory released ({', '.join(sorted(self.released)) or 'weights'}); "
                                "POST /resume_memory_occupation, then load weights, before /generate")
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

    def update_weights(self, path, version=None, keep_path=False):
        def load():
            if "weights" in self.released:
                raise HTTPError(409, "weights: released; POST /resume_memory_occupation before loading weights")
            load_weights_from_disk(self.model, path)
            if self.weight_dtype == "bf16":
                round_to_bf16(self.model)
            drop_engine_layers(self.model)  # engine_forward's copies are rebuilt from the new weights
            if self.prefix is not None:
                self.prefix.clear()  # its states were computed by the old weights
            if not keep_path:
                self.model_path = path
            self.weights_stale = False
            self.n_updates += 1
            self.weight_version = str(version) if version is not None else str(self.n_updates)
            return self.weight_version
        return self.run_when_idle(load)

    # -- memory (SGLang's /release_memory_occupation, /resume_memory_occupation: the colocated preset) --
    def release_memory(self, tags=None):
        """Give the device memory to a colocated trainer: "kv_cache" drops the prefix cache's states, "weights" frees
        the parameters' storage (tags None: both). Runs when no request is running; refused while requests wait.
        A released engine refuses /generate (409) until resumed."""
        tags = set(MEMORY_TAGS if tags is None else tags)

        def release():
            if self.queue:
                raise HTTPError(409, f"engine: {len(self.queue)} requests waiting; finish or abort them first")
            if "kv_cache" in tags and self.prefix is not None:
                self.prefix.clear()
            if "weights" in tags and "weights" not in self.released:
                self._weight_shapes = {p: (tuple(p.shape), p.dtype) for p in self.model.parameters()}
                for p in self._weight_shapes:
                    p.data = torch.empty(0, dtype=p.dtype)
                drop_engine_layers(self.model)  # engine_forward's copies of the weights go too
            self.released |= tags
            return sorted(self.released)
        return self.run_when_idle(release)

    def resume_memory(self, tags=None):
        """Take the memory back. "weights" comes back uninitialised, as SGLang's: /generate stays refused until new
        weights are loaded (/update_weights_from_disk or a complete /update_weights_from_distributed)."""
        tags = set(MEMORY_TAGS if tags is None else tags)

        def resume():
            if "weights" in tags and "weights" in self.released:
                for p, (shape, dtype) in self._weight_shapes.items():
                    p.data = torch.empty(shape, dtype=dtype)
                self.weights_stale = True
            self.released -= tags
            return sorted(self.released)
        return self.run_when_idle(resume)

    def set_capture(self, on: bool):
        """Routed-expert capture on / off (experiments/bench.py's overhead measurement); clears the prefix cache."""
        def flip():
            self.capture = bool(on)
            self._capture_context(self.capture)
            if self.prefix is not None:
                self.prefix.clear()
        return self.run_when_idle(flip)

    # -- weights over a process group (SGLang's /init_weights_update_group, /update_weights_from_distributed) --
    def init_weight_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        """Join the trainer's weight group as rank rank_offset (this engine is one rank: TP 1). Blocks until every
        member has joined (the trainer joins as rank 0 at the same time)."""
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend: nccl needs CUDA; this engine runs on the CPU (use gloo)")
        if group_name in self.weight_groups:  # a trainer that died without /destroy_weights_update_group: its
            self.destroy_weight_group(group_name)  # successor (a resumed run) takes the name over
        self.weight_groups[group_name] = infra.init_update_group(master_address, master_port, rank_offset,
                                                                 world_size, group_name, backend)
        self.pending[group_name] = {}

    def update_weights_from_group(self, group_name, names, dtypes, shapes, version=None):
        """Receive one bucket: every tensor is received (broadcast from rank 0) even when the bucket is refused, so
        the group stays in step; once every weight of the model has arrived they replace the model's (through
        the checkpoint loader: Hub names, experts one by one, converted to the fused layout), the prefix cache is
        cleared and the version bumps. -> the new weight_version, or None while the set is incomplete."""
        import torch.distributed as dist
        announced = sum(math.prod(shape) * getattr(torch, dt).itemsize for dt, shape in zip(dtypes, shapes))
        if announced > 2 * self.hub_bytes:  # refused before anything is allocated or received
            raise BadRequest(f"shapes: the bucket announces {announced} bytes, over twice the model's "
                             f"{self.hub_bytes} (fp32)")
        if group_name not in self.weight_groups:
            raise BadRequest(f"group_name: {group_name!r} was not joined (POST /init_weights_update_group first)")
        pg, got, want = self.weight_groups[group_name], self.pending[group_name], self.hub_shapes
        errors = []
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=getattr(torch, dt))
            dist.broadcast(t, src=0, group=pg)
            if name not in want:
                errors.append(f"names: {name!r} is not a weight of this model")
            elif tuple(shape) != want[name]:
                errors.append(f"shapes: {name} is {tuple(shape)}, the model's is {want[name]}")
            got[name] = t
        if errors:
            got.clear()  # nothing of a refused publish is applied
            raise BadRequest("; ".join(errors[:3]))
        if set(got) != set(want):
            return None
        state, self.pending[group_name] = dict(got), {}
        with tempfile.TemporaryDirectory(prefix="t1_engine_weights_") as d:
            safetensors.torch.save_file({k: v.float().contiguous() for k, v in state.items()},
                                        os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
            self.model.config.save_pretrained(d)
            return self.update_weights(d, version, keep_path=True)

    def destroy_weight_group(self, group_name):
        import torch.distributed as dist
        pg = self.weight_groups.pop(group_name, None)
        self.pending.pop(group_name, None)
        if pg is None:
            return False
        dist.destroy_process_group(pg)
        return True

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
        buffer failed and was re-run one by one, twice the prefill time at 32 concurrent requests (RESULTS.md
        2026-12-03)."""
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

    def response(self, req, want_logprob=True, want_routing=True):
        n_in, n_out = len(req.input_ids), len(req.output_ids)
        meta = {"id": req.rid, "finish_reason": req.finish, "prompt_tokens": n_in, "completion_tokens": n_out,
                "cached_tokens": req.cached_tokens, "weight_version": req.weight_version or self.weight_version}
        if want_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, req.output_ids)]
        if want_routing:
            rows = req.routing[:max(n_in + n_out - 1, 0)] if req.routing is not None else \
                torch.zeros(0, self.num_layers, self.top_k, dtype=torch.int32)
            meta["routed_experts"] = r3.encode_routed_experts(rows.numpy())  # (n_in + n_out - 1, L, k)
        return {"text": self.tokenizer.decode(req.output_ids), "output_ids": req.output_ids, "meta_info": meta}


def _make_handler(engine):
    class Handler(JSONHandler):
        def _who(self):
            return f"client={self.client_address[0]}:{self.client_address[1]}"

        def fault(self, e, body=None):
            """A server fault: HTTP 500 naming it (never a dropped connection), logged with its traceback and the
            request's rid, counted. Called after the except block: httpjson logs a 5xx sent inside one with the
            traceback again."""
            rid = body.get("rid") if isinstance(body, dict) else None
            engine.report_500(f"{self.command} {self.path[:200]} rid={str(rid)[:100]} {self._who()}",
                              f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))
            self._send(500, {"error": f"engine: {type(e).__name__}: {e}"})

        def do_GET(self):
            try:
                return self._get()
            except Exception as e:
                fault = e
            self.fault(fault)

        def _get(self):
            if self.path == "/health":
                why = engine.health()
                body = {"status": "unhealthy", "error": why} if why else {"status": "ok"}
                self._send(503 if why else 200, {**body, "errors_500": engine.errors_500})
            elif self.path == "/get_server_info":  # SGLang's endpoint; here the settings and the prefix cache
                self._send(200, {"max_running_requests": engine.max_batch, "torch_threads": engine.torch_threads,
                                 "weight_dtype": engine.weight_dtype, "routed_experts": engine.capture,
                                 "forward": "own" if engine.own_forward else "hf",
                                 "max_prefill_tokens": engine.max_prefill_tokens,
                                 "prefill_splits": list(engine.prefill_splits)[-8:],
                                 "errors_500": engine.errors_500,
                                 "prefix_cache": engine.cache_stats()})
            elif self.path == "/get_model_info":
                self._send(200, {"model_path": engine.model_path, "weight_version": engine.weight_version,
                                 "num_moe_layers": engine.num_layers, "top_k": engine.top_k,
                                 "vocab_size": engine.model.config.vocab_size})
            else:
                self._send(404, {"error": f"path: unknown endpoint {self.path[:200]}"})

        def generate(self, body):
            cfg = engine.model.config
            req = parse_generate(body, cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id)
            if req.want_routing and not engine.capture:
                raise BadRequest("return_routed_experts: this engine runs without routed-expert capture")
            gone = []

            def hung_up():  # the client closed its connection: stop generating for it
                req.aborted = True  # (if it has not reached the queue yet, submit() ends it)
                gone.append(engine.abort(req.rid))
            with self.on_disconnect(hung_up):
                engine.submit(req)
            if gone:
                engine.disconnects.append({"rid": req.rid, "finish": (req.finish or {}).get("type"),
                                           "completion_tokens": len(req.output_ids)})
                self.close_connection = True
                return
            if req.error:  # raised on the scheduler thread: that thread's traceback
                engine.report_500(f"POST /generate rid={req.rid[:100]} {self._who()} "
                                  f"prompt_tokens={len(req.input_ids)} cached_tokens={req.cached_tokens} "
                                  f"completion_tokens={len(req.output_ids)} max_new_tokens={req.max_new_tokens} "
                                  f"temperature={req.temperature} seed={req.seed}",
                                  req.error, req.traceback)
                return self._send(500, {"error": f"engine: {req.error}"})
            self._send(200, engine.response(req, bool(body.get("return_logprob", False)),
                                            bool(body.get("return_routed_experts", False))))

        def do_POST(self):
            body, fault = None, None
            try:
                body = self.read_json()
                if self.path == "/generate":
                    return self.generate(body)
                body = {} if body is None else body
                if not isinstance(body, dict):
                    raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
                if self.path == "/update_weights_from_disk":
                    path = _field(body, "model_path", (str,), required=True)
                    if not os.path.isdir(path):
                        raise BadRequest(f"model_path: not a directory: {path!r}")
                    version = _field(body, "weight_version", (str, int), None)
                    try:
                        v = engine.update_weights(path, version)
                    except Exception as e:
                        self._send(400, {"success": False, "error": f"model_path: {e}", "message": str(e)})
                        return
                    self._send(200, {"success": True, "message": f"loaded {path}", "weight_version": v})
                elif self.path == "/init_weights_update_group":
                    _known_fields(body, INIT_GROUP_FIELDS)
                    engine.init_weight_group(
                        _field(body, "master_address", (str,), required=True),
                        _field(body, "master_port", (int,), required=True),
                        _field(body, "rank_offset", (int,), required=True),
                        _field(body, "world_size", (int,), required=True),
                        _field(body, "group_name", (str,), "weight_update_group"),
                        _field(body, "backend", (str,), "nccl"))
                    self._send(200, {"success": True, "message": "joined"})
                elif self.path == "/update_weights_from_distributed":
                    _known_fields(body, UPDATE_FIELDS)
                    names = _field(body, "names", (list,), required=True)
                    dtypes = _field(body, "dtypes", (list,), required=True)
                    shapes = _field(body, "shapes", (list,), required=True)
                    if not (len(names) == len(dtypes) == len(shapes)) or not all(
                            isinstance(n, str) for n in names) or not all(
                            d in ("float32", "bfloat16", "float16") for d in dtypes) or not all(
                            isinstance(sh, list) and all(_is_int(x) and 0 <= x < 2**31 for x in sh) for sh in shapes):
                        raise BadRequest("names / dtypes / shapes: expected lists of equal length of names, "
                                         "float32|bfloat16|float16 and lists of non-negative ints")
                    version = _field(body, "weight_version", (str,), None)
                    v = engine.update_weights_from_group(_field(body, "group_name", (str,), "weight_update_group"),
                                                         names, dtypes, shapes, version)
                    self._send(200, {"success": True, "message": "applied" if v else "received",
                                     "weight_version": v or engine.weight_version})
                elif self.path == "/destroy_weights_update_group":
                    ok = engine.destroy_weight_group(_field(body, "group_name", (str,), "weight_update_group"))
                    self._send(200, {"success": ok})
                elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    _known_fields(body, ("tags",))
                    tags = _field(body, "tags", (list,), None)
                    if tags is not None and (not tags or not all(t in MEMORY_TAGS for t in tags)):
                        raise BadRequest(f"tags: expected a non-empty list of {'|'.join(MEMORY_TAGS)}, got {tags!r}")
                    fn = engine.release_memory if self.path.startswith("/release") else engine.resume_memory
                    self._send(200, {"success": True, "released": fn(tags)})
                elif self.path == "/pause_generation":
                    engine.pause()
                    self._send(200, {"success": True})
                elif self.path == "/continue_generation":
                    engine.resume()
                    self._send(200, {"success": True})
                elif self.path == "/abort_request":
                    rid = _field(body, "rid", (str,), required=True)
                    self._send(200, {"success": engine.abort(rid)})
                else:
                    self._send(404, {"error": f"path: unknown endpoint {self.path[:200]}"})
            except HTTPError as e:
                self.send_error_json(e)
            except Exception as e:  # a server fault: answered (named, logged, counted) below
                fault = e
            if fault is not None:
                self.fault(fault, body)

    return Handler


class EngineActor:
    """The embedded engine (EngineServer) inside a Ray actor; spoken to only over HTTP, like SGLang."""

    def __init__(self, model_path: str, weight_dtype: str = "bf16", threads: int = 2, host: str = "127.0.0.1",
                 cores=None):
        if cores:  # --pin-cores: the rollout side's half of the cores
            infra.pin(cores)
        torch.set_num_threads(1)  # the main thread only loads; the scheduler thread runs with `threads`
        self.server = EngineServer(model_path, host=host, port=0, weight_dtype=weight_dtype, threads=threads).start()

    def info(self) -> dict:
        return {"url": self.server.url, "pid": os.getpid()}

    def stop(self) -> None:
        self.server.stop()


# --- CLI ----------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve SGLang's /generate protocol")
    s.add_argument("--model-path", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--max-batch", type=int, default=MAX_BATCH)
    s.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB, help="0 turns the prefix cache off")
    s.add_argument("--no-routed-experts", action="store_true", help="no routed-expert capture (SGLang without "
                   "--enable-return-routed-experts): requests asking for it get 400")
    s.add_argument("--weight-dtype", choices=["bf16", "fp32"], default="bf16")
    s.add_argument("--forward", choices=["own", "hf"], default="own", help="forwards through model.engine_forward "
                   "(Qwen3-MoE; other layouts use transformers) or always through the transformers forward")
    s.add_argument("--threads", type=int, default=2, help="torch CPU threads of the scheduler thread (the forwards)")
    s.add_argument("--max-prefill-tokens", type=int, default=MAX_PREFILL_TOKENS, help="padded tokens of one prefill "
                   "forward (rows x the longest); more requests are prefilled in several forwards")
    args = p.parse_args()
    torch.set_num_threads(1)  # the main thread only loads (EngineServer's docstring: one OpenMP team per process)
    engine = EngineServer(args.model_path, args.host, args.port, args.max_batch, args.weight_dtype,
                          prefix_cache_mb=args.prefix_cache_mb, capture_routing=not args.no_routed_experts,
                          threads=args.threads, forward=args.forward,
                          max_prefill_tokens=args.max_prefill_tokens).start()
    print(f"engine serving {args.model_path} at {engine.url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        engine.stop()


if __name__ == "__main__":
    main()
