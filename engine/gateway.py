"""Token gateway: an OpenAI-compatible /v1/chat/completions in front of any /generate engine, and the
Harbor path (Harbor's stock Terminus-2 agent driving a local bubblewrap environment through the gateway).

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

Request policy (APIError, OpenAI's {"error": {message, type, param, code}}; the HTTP layer is httpjson.JSONHandler):
400 naming any invalid field (parse_chat: OpenAI's types and ranges; messages of {role: system|user|assistant,
content: str | null | text parts}); 400 "not supported" (code unsupported_parameter) for the non-neutral values of
UNSUPPORTED (n > 1, stream, tools, response_format other than text, penalties, ...), image parts, tool messages;
404 model_not_found for a model other than MODEL_ID; body framing errors as the engine's (411 / 400 / 413 / 408);
400 naming the field for text that is not Unicode (a lone surrogate), a body that is not UTF-8, nesting over
httpjson.MAX_JSON_DEPTH; 503 server_busy over httpjson.MAX_CONNECTIONS open connections (httpjson's deadlines);
503 when the engine cannot be reached or aborted the request, 502 when it answered with an error; every 5xx is
logged on stderr with its traceback (httpjson.JSONHandler.log_5xx). Unknown fields
are ignored (LiteLLM adds vendor extras). GET /health is 200 only when the engine's /health is; a client that hangs
up has its engine request aborted (Gateway.disconnects) and nothing is recorded for it.
`stop`: the reply ends before the first stop string, finish_reason "stop"; the record keeps the sampled ids through
the token that completes it (Gateway._cut_at_stop).

Response: OpenAI chat.completion; with `logprobs: true` also `choices[0].logprobs.content[].logprob`; with
`return_token_ids: true` (what Harbor's LiteLLM client sends under collect_rollout_details) also
`choices[0].token_ids` (LiteLLM exposes it as provider_specific_fields["token_ids"]) and top-level
`prompt_token_ids` (the vLLM fields Harbor reads).

Harbor path (Harbor >= 0.25, Python >= 3.12, its own venv `.venv-harbor`):
    harbor trial start -c CONFIG.json  # what run_harbor_trial writes (harbor_trial_config) and runs; the trial dir
    # holds verifier/ctrf.json + verifier/reward.txt (read with reward.compute), agent/ (Terminus-2), result.json

Run:
    python -m engine.gateway serve --engine-url URL --model-path DIR [--mode tito|naive] [--port 8000]
    python -m engine.gateway harbor-trial --task DIR --engine-url URL --model-path DIR   # one Harbor trial
    python -m engine.gateway eval --dataset DIR --engine-url URL --model-path DIR [--attempts 3]
        # the paper's protocol (EVAL); prints solve_rate, reward_mean (r = P/S) over n_trials = tasks x attempts
        # (a failed trial counts 0), errors; exit 2 with the reason when the dir holds no task, 1 when a trial had no
        # verdict (a task the jail cannot run is refused up front: rollout.check_runs_here; Harbor failed), 128 + N
        # on signal N (SIGTERM / SIGINT end the Harbor process groups it started)
    python -m experiments.bench tito --quick [--harness client|harbor]     # naive vs TITO, one JSON line
In code: Gateway(engine_url, tokenizer, mode).start() -> .url; .pop(session_id) -> {"records": [...]};
run_text_trial(task_dir, gw.url, session_id) / run_harbor_trial(task_dir, gw, trials_dir=...) -> rollout.run_trial's
result (the text / Harbor harnesses beside rollout's token-first one).

Departures:
  1. One sampled completion per request (n = 1), no streaming, no tools/function calling: Terminus-2
     needs none of them (each is refused with 400). `max_tokens` is clipped to the context left (max_total_tokens).
     `stop` strings are found after generation (the engine stops at <|im_end|> or max_tokens), not per step.
  2. Harbor's agent runs in the bubblewrap jail (harbor_env.BwrapEnvironment) instead of Docker, and Harbor's
     verifier in the agent's jail: weaker than rollout.py's native path (sandbox/harbor_env.py lists the jail's rules).
  3. The text client of `experiments/bench.py tito --harness client` (run_text_trial) is rollout's agent loop
  (run_trial, with
     its prompts, limits and scoring) over an OpenAI client (TextChat) that re-sends the message list each turn;
     its call is cut at the agent's deadline (chat.deadline) or the stop event, as TokenChat's.
  4. The embedded model is tiny and random-init in `experiments/bench.py tito`, so its replies are mostly unparseable;
     that is fine for the measurement (every reply is re-sent as history either way) and makes
     non-canonical token sequences, and hence naive drift, frequent.
  5. Message content is text, never control (paper silent): a control token's text in content (`<|im_end|>`,
     `<|im_start|>`: the tokenizer's special tokens and those the template writes) is encoded as ordinary tokens,
     as transformers' sanitize_control_tokens does; the template's own markers stay control ids (Gateway.mark,
     encode_text). Content without such text encodes as before; TITO splices the sampled ids as before.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

from engine import httpjson
import reward
import rollout
from sandbox import jail
from sandbox import task_io
from chat_tokens import IM_END

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
HARBOR_VENV = os.path.join(REPO, ".venv-harbor")
# The paper's evaluation protocol, the one source of it (train_t1.Args' eval_* defaults read it). Seeds (000):
# "评测协议（Terminus-2，60 轮/3600s agent/900s verifier，温度 0.1、top-p 0.95、3 次尝试）"
# = Terminus-2, 60 turns, 3600 s agent / 900 s verifier (overriding the tasks' own timeouts), temperature 0.1,
# top-p 0.95, 3 attempts.
EVAL = {"harness": "terminus-2", "max_turns": 60, "agent_timeout_s": 3600.0, "verifier_timeout_s": 900.0,
        "temperature": 0.1, "top_p": 0.95, "attempts": 3}


# --- the gateway -------------------------------------------------------------------------------------
MODEL_ID = "t1"  # the one model served (Harbor's config names it openai/t1; LiteLLM sends "t1")
MAX_SESSIONS = 2048  # recorded trials kept at once: > the paper's 560 trials per step x 2 steps in flight (one-step
# async) + an evaluation's; past it the least recently used session is evicted
SESSION_IDLE_S = 7200.0  # a session idle this long is evicted: > the paper's 3600 s agent + 900 s verifier timeouts,
# so only sessions nobody popped (a crashed harness, a plain OpenAI client) are dropped
MAX_STOP = 4  # OpenAI's limit on `stop` strings
# Around a control token's text inside message content (render / encode_text): lone surrogates, which no request can
# hold (httpjson.check_json refuses them, _content too), so a client cannot forge a mark either.
MARK_OPEN, MARK_CLOSE = "\ud800", "\ud801"
_MARKED = re.compile(f"{MARK_OPEN}(.*?){MARK_CLOSE}", re.S)
ROLES = ("system", "user", "assistant")
# OpenAI fields this gateway does not implement -> the values that mean "unused"; any other value is a 400
UNSUPPORTED = {"n": (1,), "stream": (False,), "tools": ([],), "functions": ([],), "tool_choice": ("none",),
               "function_call": ("none",), "response_format": ({"type": "text"},), "logit_bias": ({},),
               "presence_penalty": (0,), "frequency_penalty": (0,), "top_logprobs": (0,), "audio": (),
               "prediction": (), "modalities": (["text"],), "web_search_options": ()}


class APIError(ValueError):
    """A request error answered in OpenAI's shape {"error": {message, type, param, code}} with `status`."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class ContextLengthExceeded(APIError):
    def __init__(self, message):
        super().__init__(400, message, "messages", "context_length_exceeded")


