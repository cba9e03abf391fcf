"""Token gateway: an OpenAI-compatible /v1/chat/completions in front of any /generate engine; its command line also
runs Harbor's stock Terminus-2 through it (one trial, or a dataset with the paper's protocol: sandbox/harbor_run.py).

Paper section "TITO" (T1, arXiv 2609.11042): text harnesses (Terminus-2 over an OpenAI client) re-send
the whole conversation as text every turn; re-encoding it changes token ids the sampler produced. The
gateway is where that is fixed: it renders the messages with the pinned chat template (model.py's
tokenizer), keeps each trial's token history, and in TITO mode splices the recorded ids back in
wherever the incoming text extends the recorded history (prompt_i + reply_i), so only the new
message text is encoded. Naive mode re-encodes the whole rendered history each turn (what a plain
OpenAI-compatible server does). Per turn it records prompt ids, output ids, logprobs and routed
experts in rollout.run_trial's record format, so tito.assemble_segments consumes them and the four
boundary cases (tito.py) happen here in practice.

Sessions: keyed by the client's session id (header X-Session-ID, body `session_id` (Harbor's LiteLLM sends both),
`user`, or `metadata.session_id`), else by the longest recorded history that prefixes the incoming text, else
new. One idle past SESSION_IDLE_S or the least recently used past MAX_SESSIONS is evicted with a line on stderr;
trial() / pop() of an evicted session raise SessionEvicted (never an empty trial).

Request policy (OpenAI's error shape, engine/openai_api.py's APIError; the HTTP layer is httpjson.JSONHandler):
the refusals of openai_api.parse_chat (400 naming the field, 400 unsupported_parameter, 404 model_not_found);
body framing errors as the engine's (411 / 400 / 413 / 408); 400 for a body that is not UTF-8, nesting over
httpjson.MAX_JSON_DEPTH; 503 server_busy over httpjson.MAX_CONNECTIONS open connections (httpjson's deadlines);
503 when the engine cannot be reached or aborted the request, 502 when it answered with an error; every 5xx is
logged on stderr with its traceback (httpjson.JSONHandler.log_5xx). GET /health is 200 only when the engine's
/health is; a client that hangs up has its engine request aborted (Gateway.disconnects) and nothing is recorded for it.
`stop`: the reply ends before the first stop string, finish_reason "stop"; the record keeps the sampled ids through
the token that completes it (Gateway._cut_at_stop).

Response: OpenAI chat.completion; with `logprobs: true` also `choices[0].logprobs.content[].logprob`; with
`return_token_ids: true` (what Harbor's LiteLLM client sends under collect_rollout_details) also
`choices[0].token_ids` (LiteLLM exposes it as provider_specific_fields["token_ids"]) and top-level
`prompt_token_ids` (the vLLM fields Harbor reads).

Run:
    python -m engine.gateway serve --engine-url URL --model-path DIR [--mode tito|naive] [--port 8000]
    python -m engine.gateway harbor-trial --task DIR --engine-url URL --model-path DIR   # one Harbor trial
    python -m engine.gateway eval --dataset DIR --engine-url URL --model-path DIR [--attempts 3]
        # the paper's protocol (rollout.EVAL): solve_rate, reward_mean (r = P/S) over n_trials = tasks x attempts
        # (a failed trial counts 0), errors; exit statuses: main
    python -m experiments.bench tito --quick [--harness client|harbor]     # naive vs TITO, one JSON line
In code: Gateway(engine_url, tokenizer, mode).start() -> .url; .pop(session_id) -> {"records": [...]};
engine.client.chat_completion(gw.url, messages, session_id) is a minimal client of it; rollout.run_text_trial and
sandbox.harbor_run.run_harbor_trial run trials through it (rollout.run_trial's result).

Departures:
  1. One sampled completion per request (n = 1), no streaming, no tools/function calling: Terminus-2
     needs none of them (each is refused with 400). `max_tokens` is clipped to the context left (max_total_tokens).
     `stop` strings are found after generation (the engine stops at <|im_end|> or max_tokens), not per step.
  2. The embedded model is tiny and random-init in `experiments/bench.py tito`, so its replies are mostly unparseable;
     that is fine for the measurement (every reply is re-sent as history either way) and makes
     non-canonical token sequences, and hence naive drift, frequent.
  3. Message content is text, never control (paper silent): a control token's text in content (`<|im_end|>`,
     `<|im_start|>`: the tokenizer's special tokens and those the template writes) is encoded as ordinary tokens,
     as transformers' sanitize_control_tokens does; the template's own markers stay control ids (Gateway.mark,
     encode_text). Content without such text encodes as before; TITO splices the sampled ids as before.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.parse
import uuid


def build_parser() -> argparse.ArgumentParser:
    """The command line: serve | harbor-trial | eval (standard library only: --help answers before torch loads)."""
    p = argparse.ArgumentParser(prog="python -m engine.gateway", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    helps = {"serve": "serve the OpenAI-compatible gateway in front of an engine until stopped",
             "harbor-trial": "one Harbor Terminus-2 trial through a gateway of its own; prints one JSON line",
             "eval": "Harbor's Terminus-2 on every task of a Harbor dataset with the paper's protocol (rollout.EVAL)"}
    for name in ("serve", "harbor-trial", "eval"):
        s = sub.add_parser(name, help=helps[name], description=helps[name])
        s.add_argument("--engine-url", required=True, help="the SGLang-protocol engine, e.g. engine/server.py's")
        s.add_argument("--model-path", required=True, help="directory with the tokenizer")
        s.add_argument("--max-total-tokens", type=int, default=8192,
                       help="prompt + output tokens of one conversation (default: %(default)s)")
        if name == "serve":
            s.add_argument("--mode", choices=["tito", "naive"], default="tito",
                           help="tito: splice the recorded ids back in; naive: re-encode the whole history "
                                "(default: %(default)s)")
            s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
            s.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
        if name == "harbor-trial":
            s.add_argument("--task", required=True, help="a Harbor / Terminal-Bench 2 task directory")
            s.add_argument("--trials-dir", default="runs/harbor-trials",
                           help="where Harbor writes the trial directory (default: %(default)s)")
            s.add_argument("--max-turns", type=int, default=50, help="Terminus-2's turn limit (default: %(default)s)")
        if name in ("harbor-trial", "eval"):
            s.add_argument("--harbor-venv", default=None,
                           help="Harbor's venv (Python >= 3.12, harbor) (default: .venv-harbor in the repository)")
        if name == "eval":
            s.add_argument("--dataset", required=True, help="a Harbor dataset dir (one task dir per entry)")
            s.add_argument("--trials-dir", default="runs/harbor-eval",
                           help="where Harbor writes the trial directories (default: %(default)s)")
            s.add_argument("--attempts", type=int, default=None,
                           help="attempts per task (default: the paper's protocol, rollout.EVAL: 3)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, parsed and checked (standard library only): bad flags exit 2 before torch loads."""
    p = build_parser()
    a = p.parse_args(argv)
    if a.cmd == "eval" and a.attempts is not None and a.attempts < 1:
        p.error(f"--attempts: must be >= 1, got {a.attempts}")
    return a


