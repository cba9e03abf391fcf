"""The embedded inference engine's server: SGLang's HTTP protocol over a small torch model (paper: rollout
infrastructure).

T1 samples from SGLang servers started with routed-expert capture. The embedded scale serves model.py's tiny
Qwen3.5-MoE with this engine: the same `/generate` protocol (input_ids in; output_ids, logprobs, routed experts out)
and the same weight, memory and pause endpoints (/update_weights_from_disk; /init_weights_update_group +
/update_weights_from_distributed + /destroy_weights_update_group, the cluster publish over a gloo group), so
rollout.py has one client for both scales and cluster.publish.WeightPublisher can publish into it.

    python -m engine.server serve --model-path DIR --port 30000 [--max-batch 64] [--weight-dtype bf16|fp32]
                                  [--prefix-cache-mb 512] [--no-routed-experts]
    python -m experiments.bench engine     # engine vs HF generate (8 / 32 concurrent; multi-turn, cache on / off;
                                           # capture)

In-process: `EngineServer(model_path, port=0).start()` -> `.url`; `.stop()`. train_t1.py runs it inside a Ray actor
(EngineActor). The engine in files: this one (the HTTP endpoints, EngineServer, EngineActor, the command line);
engine/protocol.py (what each endpoint accepts); engine/batcher.py (continuous batching: queue, joins, decode steps,
sampling, abort; its docstring says how the engine batches and what it departs from); engine/kvcache.py (the batch's
state and the prefix cache); engine/weights.py (loading, publishing into and releasing the weights);
engine/httpjson.py (the HTTP layer, engine/gateway.py's too).

Departure from SGLang: HTTP is httpjson.JSONServer on the standard library's http.server, not SGLang's FastAPI +
uvicorn (not in the environment: installing them moves opentelemetry-api off the version Ray's SDK pins), with the
same checks answering 400.
"""
import argparse
import sys

MAX_BATCH = 64  # rows decoded together (paper silent; SGLang's default max_running_requests is larger)
PREFIX_CACHE_MB = 512  # prefix cache capacity (SGLang sizes its radix cache from free GPU memory)
MAX_PREFILL_TOKENS = 16384  # padded tokens (rows x columns) of one prefill forward (SGLang's --max-prefill-tokens)
DISCONNECT_LOG = 1024  # the last requests aborted because their client hung up (EngineServer.disconnects)


def build_parser():
    """The command line; standard library only, so that `--help` answers before torch loads."""
    p = argparse.ArgumentParser(prog="python -m engine.server", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve SGLang's /generate protocol and its weight, memory and pause endpoints",
                       description="Serve a checkpoint over SGLang's /generate protocol until interrupted.")
    s.add_argument("--model-path", required=True, help="checkpoint directory to serve (model.save_checkpoint's)")
    s.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free port)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=MAX_BATCH,
                   help="rows decoded together, SGLang's max_running_requests (default: %(default)s)")
    s.add_argument("--prefix-cache-mb", type=int, default=PREFIX_CACHE_MB,
                   help="prefix cache capacity in MiB; 0 turns the prefix cache off (default: %(default)s)")
    s.add_argument("--no-routed-experts", action="store_true", help="no routed-expert capture (SGLang without "
                   "--enable-return-routed-experts): requests asking for it get 400 (default: capture on)")
    s.add_argument("--weight-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: bf16-rounded weights in fp32 compute; fp32: the checkpoint as is (default: %(default)s)")
    s.add_argument("--forward", choices=["own", "hf"], default="own", help="own: forwards through "
                   "model.engine_forward (Qwen3-MoE; other layouts use transformers); hf: always through the "
                   "transformers forward (default: %(default)s)")
    s.add_argument("--threads", type=int, default=2,
                   help="torch CPU threads of the scheduler thread, which runs the forwards (default: %(default)s)")
    s.add_argument("--max-prefill-tokens", type=int, default=MAX_PREFILL_TOKENS, help="padded tokens of one prefill "
                   "forward (rows x the longest); more requests are prefilled in several forwards "
                   "(default: %(default)s)")
    return p


if __name__ == "__main__":
    ARGV = build_parser().parse_args()  # --help and bad flags answer here, before torch loads

import collections  # noqa: E402
import os  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import urllib.request  # noqa: E402

import torch  # noqa: E402

import infra  # noqa: E402
import r3  # noqa: E402
from engine.batcher import Batcher  # noqa: E402
from engine.httpjson import BadRequest, HTTPError, JSONHandler, JSONServer  # noqa: E402
from engine.protocol import (MEMORY_TAGS, parse_bucket, parse_disk_update, parse_generate,  # noqa: E402
                             parse_group_name, parse_init_group, parse_object, parse_rid, parse_tags)
from engine.weights import Weights, as_checkpoint  # noqa: E402
from model import load_actor  # noqa: E402