class SessionEvicted(LookupError):
    """trial() / pop() of a session the gateway evicted (its records are gone): never an empty trial."""


def _invalid(param, message, code=None):
    return APIError(400, f"{param}: {message}", param, code)


def _get(body, name, types, where=""):
    v = body.get(name)
    if v is not None and (isinstance(v, bool) and bool not in types or not isinstance(v, types)):
        raise _invalid(where + name, f"expected {'/'.join(t.__name__ for t in types)}, got {type(v).__name__}")
    return v


def _number(body, name, lo, hi, default, lo_open=False):
    v = _get(body, name, (int, float))
    if v is None:
        return default
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not (math.isfinite(f) and lo <= f <= hi) or lo_open and f == lo:
        raise _invalid(name, f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {str(v)[:40]}")
    return f


def _content(content, where) -> str:
    """OpenAI message content (None, a str, or a list of text parts) -> text; other parts are refused, and so is
    text that is not Unicode (a lone surrogate: what httpjson refuses in a body, checked here for callers in code)."""
    if content is None or isinstance(content, str):
        text = content or ""
    elif not isinstance(content, list):
        raise _invalid(where, f"expected a string or a list of text parts, got {type(content).__name__}")
    else:
        parts = []
        for i, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise APIError(400, f"{where}[{i}]: not supported (only {{type: text, text: str}} parts)",
                               f"{where}[{i}]", "unsupported_parameter")
            parts.append(p["text"])
        text = "".join(parts)
    m = httpjson.SURROGATE.search(text)
    if m:
        raise _invalid(where, f"not valid Unicode text (a lone surrogate U+{ord(m.group()):04X} at character "
                              f"{m.start()})")
    return text


def parse_chat(body, headers) -> dict:
    """Validate a /v1/chat/completions body before anything else happens -> the fields the gateway uses.
    APIError (OpenAI's shape) names the field: 400 for an invalid or unsupported one, 404 for an unknown model."""
    if not isinstance(body, dict):
        raise _invalid("body", f"expected a JSON object, got {'nothing' if body is None else type(body).__name__}")
    model_id = _get(body, "model", (str,))
    if model_id is None:
        raise _invalid("model", "required")
    if model_id != MODEL_ID:
        raise APIError(404, f"model: the model {model_id[:100]!r} does not exist (served: {MODEL_ID!r})", "model",
                       "model_not_found")
    for name, unused in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not any(v == u and isinstance(v, bool) == isinstance(u, bool) for u in unused):
            raise APIError(400, f"{name}: not supported by this gateway (got {json.dumps(v)[:80]})", name,
                           "unsupported_parameter")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _invalid("messages", "expected a non-empty list of {role, content}")
    messages = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(where, f"expected an object {{role, content}}, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise _invalid(where + ".role", f"expected one of {'|'.join(ROLES)}, got {str(m.get('role'))[:40]!r}")
        for k in ("tool_calls", "function_call", "tool_call_id"):
            if m.get(k):
                raise APIError(400, f"{where}.{k}: not supported by this gateway", f"{where}.{k}",
                               "unsupported_parameter")
        messages.append({"role": m["role"], "content": _content(m.get("content"), where + ".content")})
    out = {"messages": messages, "model": model_id,
           "temperature": _number(body, "temperature", 0.0, 2.0, 1.0),  # OpenAI's range
           "top_p": _number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True), "max_tokens": None}
    for name in ("max_tokens", "max_completion_tokens"):
        v = _get(body, name, (int,))
        if v is not None and v < 1:
            raise _invalid(name, f"must be >= 1, got {v}")
        out["max_tokens"] = v if v is not None else out["max_tokens"]
    out["seed"] = _get(body, "seed", (int,))
    if out["seed"] is not None and not 0 <= out["seed"] < 2**64:
        raise _invalid("seed", f"must be in [0, 2**64 - 1], got {out['seed']}")
    stop = _get(body, "stop", (str, list))
    stop = [stop] if isinstance(stop, str) else stop or []
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _invalid("stop", f"expected a non-empty string or a list of at most {MAX_STOP} of them")
    out["stop"] = stop
    for name in ("logprobs", "return_token_ids"):
        out[name] = bool(_get(body, name, (bool,)))
    meta = _get(body, "metadata", (dict,)) or {}
    sid = headers.get("X-Session-ID")
    for src, name, d in (("session_id", "session_id", body), ("user", "user", body), ("metadata", "session_id", meta)):
        v = _get(d, name, (str,), where="metadata." if src == "metadata" else "")
        sid = sid if sid is not None else v
    out["session_id"] = sid
    return out


class Gateway:
    """OpenAI-compatible chat completions over an SGLang-style /generate engine, recording token ids."""

    def __init__(self, engine_url, tokenizer, mode="tito", max_total_tokens=8192, max_new_tokens=512,
                 host="127.0.0.1", port=0, max_sessions=MAX_SESSIONS, session_idle_s=SESSION_IDLE_S):
        if mode not in ("tito", "naive"):
            raise ValueError(f"mode: expected tito|naive, got {mode!r}")
        if max_sessions < 1 or not session_idle_s > 0:
            raise ValueError(f"max_sessions / session_idle_s: must be >= 1 / > 0, got {max_sessions} / "
                             f"{session_idle_s}")
        self.client, self.tok, self.mode = rollout.EngineClient(engine_url), tokenizer, mode
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
        msgs = [{"role": m["role"], "content": self.mark(_content(m.get("content"), "content"))} for m in messages]
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
            except RuntimeError as e:  # the engine answered with an error (rollout.EngineClient)
                self.send_error_json(APIError(502, str(e)[:500], None, "engine_error"))
            except Exception as e:  # a fault of the gateway itself: named and logged, never a dropped connection
                self.send_error_json(APIError(500, f"gateway: {type(e).__name__}: {e}", None, None))
    return Handler


def chat_completion(url, messages, session_id=None, timeout=600, deadline=None, stop_event=None, **params) -> dict:
    """A minimal OpenAI client: POST /v1/chat/completions -> response dict (RuntimeError on HTTP errors).
    deadline (a time.time() value) / stop_event: the call ends there, its connection shut (rollout.post_guarded: the
    gateway sees the hang-up, aborts the engine request and records nothing) -> rollout.CallInterrupted."""
    body = json.dumps({"model": "t1", "messages": messages, **params}).encode()
    headers = {"Content-Type": "application/json", **({"X-Session-ID": session_id} if session_id else {})}
    status, raw = rollout.post_guarded(url.rstrip("/") + "/v1/chat/completions", body, headers, timeout=timeout,
                                       deadline=deadline, stop_event=stop_event, what="gateway")
    if status >= 400:
        raise RuntimeError(f"gateway: HTTP {status}: {raw[:300].decode(errors='replace')}")
    return json.loads(raw)


# --- a text harness: rollout's Terminus-2 loop over an OpenAI client (history re-sent as text) ---------------
class TextChat:
    """The agent's side of rollout's agent loop as an OpenAI client: the whole message list is re-sent as text each
    turn, the replies verbatim (as Harbor's Chat keeps them); the gateway records the token ids under session_id."""

    def __init__(self, gateway_url, session_id, sampling=None, deadline=None):
        self.url, self.session_id, self.messages, self.deadline = gateway_url, session_id, [], deadline
        self.sp = {**rollout.SAMPLING, **(sampling or {})}

    def add_user(self, text):
        self.messages.append({"role": "user", "content": text})

    def reply(self, stop_event):
        """-> (reply text, None), or (None, exit_reason): "max_tokens" when the gateway finds the context full,
        "timeout" / "cancelled" when self.deadline (run_trial sets it: the agent's deadline) passes or stop_event is
        set during the call (the call is cut there, as TokenChat's)."""
        try:
            resp = chat_completion(self.url, self.messages, self.session_id, temperature=self.sp["temperature"],
                                   top_p=self.sp["top_p"], max_tokens=self.sp["max_new_tokens"],
                                   deadline=self.deadline, stop_event=stop_event)
        except rollout.CallInterrupted as e:
            return None, "timeout" if e.why == "deadline" else "cancelled"
        except RuntimeError as e:
            if "context length" in str(e):  # the gateway counts the tokens (ContextLengthExceeded)
                return None, "max_tokens"
            raise
        content = resp["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": content})
        return content, None