if __name__ == "__main__":
    ARGV = parse_args()  # --help and bad flags answer here, before torch loads

import rollout  # noqa: E402
from chat_tokens import IM_END  # noqa: E402
from engine import httpjson  # noqa: E402
from engine.openai_api import MODEL_ID, APIError, ContextLengthExceeded, content_text, parse_chat  # noqa: E402
from engine.client import EngineClient  # noqa: E402
from sandbox import harbor_run  # noqa: E402


# --- the gateway -------------------------------------------------------------------------------------
MAX_SESSIONS = 2048  # recorded trials kept at once: > the paper's 560 trials per step x 2 steps in flight (one-step
# async) + an evaluation's; past it the least recently used session is evicted
SESSION_IDLE_S = 7200.0  # a session idle this long is evicted: > the paper's 3600 s agent + 900 s verifier timeouts,
# so only sessions nobody popped (a crashed harness, a plain OpenAI client) are dropped
# Around a control token's text inside message content (render / encode_text): lone surrogates, which no request can
# hold (httpjson.check_json refuses them, openai_api.content_text too), so a client cannot forge a mark either.
MARK_OPEN, MARK_CLOSE = "\ud800", "\ud801"
_MARKED = re.compile(f"{MARK_OPEN}(.*?){MARK_CLOSE}", re.S)