class EngineServer(Batcher):
    """SGLang-protocol server over a tiny Qwen MoE: HTTP threads in front of the Batcher it is (one scheduler
    thread, continuous batching: engine/batcher.py), its model's weights in a Weights (engine/weights.py).

    Request policy (what is refused; the gateway shares the HTTP layer, JSONHandler):
    - /generate: every field is checked before the request may join a batch (engine/protocol.py): 400
      {"error": "<field>: ..."}; also a rid already queued or running and return_routed_experts on an engine
      started without capture; 409 while memory is released (until weights are loaded again).
    - A request that still fails inside the engine gets HTTP 500 with its error (which requests fail together:
      Batcher's docstring); the scheduler goes on with the queue, so no client is left hanging. Every 500 the
      engine answers is logged on stderr with its full traceback (a request that failed on the scheduler thread:
      that thread's) and the request's rid and client (and its lengths and sampling), and counted (errors_500 in
      /health and /get_server_info).
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
        self.model_path, self.host, self.port, self.weight_dtype = model_path, host, port, weight_dtype
        model, self.tokenizer = load_actor(model_path)
        model.eval()
        self.weights = Weights(model, weight_dtype)  # rounds the weights to bf16 when served bf16
        super().__init__(model, max_batch, seed, prefix_cache_mb, capture_routing, threads, forward,
                         max_prefill_tokens)
        self.n_updates = 0
        self.disconnects = collections.deque(maxlen=DISCONNECT_LOG)  # {rid, finish, completion_tokens} per hang-up
        self.errors_500, self._errors_lock = 0, threading.Lock()  # HTTP 500 replies (/health, /get_server_info)
        self.httpd, self.threads = None, []

    # -- lifecycle (the HTTP thread and the scheduler thread) --
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

    # -- weights (SGLang's weight and memory endpoints; each runs on the scheduler thread once no request runs) --
    def update_weights(self, path, version=None, keep_path=False):
        """Load a checkpoint directory; the prefix cache is cleared (its states were computed by the old weights) and
        the version bumps (to `version`, else the count of updates). -> the new weight_version."""
        def load():
            self.weights.load(path)
            if self.prefix is not None:
                self.prefix.clear()  # its states were computed by the old weights
            if not keep_path:
                self.model_path = path
            self.closed = self.weights.refusal()
            self.n_updates += 1
            self.weight_version = str(version) if version is not None else str(self.n_updates)
            return self.weight_version
        return self.run_when_idle(load)

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
            released = self.weights.release(tags)
            self.closed = self.weights.refusal()
            return released
        return self.run_when_idle(release)

    def resume_memory(self, tags=None):
        """Take the memory back. "weights" comes back uninitialised, as SGLang's: /generate stays refused until new
        weights are loaded (/update_weights_from_disk or a complete /update_weights_from_distributed)."""
        tags = set(MEMORY_TAGS if tags is None else tags)

        def resume():
            released = self.weights.resume(tags)
            self.closed = self.weights.refusal()
            return released
        return self.run_when_idle(resume)

    def init_weight_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        """Join the trainer's weight group (Weights.join_group); blocks until every member has joined."""
        self.weights.join_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    def update_weights_from_group(self, group_name, names, dtypes, shapes, version=None):
        """Receive one bucket; once every weight of the model has arrived they replace the model's (through the
        checkpoint loader: Hub names, experts one by one, converted to the fused layout), the prefix cache is
        cleared and the version bumps. -> the new weight_version, or None while the set is incomplete."""
        state = self.weights.receive(group_name, names, dtypes, shapes)
        if state is None:
            return None
        with as_checkpoint(state, self.model.config) as d:
            return self.update_weights(d, version, keep_path=True)

    def destroy_weight_group(self, group_name):
        return self.weights.leave_group(group_name)

    def response(self, req, want_logprob=True, want_routing=True):
        """The /generate reply in SGLang's shape: text, output_ids, meta_info (finish_reason, token counts,
        cached_tokens, weight_version; output_token_logprobs and routed_experts when asked)."""
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
    """The engine's HTTP endpoints (SGLang's paths) as a JSONHandler class bound to `engine`."""
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
                body = parse_object(body)
                if self.path == "/update_weights_from_disk":
                    path, version = parse_disk_update(body)
                    try:
                        v = engine.update_weights(path, version)
                    except Exception as e:
                        self._send(400, {"success": False, "error": f"model_path: {e}", "message": str(e)})
                        return
                    self._send(200, {"success": True, "message": f"loaded {path}", "weight_version": v})
                elif self.path == "/init_weights_update_group":
                    engine.init_weight_group(*parse_init_group(body))
                    self._send(200, {"success": True, "message": "joined"})
                elif self.path == "/update_weights_from_distributed":
                    v = engine.update_weights_from_group(*parse_bucket(body))
                    self._send(200, {"success": True, "message": "applied" if v else "received",
                                     "weight_version": v or engine.weight_version})
                elif self.path == "/destroy_weights_update_group":
                    ok = engine.destroy_weight_group(parse_group_name(body))
                    self._send(200, {"success": ok})
                elif self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    tags = parse_tags(body)
                    fn = engine.release_memory if self.path.startswith("/release") else engine.resume_memory
                    self._send(200, {"success": True, "released": fn(tags)})
                elif self.path == "/pause_generation":
                    engine.pause()
                    self._send(200, {"success": True})
                elif self.path == "/continue_generation":
                    engine.resume()
                    self._send(200, {"success": True})
                elif self.path == "/abort_request":
                    rid = parse_rid(body)
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


# --- command line -------------------------------------------------------------------------------
def main(args):
    torch.set_num_threads(1)  # the main thread only loads (Batcher's docstring: one OpenMP team per process)
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
    sys.exit(main(ARGV))