def run_text_trial(task_dir, gateway_url, session_id, *, sampling=None, limits=None, work_root=None,
                   stop_event=None, reward_scale=None) -> dict:
    """rollout.run_trial with the agent talking text to the gateway (TextChat); its records stay in the gateway
    under session_id (Gateway.pop). reward_scale: S of r = P/S (None -> reward.SCALE)."""
    res = rollout.run_trial(task_dir, "model", limits=limits, work_root=work_root, stop_event=stop_event,
                            reward_scale=reward_scale, chat=TextChat(gateway_url, session_id, sampling))
    return {**res, "session_id": session_id}


# --- Harbor: the runner (main venv side) --------------------------------------------------------------
def harbor_python(venv=None):
    return os.path.join(venv or HARBOR_VENV, "bin", "python")


def harbor_available(venv=None) -> str | None:
    """None when Harbor's venv is usable, else the reason it is not."""
    if not os.path.exists(harbor_python(venv)):
        return (f"Harbor's venv is absent ({venv or HARBOR_VENV}; run.sh creates it with Python 3.12 and "
                f"`pip install harbor`)")
    return None


HARBOR_STOP_GRACE_S = 10.0  # a stopped Harbor trial's group gets SIGTERM, then SIGKILL after this (paper silent)
_harbor_groups: set[int] = set()  # process groups of the Harbor trials running now (stop_harbor_groups)
_harbor_lock = threading.RLock()  # re-entrant: the signal handler may run while the main thread holds it