class SessionEvicted(LookupError):
    """trial() / pop() of a session the gateway evicted (its records are gone): never an empty trial."""


class Gateway:
    """OpenAI-compatible chat completions over an SGLang-style /generate engine, recording token ids."""

    def __init__(self, engine_url, tokenizer, mode="tito", max_total_tokens=8192, max_new_tokens=512,
                 host="127.0.0.1", port=0, max_sessions=MAX_SESSIONS, session_idle_s=SESSION_IDLE_S):
        if mode not in ("tito", "naive"):
            raise ValueError(f"mode: expected tito|naive, got {mode!r}")
        if max_sessions < 1 or not session_idle_s > 0:
            raise ValueError(f"max_sessions / session_idle_s: must be >= 1 / > 0, got {max_sessions} / "
                             f"{session_idle_s}")
        self.client, self.tok, self.mode = EngineClient(engine_url), tokenizer, mode
        self.max_total_tokens, self.max_new_tokens = max_total_tokens, max_new_tokens
        self.max_sessions, self.session_idle_s = max_sessions, session_idle_s
        self.im_end = tokenizer.convert_tokens_to_ids(IM_END)
        # control tokens: the special added tokens and the added tokens the chat template writes (as transformers'
        # sanitize_control_tokens picks them); their text in message content is encoded as ordinary text
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.control = sorted({t.content for t in tokenizer.added_tokens_decoder.values()
                               if t.special or t.content in template}, key=len, reverse=True)
        self.control_ids = {tokenizer.convert_tokens_to_ids(t) for t in self.control}
        self.control_re = re.compile("|".join(map(re.escape, self.control))) if self.control else None
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        if self.control and self.backend is None:
            raise ValueError(f"tokenizer: a fast (Rust-backed) tokenizer is required, got {type(tokenizer).__name__}")
        self.sessions: dict[str, list[dict]] = collections.OrderedDict()  # session id -> turns, least recent first
        self.last_used: dict[str, float] = {}  # session id -> time.monotonic() of its last request
        self.evicted: dict[str, str] = collections.OrderedDict()  # session id -> why (the last max_sessions)
        self.disconnects = collections.deque(maxlen=1024)  # rids aborted because the client hung up
        self.lock = threading.Lock()
        self.httpd = httpjson.JSONServer((host, port), _make_handler(self))
        self.thread = None

    @property
    def url(self):
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- token history --
    def mark(self, text: str) -> str:
        """Content text with each control token's text between MARK_OPEN and MARK_CLOSE (encode_text encodes it as
        ordinary text)."""
        return self.control_re.sub(lambda m: MARK_OPEN + m.group() + MARK_CLOSE, text) if self.control_re else text

    def render(self, messages) -> str:
        """Messages -> prompt text with the pinned chat template (+ the assistant header), the control tokens in
        message content marked (mark): without any, the template's text itself."""
        msgs = [{"role": m["role"], "content": self.mark(content_text(m.get("content"), "content"))} for m in messages]
        return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    def _plain_ids(self, text):
        """`text` as ordinary text: the tokenizer's pipeline without its added tokens (thread-safe, unlike flipping
        split_special_tokens on the shared tokenizer)."""
        b = self.backend
        text = b.normalizer.normalize_str(text) if b.normalizer is not None else text
        pieces = [p for p, _ in b.pre_tokenizer.pre_tokenize_str(text)] if b.pre_tokenizer is not None else [text]
        ids = [t.id for p in pieces for t in b.model.tokenize(p)]
        if self.control_ids.intersection(ids):
            raise ValueError(f"tokenizer: the text {text!r} encodes to a control token even without added tokens")
        return ids

    def encode_text(self, text):
        """Rendered (marked) text -> ids: the template's control tokens are control ids, marked text in message
        content is ordinary tokens. Text without marks encodes as tokenizer.encode does."""
        parts = _MARKED.split(text)  # [text, marked, text, marked, ..., text]
        ids = []
        for i, part in enumerate(parts):
            if i % 2:
                ids += self._plain_ids(part)
            elif part:
                ids += self.tok.encode(part, add_special_tokens=False)
        return ids

    def _encode(self, text):
        return self.encode_text(text)

    def encode_prompt(self, turns, text):
        """-> (prompt ids, how): TITO splices the recorded ids where `text` extends the recorded history."""
        if self.mode == "tito":
            for t in reversed(turns):  # prompt_i + reply_i as text -> prompt_ids_i + output_ids_i as ids
                done = t["prompt_text"] + t["reply_text"]
                if text.startswith(done):
                    rest, out = text[len(done):], t["record"]["output_ids"]
                    if out and out[-1] == self.im_end and rest.startswith(IM_END):
                        rest = rest[len(IM_END):]  # the sampled end-of-turn token is already there
                    return t["record"]["prompt_ids"] + out + self._encode(rest), "spliced"
            for t in reversed(turns):  # the reply was edited: keep the prompt, encode the rest
                if text.startswith(t["prompt_text"]):
                    return t["record"]["prompt_ids"] + self._encode(text[len(t["prompt_text"]):]), "prefix"
        return self._encode(text), "fresh"

    def _session(self, sid, text):
        with self.lock:
            if sid is None:  # longest recorded history that prefixes the text
                best = max(((len(t[-1]["prompt_text"] + t[-1]["reply_text"]), s) for s, t in self.sessions.items()
                            if t and text.startswith(t[-1]["prompt_text"] + t[-1]["reply_text"])), default=None)
                sid = best[1] if best else uuid.uuid4().hex
            sid = str(sid)
            turns = self.sessions.setdefault(sid, [])
            self.sessions.move_to_end(sid)
            self.last_used[sid] = time.monotonic()
            self._evict()
            return sid, turns

    def _evict(self):
        """Drop sessions idle past session_idle_s, then the least recently used past max_sessions (lock held)."""
        now = time.monotonic()
        for sid in list(self.sessions):  # least recently used first
            idle = now - self.last_used[sid]
            if idle > self.session_idle_s:
                why = f"idle {idle:.0f} s > session_idle_s = {self.session_idle_s:g} s"
            elif len(self.sessions) > self.max_sessions:
                why = f"more than max_sessions = {self.max_sessions} sessions (least recently used)"
            else:
                break
            del self.sessions[sid], self.last_used[sid]
            self.evicted[sid] = why
            while len(self.evicted) > self.max_sessions:
                self.evicted.popitem(last=False)
            print(f"gateway: session {sid} evicted: {why}", file=sys.stderr, flush=True)

    def _cut_at_stop(self, out, stops):
        """-> (kept ids, reply text, matched stop string or None). The reply ends before the first stop string;
        the kept ids end with the token that completes it (the model sampled through it, as vLLM / SGLang return
        token ids), so the next turn's spliced prompt holds exactly what the model generated."""
        body = out[:-1] if out and out[-1] == self.im_end else out
        full = self.tok.decode(body, skip_special_tokens=True)
        if not any(s in full for s in stops):
            return out, full, None
        lo, hi = 1, len(body)  # smallest k whose decoded prefix holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.tok.decode(body[:mid], skip_special_tokens=True) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        text = self.tok.decode(body[:lo], skip_special_tokens=True)
        pos, s = min((text.find(s), s) for s in stops if s in text)
        return out[:lo], text[:pos], s

    def chat(self, body: dict, headers, rid=None, gone=lambda: False) -> dict:
        """One /v1/chat/completions request -> the OpenAI response dict (APIError on a bad request).
        gone(): True when the client hung up (then nothing is recorded)."""
        req = parse_chat(body, headers)
        text = self.render(req["messages"])
        sid, turns = self._session(req["session_id"], text)
        ids, how = self.encode_prompt(turns, text)
        room = self.max_total_tokens - len(ids)
        if room < 1:
            raise ContextLengthExceeded(f"messages: context length exceeded: the prompt has {len(ids)} tokens, "
                                        f"the limit is {self.max_total_tokens}")
        want = req["max_tokens"] or self.max_new_tokens
        params = {"temperature": req["temperature"], "top_p": req["top_p"], "max_new_tokens": int(min(want, room)),
                  "stop_token_ids": [self.im_end], **({"seed": req["seed"]} if req["seed"] is not None else {})}
        gen = self.client.generate(ids, params, rid=rid or uuid.uuid4().hex)
        if gen["finish_reason"] == "abort" or gone():  # the client hung up, or the engine stopped: no record
            raise APIError(503, "engine: the request was aborted", None, "aborted")
        out, lps, routed = [int(t) for t in gen["output_ids"]], gen["logprobs"], gen["routed_experts"]
        out, reply, matched = self._cut_at_stop(out, req["stop"])
        if matched is not None:
            lps = lps[:len(out)] if lps is not None else None
            routed = routed[:len(ids) + len(out) - 1] if routed is not None else None
        finish = "stop" if matched is not None else gen["finish_reason"]
        record = {"prompt_ids": list(ids), "output_ids": out, "output_logprobs": lps, "routed_experts": routed,
                  "finish_reason": finish, "weight_version": gen["weight_version"], "prompt_source": how}
        with self.lock:
            turns.append({"prompt_text": text, "reply_text": self.mark(reply), "record": record})
        choice = {"index": 0, "message": {"role": "assistant", "content": reply},
                  "finish_reason": "length" if finish == "length" else "stop"}
        if req["logprobs"]:
            choice["logprobs"] = {"content": [{"token": self.tok.decode([t]), "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(out, lps or [])]}
        resp = {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
                "model": req["model"], "choices": [choice], "session_id": sid,
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                          "total_tokens": len(ids) + len(out)}}
        if req["return_token_ids"]:
            choice["token_ids"], resp["prompt_token_ids"] = out, list(ids)
        return resp

    # -- export --
    def trial(self, session_id) -> dict:
        """The session's turns in rollout.run_trial's record format: {"task", "records": [...]}.
        SessionEvicted if the gateway evicted the session (its records are lost: never an empty trial)."""
        with self.lock:
            if session_id in self.evicted:
                raise SessionEvicted(f"session {session_id!r}: evicted by the gateway ({self.evicted[session_id]}); "
                                     f"its token records are lost")
            turns = list(self.sessions.get(session_id, []))
        return {"task": session_id, "records": [t["record"] for t in turns]}

    def pop(self, session_id) -> dict:
        trial = self.trial(session_id)
        with self.lock:
            self.sessions.pop(session_id, None)
            self.last_used.pop(session_id, None)
        return trial


def _model_object():
    return {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "t1"}


def _make_handler(gw: Gateway):
    class Handler(httpjson.JSONHandler):
        @classmethod
        def error_body(cls, e):  # OpenAI's shape, also for the server's own refusals (408, 431, 503 busy)
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            return {"error": {"message": str(e), "type": kind, "param": getattr(e, "param", None),
                              "code": getattr(e, "code", None)}}

        def do_GET(self):
            path = urllib.parse.unquote(self.path.split("?")[0].rstrip("/"))
            if path in ("/health", "/v1/health"):
                if gw.client.health():
                    return self._send(200, {"ok": True, "engine": "ok"})
                return self.send_error_json(APIError(503, f"engine: {gw.client.url} is not healthy", None,
                                                     "engine_unavailable"))
            if path == "/v1/models":
                return self._send(200, {"object": "list", "data": [_model_object()]})
            if path.startswith("/v1/models/"):
                mid = path[len("/v1/models/"):]
                if mid == MODEL_ID:
                    return self._send(200, _model_object())
                return self.send_error_json(APIError(404, f"model: the model {mid[:100]!r} does not exist", "model",
                                                     "model_not_found"))
            self.send_error_json(APIError(404, f"Invalid URL (GET {path[:200]})", None, "not_found"))

        def do_POST(self):
            path = self.path.split("?")[0].rstrip("/")
            try:
                body = self.read_json()
                if path not in ("/v1/chat/completions", "/chat/completions"):
                    raise APIError(404, f"Invalid URL (POST {path[:200]})", None, "not_found")
                rid, gone = uuid.uuid4().hex, []

                def hung_up():  # the client closed its connection: stop generating for it
                    gone.append(rid)
                    gw.disconnects.append(rid)
                    gw.client.abort(rid)
                try:
                    with self.on_disconnect(hung_up):
                        resp = gw.chat(body, self.headers, rid=rid, gone=lambda: bool(gone))
                except APIError:
                    if gone:
                        self.close_connection = True
                        return
                    raise
                self._send(200, resp)
            except (APIError, httpjson.HTTPError) as e:
                self.send_error_json(e)
            except OSError as e:  # the engine cannot be reached
                self.send_error_json(APIError(503, f"engine: unreachable ({e})", None, "engine_unavailable"))
            except RuntimeError as e:  # the engine answered with an error (EngineClient)
                self.send_error_json(APIError(502, str(e)[:500], None, "engine_error"))
            except Exception as e:  # a fault of the gateway itself: named and logged, never a dropped connection
                self.send_error_json(APIError(500, f"gateway: {type(e).__name__}: {e}", None, None))
    return Handler


# --- the command line ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    """-> exit status. eval: 0 when every trial ran to a verdict, 1 when some trial errored (refused up front, Harbor
    failed, ...: the JSON's `errors` and stderr say which and why), 2 for nothing to evaluate or bad flags,
    128 + the signal number when stopped by SIGTERM / SIGINT. harbor-trial: 0 / 1 (exit_reason "error") likewise."""
    a = argv if isinstance(argv, argparse.Namespace) else parse_args(argv)
    if a.cmd == "eval":
        a.attempts = rollout.EVAL["attempts"] if a.attempts is None else a.attempts
        try:
            harbor_run.dataset_tasks(a.dataset)  # nothing to evaluate: said before the tokenizer loads
        except ValueError as e:
            print(f"gateway eval: {e}", file=sys.stderr)
            return 2
    if not os.path.isdir(a.model_path):
        print(f"gateway {a.cmd}: --model-path: {a.model_path} is not a directory (a checkpoint with its tokenizer)",
              file=sys.stderr)
        return 2
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(a.model_path)
    except Exception as e:  # a dir without a tokenizer: one line, not the library's traceback
        print(f"gateway {a.cmd}: --model-path: no tokenizer loads from {a.model_path} ({type(e).__name__}: "
              f"{str(e)[:300]})", file=sys.stderr)
        return 2
    if a.cmd == "serve":
        gw = Gateway(a.engine_url, tok, a.mode, max_total_tokens=a.max_total_tokens, host=a.host, port=a.port).start()
        print(f"gateway ({a.mode}) on {gw.url}/v1 -> {a.engine_url}", flush=True)
        gw.thread.join()
        return 0
    stop_event = threading.Event()
    got = harbor_run.on_signal(stop_event)
    if a.cmd == "harbor-trial":
        gw = Gateway(a.engine_url, tok, "tito", max_total_tokens=a.max_total_tokens).start()
        r = harbor_run.run_harbor_trial(a.task, gw, trials_dir=a.trials_dir, stop_event=stop_event,
                                        harbor_venv=a.harbor_venv,
                                        limits={"max_turns": a.max_turns, "max_total_tokens": a.max_total_tokens})
        print(json.dumps({k: r[k] for k in ("task", "reward", "resolved", "passed", "total", "turns", "exit_reason",
                                            "error", "wall_s", "trial_dir")}), flush=True)
        if got:
            return 128 + got[0]
        if rollout.trial_failed(r):
            print(f"gateway harbor-trial: {r['exit_reason']}: {r['error']}", file=sys.stderr)
            return 1
        return 0
    gw = Gateway(a.engine_url, tok, "tito", max_total_tokens=a.max_total_tokens).start()
    try:
        rep = harbor_run.evaluate(a.dataset, gw, a.trials_dir, attempts=a.attempts,
                                  max_total_tokens=a.max_total_tokens, stop_event=stop_event,
                                  harbor_venv=a.harbor_venv)
    finally:
        gw.stop()
    print(json.dumps({k: v for k, v in rep.items() if k != "trials"}), flush=True)
    if got:
        print(f"gateway eval: stopped by {signal.Signals(got[0]).name}", file=sys.stderr)
        return 128 + got[0]
    if rep["refused"] and len(rep["refused"]) == rep["n_tasks"]:
        print(f"gateway eval: evaluated nothing: all {rep['n_tasks']} tasks refused (first: "
              f"{next(iter(rep['refused'].values()))})", file=sys.stderr)
        return 2
    if rep["n_errors"]:
        first = rep["errors"][0]
        print(f"gateway eval: {rep['n_errors']} of {rep['n_trials']} trials had no verdict ({len(rep['refused'])} "
              f"tasks refused); first: {first['task']} attempt {first['attempt']}: {first['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGV))