def _end_group(pgid, grace_s):
    """SIGTERM the process group, SIGKILL what is left of it after grace_s (0: at once)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        t_end = time.monotonic() + wait
        while time.monotonic() < t_end:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


def stop_harbor_groups(grace_s=0.0) -> int:
    """End the process group of every Harbor trial this process started and is running (a signal handler calls it:
    Harbor runs in its own session, so nothing else would stop it). -> how many."""
    with _harbor_lock:
        groups = list(_harbor_groups)
    for pgid in groups:
        _end_group(pgid, grace_s)
    return len(groups)


def harbor_outcome(trial_dir) -> str | None:
    """None when Harbor's verifier ran (result.json has a verifier_result), else why the trial has no verdict: Harbor's
    own exception (its environment failed to start, the verifier timed out, ...) or its missing result.json."""
    path = os.path.join(trial_dir, "result.json")
    if not os.path.isfile(path):
        return f"harbor wrote no {path}"
    try:
        res = json.load(open(path))
    except ValueError as e:
        return f"{path}: not JSON ({e})"
    if isinstance(res, dict) and res.get("verifier_result") is not None:
        return None
    exc = (res.get("exception_info") if isinstance(res, dict) else None) or {}
    if exc:
        return f"harbor: {exc.get('exception_type')}: {str(exc.get('exception_message'))[:500]} (no verifier result)"
    return f"harbor: {path} has no verifier result"


def harbor_trial_config(task_dir, trials_dir, trial_name, api_base, *, temperature, top_p, max_new_tokens,
                        max_total_tokens, agent_timeout_s=None, verifier_timeout_s=None, max_turns=None) -> dict:
    """Harbor TrialConfig: stock Terminus-2 against the gateway, summarisation off, bubblewrap environment."""
    kwargs = {"api_base": api_base, "temperature": temperature, "collect_rollout_details": True,
              "session_id": trial_name, "enable_summarize": False, "proactive_summarization_threshold": 0,
              "record_terminal_session": False, "suppress_max_turns_warning": True,
              "model_info": {"max_input_tokens": max_total_tokens, "max_output_tokens": max_new_tokens,
                             "input_cost_per_token": 0.0, "output_cost_per_token": 0.0},
              "llm_call_kwargs": {"top_p": top_p, "max_tokens": max_new_tokens}}
    if max_turns is not None:
        kwargs["max_turns"] = max_turns
    return {"task": {"path": os.path.abspath(task_dir)}, "trial_name": trial_name,
            "trials_dir": os.path.abspath(trials_dir),
            "agent": {"name": "terminus-2", "model_name": "openai/t1", "kwargs": kwargs,
                      **({"override_timeout_sec": agent_timeout_s} if agent_timeout_s else {})},
            "environment": {"import_path": "sandbox.harbor_env:BwrapEnvironment", "delete": True,
                            "kwargs": {"tools_prefix": sys.prefix}},
            "verifier": {**({"override_timeout_sec": verifier_timeout_s} if verifier_timeout_s else {})}}


def run_harbor_trial(task_dir, gateway: Gateway, *, trials_dir, sampling=None, limits=None, stop_event=None,
                     agent_timeout_s=None, verifier_timeout_s=None, trial_name=None, reward_scale=None,
                     harbor_venv=None) -> dict:
    """One Harbor Terminus-2 trial through the gateway -> rollout.run_trial's result (records from the gateway).
    reward_scale: S of r = P/S (None -> reward.SCALE). A task the local jail cannot run (rollout.check_runs_here) is
    refused before Harbor starts; a trial whose verifier never ran (Harbor's environment failed, ...) is an error,
    never a reward of 0; stop_event ends Harbor's process group (SIGTERM, SIGKILL after HARBOR_STOP_GRACE_S)."""
    t0, stop_event, limits = time.time(), stop_event or threading.Event(), jail.make_limits(limits)
    sp = {**rollout.SAMPLING, **(sampling or {})}
    name = trial_name or f"{os.path.basename(os.path.abspath(str(task_dir)))}__{uuid.uuid4().hex[:8]}"
    result = {"task": os.path.basename(os.path.abspath(str(task_dir))), "reward": 0.0, "resolved": False, "passed": 0,
              "total": 0, "reward_source": "none", "turns": 0, "exit_reason": "error", "error": None, "wall_s": 0.0,
              "weight_versions": [], "records": [], "session_id": name, "trial_dir": os.path.join(trials_dir, name)}
    try:
        why = harbor_available(harbor_venv)
        if why:
            raise RuntimeError(why)
        task = task_io.load_task(task_dir)
        rollout.check_runs_here(task)  # BwrapEnvironment is the local jail: the same refusal as rollout.py's
        os.makedirs(trials_dir, exist_ok=True)
        cfg = harbor_trial_config(task_dir, trials_dir, name, gateway.url + "/v1", temperature=sp["temperature"],
                                  top_p=sp["top_p"], max_new_tokens=sp["max_new_tokens"],
                                  max_total_tokens=limits.max_total_tokens, max_turns=limits.max_turns,
                                  agent_timeout_s=agent_timeout_s or limits.trial_timeout_s,
                                  verifier_timeout_s=verifier_timeout_s)
        cfg_path = os.path.join(trials_dir, f"{name}.config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        env = {**os.environ, "PYTHONPATH": REPO, "OPENAI_API_KEY": "sk-local", "PYTHONUNBUFFERED": "1"}
        with open(os.path.join(trials_dir, f"{name}.harbor.log"), "w") as log, _harbor_lock:
            if stop_event.is_set():
                result["exit_reason"] = "cancelled"
                return result
            p = subprocess.Popen([os.path.join(harbor_venv or HARBOR_VENV, "bin", "harbor"), "trial", "start", "-c",
                                  cfg_path], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                 start_new_session=True)  # its own process group: stopped as one (_end_group)
            _harbor_groups.add(p.pid)
        try:
            while p.poll() is None and not stop_event.wait(0.2):
                pass
            if stop_event.is_set():
                _end_group(p.pid, HARBOR_STOP_GRACE_S)
                p.wait()
                result["exit_reason"] = "cancelled"
                return result
        finally:
            _end_group(p.pid, 0.0)  # what Harbor left running in its group
            p.wait()
            with _harbor_lock:
                _harbor_groups.discard(p.pid)
        tdir = result["trial_dir"]
        if not os.path.isdir(tdir):
            raise RuntimeError(f"harbor wrote no trial dir {tdir} (rc {p.returncode}; see {log.name})")
        why = harbor_outcome(tdir)
        if why:
            raise RuntimeError(f"{why} (rc {p.returncode}; see {log.name})")
        res = json.load(open(os.path.join(tdir, "result.json")))
        scale = reward.SCALE if reward_scale is None else reward_scale
        # the report files there are copies our BwrapEnvironment.download_dir made (host-owned, no links)
        v = reward.compute(os.path.join(tdir, "verifier"), scale, owner_uid=os.geteuid(),
                           n_assertions=task.n_assertions)
        result.update(reward=v["reward"], passed=v["passed"], total=v["total"], reward_source=v["source"],
                      resolved=reward.is_resolved(v), exit_reason="harbor", reward_scale=scale,
                      error=(res.get("exception_info") or {}).get("exception_message")
                      if res.get("exception_info") else None)
    except Exception as e:
        result.update(exit_reason="error", error=f"{type(e).__name__}: {e}")
    finally:
        trial = gateway.pop(name)
        result["records"], result["turns"] = trial["records"], len(trial["records"])
        result["wall_s"] = time.time() - t0
    return result


# --- evaluation with the paper's protocol (EVAL): shared by train_t1 and `engine/gateway.py eval` ----------------
def trial_failed(t: dict) -> bool:
    """A trial that never reached a verdict: it crashed, was cancelled, or never started."""
    return t.get("exit_reason") in ("error", "cancelled", None)


def evaluate_trials(task_dirs, run_attempt, attempts: int) -> dict:
    """Every (task, attempt) is one trial in the denominator, n_trials = tasks x attempts: a trial that errored,
    was cancelled or never came back counts as reward 0, unresolved, and is listed in `errors` with its reason.

    run_attempt(task_dirs, k) -> the trial results of attempt k (dicts with task, reward, resolved, turns,
    exit_reason, error, as rollout.run_trial returns them), at most one per task dir, in any order; a task is
    matched by its directory's name. Returns solve_rate (resolved: passed == total > 0), reward_mean (r = P/S),
    turns_mean over all n_trials, n_errors, errors [{task, attempt, error}] and trials (one line each)."""
    if attempts < 1:
        raise ValueError(f"evaluation attempts: must be >= 1, got {attempts}")
    names = [os.path.basename(os.path.abspath(str(td))) for td in task_dirs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"evaluation tasks: two task dirs share a name ({dup})")
    trials = []
    for k in range(attempts):
        got = {}
        for t in run_attempt(list(task_dirs), k):
            if t.get("task") not in names or t["task"] in got:
                raise ValueError(f"evaluation attempt {k}: result for task {t.get('task')!r} is "
                                 f"{'a duplicate' if t.get('task') in got else 'not one of the tasks'}")
            got[t["task"]] = t
        for name in names:
            t = got.get(name, {"task": name, "exit_reason": None, "error": "no result came back"})
            failed = trial_failed(t)
            if not failed and not math.isfinite(float(t["reward"])):
                raise ValueError(f"evaluation attempt {k}: task {name!r} has a non-finite reward {t['reward']!r}")
            trials.append({"task": name, "attempt": k, "reward": 0.0 if failed else float(t["reward"]),
                           "resolved": False if failed else bool(t["resolved"]),
                           "turns": int(t.get("turns", 0)), "exit_reason": t.get("exit_reason"),
                           "error": (t.get("error") or t.get("exit_reason")) if failed else t.get("error")})
    n = len(trials)
    assert n == len(names) * attempts, f"evaluation: {n} trials for {len(names)} tasks x {attempts} attempts"
    errors = [{"task": t["task"], "attempt": t["attempt"], "error": t["error"]} for t in trials
              if trial_failed(t)]
    return {"n_tasks": len(names), "attempts": attempts, "n_trials": n, "n_errors": len(errors),
            "solve_rate": sum(t["resolved"] for t in trials) / n if n else 0.0,
            "reward_mean": sum(t["reward"] for t in trials) / n if n else 0.0,
            "turns_mean": sum(t["turns"] for t in trials) / n if n else 0.0, "errors": errors, "trials": trials}


def dataset_tasks(dataset_dir) -> tuple[list[str], dict[str, str]]:
    """A Harbor dataset dir -> (its task dirs (entries with a task.toml), {task dir: why the local jail cannot run it}),
    the refusals from task_io.load_task and rollout.check_runs_here, made before anything runs.
    ValueError naming the dir when it is not a directory or holds no task dir (an evaluation of nothing)."""
    if not os.path.isdir(dataset_dir):
        raise ValueError(f"dataset: {dataset_dir} is not a directory")
    tasks = sorted(str(p) for p in Path(dataset_dir).iterdir() if (p / "task.toml").is_file())
    if not tasks:
        raise ValueError(f"dataset: {dataset_dir} holds no task dir (an entry with a task.toml): nothing to evaluate")
    refused = {}
    for td in tasks:
        try:
            rollout.check_runs_here(task_io.load_task(td))
        except Exception as e:  # a task that cannot be read is refused too, with its reason
            refused[td] = f"refused before running: {e}"
    return tasks, refused


def evaluate(dataset_dir, engine_url, tokenizer, trials_dir, attempts=EVAL["attempts"], max_total_tokens=8192,
             max_new_tokens=2048, reward_scale=None, stop_event=None, harbor_venv=None) -> dict:
    """Terminus-2 via Harbor with the paper's protocol (EVAL) on every task dir of a Harbor dataset dir, `attempts`
    per task, through evaluate_trials (every trial counts). A task the local jail cannot run (dataset_tasks) is not
    started: each of its trials is an error ("refused before running: ..."), listed in `refused`. stop_event: the
    running trial's Harbor is stopped and no further trial starts (those count as errors). ValueError for a dataset
    with no task dir."""
    tasks, refused = dataset_tasks(dataset_dir)
    stop_event = stop_event or threading.Event()
    gw = Gateway(engine_url, tokenizer, "tito", max_total_tokens=max_total_tokens).start()

    def run_attempt(task_dirs, k):
        out = []
        for td in task_dirs:
            name = os.path.basename(td)
            if td in refused:
                out.append({"task": name, "exit_reason": "error", "error": refused[td]})
            elif stop_event.is_set():
                out.append({"task": name, "exit_reason": "cancelled", "error": "the evaluation was stopped"})
            else:
                out.append(run_harbor_trial(
                    td, gw, trials_dir=trials_dir, trial_name=f"{name}__a{k}", stop_event=stop_event,
                    sampling={"temperature": EVAL["temperature"], "top_p": EVAL["top_p"],
                              "max_new_tokens": max_new_tokens},
                    limits={"max_total_tokens": max_total_tokens, "max_turns": EVAL["max_turns"],
                            "trial_timeout_s": EVAL["agent_timeout_s"]},
                    agent_timeout_s=EVAL["agent_timeout_s"], verifier_timeout_s=EVAL["verifier_timeout_s"],
                    reward_scale=reward_scale, harbor_venv=harbor_venv))
        return out
    try:
        rep = evaluate_trials(tasks, run_attempt, attempts)
        return {**rep, "refused": {os.path.basename(td): why for td, why in refused.items()},
                "protocol": {**EVAL, "attempts": attempts}}
    finally:
        gw.stop()


def _on_signal(stop_event):
    """SIGTERM / SIGINT: stop every Harbor process group this process started (they run in their own sessions, so
    they would outlive it) and let the running command end with the signal's status."""
    got = []

    def handler(signum, frame):
        got.append(signum)
        stop_event.set()
        n = stop_harbor_groups(grace_s=0.0)
        print(f"gateway: {signal.Signals(signum).name}: stopping ({n} Harbor process group(s) ended)", file=sys.stderr,
              flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return got


def main(argv=None) -> int:
    """-> exit status. eval: 0 when every trial ran to a verdict, 1 when some trial errored (refused up front, Harbor
    failed, ...: the JSON's `errors` and stderr say which and why), 2 for nothing to evaluate or bad flags,
    128 + the signal number when stopped by SIGTERM / SIGINT. harbor-trial: 0 / 1 (exit_reason "error") likewise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "harbor-trial", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--engine-url", required=True)
        s.add_argument("--model-path", required=True, help="directory with the tokenizer")
        s.add_argument("--max-total-tokens", type=int, default=8192)
        if name == "serve":
            s.add_argument("--mode", choices=["tito", "naive"], default="tito")
            s.add_argument("--host", default="127.0.0.1")
            s.add_argument("--port", type=int, default=8000)
        if name == "harbor-trial":
            s.add_argument("--task", required=True)
            s.add_argument("--trials-dir", default="runs/harbor-trials")
            s.add_argument("--max-turns", type=int, default=50)
        if name in ("harbor-trial", "eval"):
            s.add_argument("--harbor-venv", default=HARBOR_VENV, help="Harbor's venv (Python >= 3.12, harbor)")
        if name == "eval":
            s.add_argument("--dataset", required=True, help="a Harbor dataset dir (one task dir per entry)")
            s.add_argument("--trials-dir", default="runs/harbor-eval")
            s.add_argument("--attempts", type=int, default=EVAL["attempts"])
    a = p.parse_args(argv)
    if a.cmd == "eval":
        if a.attempts < 1:
            p.error(f"--attempts: must be >= 1, got {a.attempts}")
        try:
            dataset_tasks(a.dataset)  # nothing to evaluate: said before the tokenizer loads
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
    got = _on_signal(stop_event)
    if a.cmd == "harbor-trial":
        gw = Gateway(a.engine_url, tok, "tito", max_total_tokens=a.max_total_tokens).start()
        r = run_harbor_trial(a.task, gw, trials_dir=a.trials_dir, stop_event=stop_event, harbor_venv=a.harbor_venv,
                             limits={"max_turns": a.max_turns, "max_total_tokens": a.max_total_tokens})
        print(json.dumps({k: r[k] for k in ("task", "reward", "resolved", "passed", "total", "turns", "exit_reason",
                                            "error", "wall_s", "trial_dir")}), flush=True)
        if got:
            return 128 + got[0]
        if trial_failed(r):
            print(f"gateway harbor-trial: {r['exit_reason']}: {r['error']}", file=sys.stderr)
            return 1
        return 0
    rep = evaluate(a.dataset, a.engine_url, tok, a.trials_dir, attempts=a.attempts,
                   max_total_tokens=a.max_total_tokens, stop_event=stop_event, harbor_venv=a.harbor_venv)
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
    sys.exit(main())
