"""Rollout: the Terminus-2 harness (token-first), the SGLang engine client, one trial, oversampling.

Paper section "rollout" (T1, arXiv 2609.11042): the agent speaks the Terminus-2 protocol, one JSON
reply per turn {"analysis", "plan", "commands": [{"keystrokes", "duration"}], "task_complete"},
keystrokes go to a real shell in a sandbox, the new terminal output is the next user message,
`task_complete` must be confirmed on a second turn; when the agent stops (or a limit hits) the
task's tests are copied in and its own verifier scores it (reward.py: r = P/S). One trajectory per
task; a step launches 560 tasks and keeps the first 512 that finish, the rest are cancelled.
Token-first history (TITO): the conversation is kept as token ids; prompt_{i+1} = prompt_i +
output_i (the sampled ids, stop token included) + glue + observation ids, so every turn boundary
is strict by construction and the loss tokens are exactly the sampled ones.
The sandbox is sandbox.Sandbox (the local bubblewrap jail; its security policy is listed in sandbox/jail.py) or
daytona_sandbox.DaytonaSandbox (sandbox="daytona"), behind one interface.

Run:
    python rollout.py --task DIR --agent oracle|nop|model|scripted [--engine-url URL] [--model-path DIR]
                      [--sandbox bwrap|daytona] [--reward-scale S] [--keep DIR]
    # prints one JSON line: reward, reward_scale, resolved, passed, total, reward_source, reward_reason, turns,
    # exit_reason, exit_detail, oracle_exit, error, wall_s, trial_dir (--keep: with host/agent_transcript.jsonl);
    # exit status 1 when nothing was scored (exit_reason "error" / "cancelled": an unloadable --model-path, an
    # oracle run of a task without solution/solve.sh, ...), 2 on bad flags
In code: run_trial(task_dir, agent, ...) -> dict; run_trials(task_dirs, agent, n_keep=...) -> (kept, dropped).
Steps of train_t1's RL loop: to_samples (trials -> TITO samples), audit_samples
(the step's TITO / R3 audit).

Departures from the paper / Terminus-2 (the sandbox's: sandbox/jail.py):
1. Prompt texts are condensed (a few lines, same JSON schema): the embedded policy is a tiny model
   trained from scratch, Terminus-2's long prompt would dominate its context.
2. Oversampling counts a trial as "finished" when it ended without a crash; crashed and cancelled
   trials go to `dropped` with their reason and seconds run.
3. With sandbox "bwrap", a task that needs its image built (task_io.image_needs) is refused at the start of run_trial
   (exit_reason "error", "needs its image: use --sandbox daytona or Harbor's docker environment", the reasons):
   run here it would fail for want of a tool and score 0 silently.
4. Tool output, the instruction and scripted replies are encoded as text (literal_ids): a token's spelling in them
   (<|im_end|>, <think>) is byte-level text, never the control token, so a command cannot forge chat structure (as chat
   servers escape it); text without such a spelling keeps its exact ids; sampled ids are untouched (TITO unchanged).
"""
import argparse
import concurrent.futures as cf
import http.client
import itertools
import json
import math
import os
import random
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from pathlib import Path

import infra
import r3
import reward
from sandbox import task_io
import tito
from chat_tokens import ASSISTANT_PREFIX, IM_END, IM_START
from sandbox.daytona import DaytonaSandbox
from sandbox.jail import Sandbox, make_limits, remove_tree, write_host_file


# --- Terminus-2 protocol --------------------------------------------------------------------------
PROMPT = """You are an agent solving a task in a Linux shell. Reply with exactly one JSON object:
{{"analysis": "what you see", "plan": "what you do next", \
"commands": [{{"keystrokes": "ls -la\\n", "duration": 0.1}}], "task_complete": false}}
keystrokes are typed verbatim (end a command with \\n); duration = seconds to wait for output.
Set task_complete to true when the task is done.

Task:
{instruction}

Current terminal state:
{terminal}"""
PARSE_ERROR = "ERROR: your reply was not valid: {error}\nReply with one JSON object as specified."
CONFIRM = ("Current terminal state:\n{terminal}\n\nAre you sure the task is complete? It will be graded and you "
           "cannot change it afterwards. If so, reply again with \"task_complete\": true.")
NEW_OUTPUT = "New terminal output:\n{terminal}"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 512}  # the agent's defaults (every harness)


def parse_reply(text: str):
    """Terminus-2 reply text -> (reply dict, None) or (None, error naming what is wrong)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None, "no JSON object found"
    try:
        obj = json.loads(text[start:end + 1])
    except ValueError as e:  # JSONDecodeError, an integer of more than 4300 digits
        return None, f"invalid JSON ({str(e)[:200]})"
    except RecursionError:  # a sampled reply of thousands of brackets: a refused reply, not a crashed trial
        return None, "invalid JSON (nested too deeply)"
    if not isinstance(obj, dict):
        return None, "the reply must be a JSON object"
    for field in ("analysis", "plan", "commands"):
        if field not in obj:
            return None, f"missing required field '{field}'"
    if not isinstance(obj["commands"], list):
        return None, "'commands' must be a list"
    cmds = []
    for i, c in enumerate(obj["commands"]):
        if not isinstance(c, dict) or not isinstance(c.get("keystrokes"), str):
            return None, f"commands[{i}] must be an object with a string 'keystrokes'"
        try:
            c["keystrokes"].encode()
        except UnicodeEncodeError:  # "\ud800" in the JSON: a lone surrogate cannot be typed
            return None, f"commands[{i}].keystrokes: not valid Unicode text (a lone surrogate)"
        d = c.get("duration", 1.0)
        try:
            d = None if isinstance(d, bool) or not isinstance(d, (int, float)) else float(d)
        except OverflowError:  # an integer too large for a float
            d = None
        if d is None or not math.isfinite(d) or d < 0:
            return None, f"commands[{i}].duration must be a finite number >= 0"
        cmds.append({"keystrokes": c["keystrokes"], "duration": float(d)})
    done = obj.get("task_complete", False)
    if not isinstance(done, bool):
        return None, "'task_complete' must be true or false"
    return {"analysis": obj["analysis"], "plan": obj["plan"], "commands": cmds, "task_complete": done}, None


# --- engine client (SGLang protocol) --------------------------------------------------------------
class CallInterrupted(Exception):
    """A request ended by its caller: why = "deadline" (the trial's time ran out) or "cancelled" (its stop event)."""

    def __init__(self, why, message):
        super().__init__(message)
        self.why = why


def post_guarded(url, body: bytes, headers: dict, *, timeout, deadline=None, stop_event=None, what="server"):
    """POST `body` to `url` with a hard end -> (HTTP status, raw reply bytes). At `deadline` (a time.time() value) or
    when `stop_event` is set, a guard thread shuts the connection down, so neither a slow nor a hung server holds the
    caller (the server sees the hang-up) -> CallInterrupted(why); unreachable -> ConnectionError naming `what` and the
    URL; a reply that is not HTTP -> RuntimeError. Without deadline and stop_event: one plain call (no guard)."""
    u = urllib.parse.urlsplit(url)
    why, ended = [], threading.Event()

    def left():
        return math.inf if deadline is None else deadline - time.time()

    def interrupted():
        if stop_event is not None and stop_event.is_set():
            return "cancelled"
        return "deadline" if left() <= 0 else None
    if interrupted():
        raise CallInterrupted(interrupted(), f"{what}: not sent ({interrupted()})")
    conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(u.hostname, u.port, timeout=max(min(timeout, left()), 0.001))

    def guard():
        while not ended.wait(min(0.25, max(left(), 0.001))):
            w = interrupted()
            if w:
                why.append(w)
                break
        while not ended.is_set():  # until the call returns: a connect still under way has no socket yet
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the caller's blocked recv / send at once
                except OSError:
                    pass
            ended.wait(0.05)
    if deadline is not None or stop_event is not None:
        threading.Thread(target=guard, daemon=True, name="http-call-guard").start()
    t0 = time.time()
    try:
        conn.request("POST", u.path or "/", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    except (OSError, http.client.HTTPException) as e:
        w = (why or [interrupted()])[0]
        if w:
            raise CallInterrupted(w, f"{what}: {'the deadline passed' if w == 'deadline' else 'cancelled'} after "
                                     f"{time.time() - t0:.1f} s in the request; connection closed") from None
        if isinstance(e, OSError):  # unreachable, reset, timed out: still an OSError, now naming the server
            raise ConnectionError(f"{what} ({url}): {type(e).__name__}: {e}") from None
        raise RuntimeError(f"{what}: bad HTTP reply ({type(e).__name__}: {e})") from None
    finally:
        ended.set()
        conn.close()


class EngineClient:
    """Client of SGLang's HTTP protocol (/generate with input_ids, weights, pause); served by engine/server.py too."""

    def __init__(self, url, timeout=600.0):
        self.url, self.timeout, self._shape = url.rstrip("/"), timeout, None

    def _call_guarded(self, path, body, timeout, deadline, stop_event):
        """POST `body` to `path` with a hard end (post_guarded: the engine notices the hang-up and drops the request,
        httpjson.on_disconnect) -> reply JSON; CallInterrupted when it was cut."""
        status, raw = post_guarded(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"},
                                   timeout=timeout or self.timeout, deadline=deadline, stop_event=stop_event,
                                   what=f"engine {path}")
        if status >= 400:
            raise RuntimeError(f"engine {path}: HTTP {status}: {raw[:500].decode(errors='replace')}")
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"text": raw.decode(errors="replace")}

    def _call(self, path, body=None, method="POST", timeout=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"engine {path}: HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"text": raw.decode(errors="replace")}

    def release_memory(self, tags=None):
        """The colocated preset: give the device to the trainer (SGLang's tags "weights", "kv_cache"; None: both)."""
        return self._call("/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def resume_memory(self, tags=None):
        return self._call("/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    def generate(self, input_ids, sampling_params, rid=None, deadline=None, stop_event=None) -> dict:
        """-> dict(output_ids, logprobs, routed_experts (N, L, k) int32 or None, finish_reason, finish_message (the
        server's words on an abort, else None), weight_version, cached_tokens: prompt tokens the server took from its
        prefix cache, None when it does not say). deadline (time.time()) / stop_event: the request is cut there, its
        connection closed (CallInterrupted); None for both: one call with the client's timeout."""
        body = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
                "return_logprob": True, "return_routed_experts": True, **({"rid": rid} if rid else {})}
        guarded = deadline is not None or stop_event is not None
        out = (self._call_guarded("/generate", body, None, deadline, stop_event) if guarded
               else self._call("/generate", body))
        meta = out.get("meta_info") if isinstance(out, dict) else None
        if not isinstance(meta, dict) or meta.get("finish_reason") is None:  # not an empty turn: a broken reply
            raise RuntimeError(f"engine /generate: not a generate reply (no meta_info.finish_reason): {str(out)[:200]}")
        lps = meta.get("output_token_logprobs") or []
        ids = out.get("output_ids")
        ids = [int(x[1]) for x in lps] if ids is None else [int(t) for t in ids]
        routed = meta.get("routed_experts")
        if routed is not None:
            if self._shape is None:
                info = self.model_info(deadline)
                self._shape = (int(info["num_moe_layers"]), int(info["top_k"]))
            routed = r3.decode_routed_experts(routed, *self._shape)  # (len(in) + len(out) - 1, L, k)
        fin = meta.get("finish_reason")
        return {"output_ids": ids, "logprobs": [float(x[0]) for x in lps] if lps else None,
                "routed_experts": routed, "finish_reason": fin.get("type") if isinstance(fin, dict) else fin,
                "finish_message": fin.get("message") if isinstance(fin, dict) else None,
                "weight_version": meta.get("weight_version"), "cached_tokens": meta.get("cached_tokens")}

    def update_weights_from_disk(self, path, weight_version=None):
        version = {} if weight_version is None else {"weight_version": str(weight_version)}
        out = self._call("/update_weights_from_disk", {"model_path": str(path), **version})
        if not out.get("success", False):
            raise RuntimeError(f"engine /update_weights_from_disk: {out.get('message') or out}")
        return out

    def pause(self):
        return self._call("/pause_generation", {})

    def resume(self):
        return self._call("/continue_generation", {})

    def abort(self, rid):
        return self._call("/abort_request", {"rid": rid}, timeout=10)

    def health(self) -> bool:
        try:
            self._call("/health", method="GET", timeout=5)
            return True
        except (OSError, RuntimeError):
            return False

    def model_info(self, deadline=None) -> dict:
        """SGLang's /get_model_info; deadline (time.time()): its timeout is no later (at least 1 s)."""
        timeout = 30 if deadline is None else min(30, max(deadline - time.time(), 1))
        return self._call("/get_model_info", method="GET", timeout=timeout)

    def server_info(self) -> dict:
        """SGLang's /get_server_info (the embedded engine: its settings and prefix-cache counters)."""
        return self._call("/get_server_info", method="GET", timeout=30)


# --- harness --------------------------------------------------------------------------------------
FAULTS = ("invalid_json", "no_plan", "bad_command")


def fault_reply(reply: dict, kind: str, rng) -> str:
    """One wrong reply in place of the expert's `reply` (the mistakes a T = 1 sample makes), as raw text.

    invalid_json: the reply cut inside its text and closed early; no_plan: the "plan" field left out (both refused
    by parse_reply, checked here); bad_command: the first command alone, its program name misspelled (a letter
    doubled or one added): the shell says "command not found" and runs nothing (a redirection still creates its
    file empty; the expert's command after it writes it)."""
    if kind == "invalid_json":
        text = json.dumps(reply)
        for _ in range(100):
            cut = rng.randint(2, len(text) - 2)
            bad = text[:cut] + rng.choice(['"}', "}", '", "commands": true}', ""])
            if parse_reply(bad)[1] is not None:
                return bad
        return '{"analysis": "'  # never reached with the expert's replies; still a refused reply
    if kind == "no_plan":
        return json.dumps({k: v for k, v in reply.items() if k != "plan"})
    if kind != "bad_command":
        raise ValueError(f"fault_reply: kind must be one of {FAULTS}, got {kind!r}")
    keys = reply["commands"][0]["keystrokes"] if reply.get("commands") else ""
    prog, sep, rest = keys.partition(" ")
    if not prog.strip() or not prog.isascii() or not prog.replace("-", "").replace("_", "").isalnum():
        prog, sep, rest = "cat", " ", "README.txt\n"  # no program word to misspell: a read of a missing file
    i = rng.randrange(len(prog))
    typo = prog[:i] + prog[i] * 2 + prog[i + 1:] if rng.random() < 0.5 else prog + rng.choice("xqz")
    return json.dumps({**reply, "commands": [{"keystrokes": typo + sep + rest, "duration": 0.1}],
                       "task_complete": False})


def with_faults(replies: list, rate: float, rng) -> list:
    """The expert's replies with, in a fraction `rate` of trials, one fault turn {"unscored": text} (fault_reply
    of a random kind) before a random reply that does not complete the task; the expert's own reply follows it."""
    at = [i for i, r in enumerate(replies) if isinstance(r, dict) and not r.get("task_complete")]
    if not at or rng.random() >= rate:
        return list(replies)
    i = rng.choice(at)
    return replies[:i] + [{"unscored": fault_reply(replies[i], rng.choice(FAULTS), rng)}] + replies[i:]


def _scripted_policy(task, tok, faults=0.0, seed=0):
    """Replies of solution/terminus2.json as a policy; a str entry is replayed verbatim (raw text), an
    {"unscored": text} entry too, its record marked unscored (to_samples gives it no loss). faults: with_faults'
    rate, drawn per task and seed (train_t1 --sft-faults: the SFT data's recoveries)."""
    path = os.path.join(task.solution_dir or "", "terminus2.json")
    if not os.path.isfile(path):
        raise ValueError(f"scripted agent: {path} not found")
    with open(path) as f:
        replies = json.load(f)
    if not isinstance(replies, list) or not replies:
        raise ValueError(f"{path}: expected a non-empty JSON list of replies")
    if faults:
        replies = with_faults(replies, faults, random.Random(f"{task.name}:{seed}"))
    it = iter(replies)
    im_end = tok.convert_tokens_to_ids(IM_END)

    def policy(prompt_ids, max_new, rid):
        reply = next(it, None)
        if reply is None:
            raise RuntimeError(f"{path}: replies ran out before task_complete was confirmed")
        unscored = isinstance(reply, dict) and set(reply) == {"unscored"}
        reply = reply["unscored"] if unscored else reply
        text = reply if isinstance(reply, str) else json.dumps(reply)
        ids = literal_ids(tok, text) + [im_end]  # a reply's text is text: "<|im_end|>" in it is no control token
        fin = "stop" if len(ids) <= max_new else "length"  # a long reply is cut like the engine would
        return {"output_ids": ids[:max_new], "logprobs": None, "routed_experts": None, "finish_reason": fin,
                "weight_version": None, **({"unscored": True} if unscored else {})}
    return policy


def _model_policy(engine_url, tok, sampling, stop_event, deadline=None):
    """The engine as a policy. Each request ends at the trial's deadline or its cancellation (its connection is shut,
    CallInterrupted), whichever is first, and /abort_request is sent for it (best effort, off the trial's thread)."""
    if engine_url is None:
        raise ValueError("engine_url: required for agent 'model'")
    client = EngineClient(engine_url)
    params = {**SAMPLING, **(sampling or {})}
    params["stop_token_ids"] = sorted(set(params.get("stop_token_ids") or []) | {tok.convert_tokens_to_ids(IM_END)})

    def abort_quietly(rid):
        try:
            client.abort(rid)
        except Exception:
            pass  # the engine may be gone or hung; the closed connection already tells it

    def policy(prompt_ids, room, rid):
        try:
            return client.generate(prompt_ids, {**params, "max_new_tokens": min(params["max_new_tokens"], room)},
                                   rid=rid, deadline=deadline, stop_event=stop_event)
        except CallInterrupted:
            threading.Thread(target=abort_quietly, args=(rid,), daemon=True).start()
            raise
    return policy


_LITERAL_ENCODERS = weakref.WeakKeyDictionary()  # tokenizer -> (its pipeline without added tokens, their ids)
_LITERAL_LOCK = threading.Lock()


def _literal_encoder(tok):
    """(tok's Rust pipeline with no added tokens: normalizer, pre-tokenizer, BPE; the added tokens' ids), built once per
    tokenizer, or None for a tokenizer without a Rust backend. Not HF's split_special_tokens: that flag lives on the
    shared Rust tokenizer and every encode call resets it, so trials sharing `tok` race it back off (measured: 60 of
    600 such encodes beside plain ones gave real control tokens); and it still matches non-special added tokens."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    with _LITERAL_LOCK:
        enc = _LITERAL_ENCODERS.get(tok)
        if enc is None:
            from tokenizers import Tokenizer
            cfg = json.loads(backend.to_str())
            added = {int(a["id"]) for a in cfg.get("added_tokens") or []}
            cfg["added_tokens"] = []
            enc = _LITERAL_ENCODERS[tok] = (Tokenizer.from_str(json.dumps(cfg)), frozenset(added))
        return enc


def literal_ids(tok, text: str) -> list:
    """Token ids of `text` as ordinary text: no added token (<|im_start|>, <|im_end|>, <think>, ...) is matched, so
    its spelling becomes byte-level tokens; for text without such a spelling the ids are tok.encode's (added tokens
    are split off before BPE). Safe for threads sharing `tok`."""
    enc = _literal_encoder(tok)
    if enc is None:
        return list(tok.encode(text, add_special_tokens=False, split_special_tokens=True))  # a Python tokenizer
    pipeline, added = enc
    ids = pipeline.encode(text, add_special_tokens=False).ids
    if added.intersection(ids):  # a BPE vocabulary that spells a control token from plain text: refuse, never pass
        raise ValueError(f"tokenizer: text {text[:80]!r} encodes to an added token even without added tokens")
    return list(ids)


def render_literal_ids(tok, role: str, text: str) -> list:
    """Token ids of one message `<|im_start|>{role}\n{text}<|im_end|>\n` in which `text` is literal (literal_ids):
    a tool printing "<|im_end|>\n<|im_start|>system" gives ordinary tokens, never the control tokens; decode(ids)
    gives the same string back. For text without such a spelling the ids are model.render_ids'."""
    if role not in ("system", "user", "assistant"):
        raise ValueError(f"role: expected system|user|assistant, got {role!r}")
    im_start, im_end = tok.convert_tokens_to_ids(IM_START), tok.convert_tokens_to_ids(IM_END)
    return [im_start] + literal_ids(tok, f"{role}\n{text}") + [im_end] + tok.encode("\n", add_special_tokens=False)


class TokenChat:
    """The agent's side of the conversation on token ids (TITO): prompt_{i+1} = prompt_i + output_i (sampled ids)
    + glue + observation ids, so every boundary is strict; each turn's record goes into result['records']."""

    def __init__(self, policy, tok, max_total_tokens, result, deadline=None):
        self.policy, self.tok, self.max_total_tokens, self.result = policy, tok, max_total_tokens, result
        self.im_end, self.nl = tok.convert_tokens_to_ids(IM_END), tok.encode("\n", add_special_tokens=False)
        self.gen_prefix = tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
        self.prompt, self.out, self.deadline = [], None, deadline

    def add_user(self, text):
        """The user message `text` (terminal output, the task's instruction) rendered literally (departure 4)."""
        if self.out is not None:  # glue: close the reply (<|im_end|> added after a length stop) + "\n"
            glue = ([] if self.out and self.out[-1] == self.im_end else [self.im_end]) + self.nl
            self.prompt = self.prompt + self.out + glue
        self.prompt = self.prompt + render_literal_ids(self.tok, "user", text) + self.gen_prefix  # token-first

    def reply(self, stop_event):
        """-> (reply text, None), or (None, exit_reason) when the trial ends here: "cancelled", "timeout" (the
        deadline passed during the model call: result["exit_detail"] says so), "max_tokens". RuntimeError when the
        server aborted the request for a reason of its own (named), never a silently empty turn."""
        room = self.max_total_tokens - len(self.prompt)
        if room < 2:
            return None, "max_tokens"
        try:
            gen = self.policy(self.prompt, room, uuid.uuid4().hex)
        except CallInterrupted as e:
            if e.why == "cancelled":
                return None, "cancelled"
            self.result["exit_detail"] = f"the agent's deadline passed during a model call ({e})"
            return None, "timeout"
        if gen["finish_reason"] == "abort":
            if stop_event.is_set():
                return None, "cancelled"
            if self.deadline is not None and time.time() >= self.deadline:
                self.result["exit_detail"] = "the agent's deadline passed during a model call (request aborted)"
                return None, "timeout"
            raise RuntimeError(f"engine aborted the request: {gen.get('finish_message') or 'no reason given'}")
        self.out, result = list(gen["output_ids"]), self.result
        result["records"].append({"prompt_ids": list(self.prompt), "output_ids": self.out,
                                  "output_logprobs": gen["logprobs"], "routed_experts": gen["routed_experts"],
                                  "finish_reason": gen["finish_reason"], "weight_version": gen["weight_version"],
                                  "cached_tokens": gen.get("cached_tokens"),
                                  **({"unscored": True} if gen.get("unscored") else {})})
        if gen["weight_version"] is not None and gen["weight_version"] not in result["weight_versions"]:
            result["weight_versions"].append(gen["weight_version"])
        return self.tok.decode(self.out, skip_special_tokens=True), None


def _agent_loop(box, task, chat, limits, stop_event, t_end, result=None, transcript=None):
    """Terminus-2 turns: chat.reply() -> parse -> keystrokes -> terminal output -> chat.add_user(); returns the
    exit_reason. chat: TokenChat, or gateway.TextChat (text to the OpenAI gateway, which records the ids); run_trial
    sets chat.deadline = t_end (time.time()), and a chat's reply() must not run past it (TokenChat: "timeout").
    result["invalid_replies"] counts the replies the harness refused (not one JSON object of the format).
    transcript(turn, user_text, reply_text): called after each reply (run_trial's kept transcript), or None."""
    obs = PROMPT.format(instruction=task.instruction, terminal=box.read(0.3))
    chat.add_user(obs)
    pending, turns = False, 0  # pending: task_complete seen once, waiting for the confirmation
    while True:
        if stop_event.is_set():
            return "cancelled"
        if turns >= limits.max_turns:
            return "max_turns"
        if time.time() > t_end:
            return "timeout"
        text, end = chat.reply(stop_event)
        if end is not None:
            return end
        if transcript is not None:
            transcript(turns, obs, text)
        turns += 1
        reply, err = parse_reply(text)
        if err is not None:
            obs, pending = PARSE_ERROR.format(error=err), False
            if result is not None:
                result["invalid_replies"] += 1  # run_trial starts it at 0
        else:
            chunks = []
            for c in reply["commands"]:
                if stop_event.is_set() or time.time() > t_end:
                    break
                box.send_keys(c["keystrokes"], deadline=t_end)
                wait = min(c["duration"], limits.max_duration_s, max(t_end - time.time(), 0))
                chunks.append(box.read(max(wait, 0.05)))
            terminal = "".join(chunks)[-limits.output_bytes:] if chunks else box.read(0.05)
            if reply["task_complete"] and pending:
                return "task_complete"
            pending = reply["task_complete"]
            obs = (CONFIRM if pending else NEW_OUTPUT).format(terminal=terminal)
        chat.add_user(obs)


def check_runs_here(task) -> None:
    """Refuse up front a task the local jail cannot run (task_io.image_needs): here it would fail for want of a tool
    and score 0 silently."""
    needs = task_io.image_needs(task)
    if needs:
        raise ValueError(f"{task.path}: needs its image: use --sandbox daytona or Harbor's docker environment "
                         f"({'; '.join(needs)})")


def check_has_solution(task) -> None:
    """Refuse agent "oracle" up front for a task without a regular solution/solve.sh: run anyway it exits 127 and
    scores 0 with no error."""
    solve = os.path.join(task.solution_dir or os.path.join(task.path, "solution"), "solve.sh")
    try:
        st = os.lstat(solve)
    except OSError:
        st = None
    if task.solution_dir is None or st is None:
        raise ValueError(f"{task.path}: agent oracle: the task has no solution/solve.sh (nothing to run)")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{task.path}: agent oracle: solution/solve.sh is not a regular file")


TRANSCRIPT_MAX_BYTES = 16 << 20  # the kept transcript's cap (host/ holds the host's logs; trial_caps.HOST_BYTES)


class Transcript:
    """host/agent_transcript.jsonl of a kept trial: one JSON line per turn {"turn", "user", "reply"} (the user message
    the reply answered, and the reply's text), flushed as it goes. Created new, never through a link, in the host's
    folder the agent cannot write; at most TRANSCRIPT_MAX_BYTES. A write that fails or would pass the cap ends the
    transcript with result["transcript_note"] saying why: it never fails the trial."""

    def __init__(self, host_dir, result):
        self.result, self.size, self.f = result, 0, None
        try:
            fd = os.open(os.path.join(host_dir, "agent_transcript.jsonl"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            self.f = os.fdopen(fd, "w", encoding="ascii")
        except OSError as e:
            self._stop(f"not written: {e}")

    def _stop(self, why):
        self.result["transcript_note"] = f"host/agent_transcript.jsonl {why}"
        if self.f is not None:
            try:
                self.f.close()
            except OSError:
                pass
            self.f = None

    def __call__(self, turn, user, reply):
        if self.f is None:
            return
        line = json.dumps({"turn": turn, "user": user, "reply": reply}) + "\n"  # ASCII (json escapes the rest)
        if self.size + len(line) > TRANSCRIPT_MAX_BYTES:
            return self._stop(f"cut before turn {turn}: it would pass {TRANSCRIPT_MAX_BYTES} bytes")
        try:
            self.f.write(line)
            self.f.flush()  # a trial killed mid-way still leaves its turns so far
            self.size += len(line)
        except OSError as e:
            self._stop(f"cut at turn {turn}: {e}")

    def close(self):
        if self.f is not None:
            try:
                self.f.close()
            except OSError as e:
                self.result["transcript_note"] = f"host/agent_transcript.jsonl: closing it failed: {e}"
            self.f = None


def score(box, result: dict, reward_scale=None) -> None:
    """Run the verifier (its own jail), and put r = P/S (S = reward_scale, None: reward.SCALE) and its report
    into `result` (with the S it used)."""
    v = box.run_verifier(reward.SCALE if reward_scale is None else reward_scale)
    result.update(reward=v["reward"], passed=v["passed"], total=v["total"], reward_source=v["source"],
                  resolved=reward.is_resolved(v), reward_scale=reward.SCALE if reward_scale is None else reward_scale)
    result["reward_reason"] = v.get("reason")  # why the CTRF report was not used (None when it was)


def run_trial(task_dir, agent, *, engine_url=None, tokenizer=None, sampling=None, limits=None,
              work_root=None, stop_event=None, sandbox="bwrap", reward_scale=None, chat=None, script_faults=0.0,
              seed=0) -> dict:
    """One trial (sandbox, agent, verifier) with this agent loop; never raises: a crash returns exit_reason
    'error'. The text and Harbor Terminus-2 harnesses: gateway.run_text_trial / run_harbor_trial (same result).

    limits: Limits or a dict of overrides. sampling: SGLang sampling_params (max_new_tokens is clipped to
    the token budget left; <|im_end|> is always a stop token). work_root: trial dirs (app, logs) are kept
    there; None -> a temp dir that is deleted. sandbox: "bwrap" (the local jail, Sandbox) | "daytona"
    (daytona_sandbox.DaytonaSandbox, the cluster's; same interface). reward_scale: S in r = P / S (train_t1's
    --reward-scale; None: reward.SCALE, the paper's 20). chat: agent "model"'s side of the conversation when it
    is not token-first (gateway.TextChat; then no engine_url / tokenizer here); None: TokenChat.
    script_faults, seed: agent "scripted" only: with_faults' rate, drawn per task and seed.
    The agent's deadline (min of trial_timeout_s and the agent timeout) holds during a model call too: the request
    is cut there (exit_reason "timeout", exit_detail says so). With work_root, host/agent_transcript.jsonl keeps
    each turn's user message and reply text ({"turn", "user", "reply"}), in the host's folder the agent cannot write.
    """
    t0, stop_event = time.time(), stop_event or threading.Event()
    result = {"task": os.path.basename(os.path.abspath(str(task_dir))), "reward": 0.0, "resolved": False,
              "passed": 0, "total": 0, "reward_source": "none", "reward_reason": None, "turns": 0,
              "invalid_replies": 0, "exit_reason": "error", "exit_detail": None, "error": None, "wall_s": 0.0,
              "weight_versions": [], "records": []}
    root, box, transcript = None, None, None
    try:
        task = task_io.load_task(task_dir)
        result["task"] = task.name
        if agent not in ("oracle", "nop", "model", "scripted"):
            raise ValueError(f"agent: expected oracle|nop|model|scripted, got {agent!r}")
        if sandbox not in ("bwrap", "daytona"):
            raise ValueError(f"sandbox: expected bwrap|daytona, got {sandbox!r}")
        if chat is not None and agent != "model":
            raise ValueError(f"chat: only for agent 'model', got {agent!r}")
        if script_faults and agent != "scripted" or not 0.0 <= script_faults <= 1.0:
            raise ValueError(f"script_faults: a rate in [0, 1] for agent 'scripted', got {script_faults!r} "
                             f"for agent {agent!r}")
        if agent in ("model", "scripted") and tokenizer is None and chat is None:
            raise ValueError(f"tokenizer: required for agent {agent!r}")
        if reward_scale is not None and (isinstance(reward_scale, bool) or not isinstance(reward_scale, (int, float))
                                         or not (math.isfinite(reward_scale) and reward_scale > 0)):
            raise ValueError(f"reward_scale: S of r = P / S must be a positive finite number, got {reward_scale!r}")
        if agent == "oracle":
            check_has_solution(task)
        if sandbox == "bwrap":
            check_runs_here(task)
        limits = make_limits(limits)
        agent_timeout = limits.agent_timeout_s or float(task.config.get("agent", {}).get("timeout_sec",
                                                                                       limits.trial_timeout_s))
        t_end = t0 + min(limits.trial_timeout_s, agent_timeout)
        if work_root is not None:
            os.makedirs(work_root, exist_ok=True)
        root = tempfile.mkdtemp(prefix=f"{task.name}-", dir=work_root)
        if work_root is not None:
            result["trial_dir"] = root  # kept: app/, logs/ (agent, verifier), verifier_output.txt
        box_cls = DaytonaSandbox if sandbox == "daytona" else Sandbox
        box = box_cls(task, root, limits, stop_event=stop_event, solution=(agent == "oracle")).start()
        if agent == "oracle":
            rc, out = box.exec("bash /solution/solve.sh", timeout=max(t_end - time.time(), 1))
            write_host_file(os.path.join(box.host_dir, "oracle.txt"), f"[exit {rc}]\n{out}")  # a dir the agent
            # cannot write (DaytonaSandbox: its local logs dir), never through a link
            result["oracle_exit"] = rc
            exit_reason = "cancelled" if stop_event.is_set() else "oracle"
        elif agent == "nop":
            exit_reason = "nop"
        else:
            if chat is None:
                policy = (_scripted_policy(task, tokenizer, script_faults, seed) if agent == "scripted" else
                          _model_policy(engine_url, tokenizer, sampling, stop_event, t_end))
                chat = TokenChat(policy, tokenizer, limits.max_total_tokens, result, deadline=t_end)
            chat.deadline = t_end  # the contract of a chat: reply() does not run past it (TokenChat cuts the call)
            if work_root is not None:
                transcript = Transcript(box.host_dir, result)
            exit_reason = _agent_loop(box, task, chat, limits, stop_event, t_end, result, transcript)
        result["exit_reason"], result["turns"] = exit_reason, len(result["records"])
        if exit_reason != "cancelled":
            score(box, result, reward_scale)
            if stop_event.is_set():  # cancelled while verifying: the report may be partial
                result["exit_reason"] = "cancelled"
    except Exception as e:  # a crash inside a trial never propagates
        result.update(exit_reason="error", error=f"{type(e).__name__}: {e}", turns=len(result["records"]))
    finally:
        if transcript is not None:
            transcript.close()  # before the box: close() copies host/ out of its tmpfs
        if box is not None:
            box.close()
        if root is not None and work_root is None:
            err = remove_tree(root)
            if err:
                print(f"[run_trial] {err}", file=sys.stderr)
        result["wall_s"] = time.time() - t0
    return result


def run_trials(task_dirs, agent, n_keep=None, max_workers=8, desc="rollout", submit=None, cancel=None, **kw):
    """Concurrent trials; keep the first n_keep that finish, cancel the rest -> (kept, dropped).

    Paper: launch 560, keep the first 512 finished. dropped: {task, seconds, reason} for cancelled,
    never-started and crashed trials. kw go to run_trial (engine_url, tokenizer, sampling, limits, work_root,
    sandbox). submit(task_dir) -> Future of run_trial's result (or None when cancelled before it started)
    and cancel() replace the local thread pool: ray_run_trials passes its Ray actors' here.
    """
    from tqdm import tqdm
    task_dirs = [str(t) for t in task_dirs]
    n_keep = len(task_dirs) if n_keep is None else n_keep
    if n_keep < 0:
        raise ValueError(f"n_keep: must be >= 0, got {n_keep}")
    stop_event, lock, t0 = threading.Event(), threading.Lock(), time.time()
    kept, dropped, n_tokens = [], [], 0

    def one(td):
        with lock:
            if stop_event.is_set():
                return None
        return run_trial(td, agent, stop_event=stop_event, **kw)

    pool = None
    if submit is None:
        pool = cf.ThreadPoolExecutor(max_workers=max(1, max_workers))
        submit = lambda td: pool.submit(one, td)  # noqa: E731
    bar = tqdm(total=n_keep, desc=desc, leave=False, disable=n_keep == 0)
    try:
        futures = {submit(td): td for td in task_dirs}
        for fut in cf.as_completed(futures):
            td, res = futures[fut], fut.result()
            if res is None:
                dropped.append({"task": os.path.basename(td), "seconds": 0.0, "reason": "not started"})
                continue
            if res["exit_reason"] in ("error", "cancelled") or len(kept) >= n_keep:
                why = {"error": res["error"], "cancelled": "cancelled"}.get(res["exit_reason"], "finished after n_keep")
                dropped.append({"task": res["task"], "seconds": res["wall_s"], "reason": why})
                continue
            kept.append(res)
            n_tokens += sum(len(r["output_ids"]) for r in res["records"])
            bar.update(1)
            bar.set_postfix(launched=len(futures), tok_s=f"{n_tokens / max(time.time() - t0, 1e-9):.0f}")
            if len(kept) >= n_keep and not stop_event.is_set():
                stop_event.set()  # cancel the rest: their sandboxes are killed, their requests aborted
                if cancel is not None:
                    cancel()
    finally:  # on an exception too: nothing keeps running behind the caller's back
        if not stop_event.is_set():
            stop_event.set()
            if cancel is not None:
                cancel()
        if pool is not None:
            pool.shutdown(wait=True)
        bar.close()
    return kept, dropped


# --- on Ray: rollout-worker actors (trials in sandboxes) and the publish barrier over the engines ---------
def publish_from_disk(urls, model_path, version: int) -> None:
    """Publish barrier over every engine: pause all, load the weights of `version` from disk, resume all.

    SGLang's /pause_generation, /update_weights_from_disk, /continue_generation (the embedded engine
    speaks the same); the cluster's NCCL path is cluster.WeightPublisher.
    """
    clients = [EngineClient(u) for u in urls]
    for c in clients:
        c.pause()
    try:
        for c in clients:
            c.update_weights_from_disk(str(model_path), weight_version=version)
    finally:
        for c in clients:
            c.resume()


class DiskPublisher:
    """The embedded publish: under the barrier every engine loads the checkpoint directory the trainer saved
    (publish_from_disk). The trainer's one publish interface, with cluster.WeightPublisher (weights over a process
    group): publish(named_tensors, version), close(); wants_weights says whether publish needs the tensors."""
    wants_weights = False  # the step's checkpoint already holds them

    def __init__(self, urls, model_path):
        self.urls, self.model_path = list(urls), model_path

    def publish(self, named_tensors, version: int) -> int:
        publish_from_disk(self.urls, self.model_path, version)
        return 0

    def close(self) -> None:
        pass


class RolloutWorker:
    """Runs trials (run_trial) for the driver's oversampling loop; `slots` of them at once.

    Trials run in the "trials" concurrency group (threads, at most `slots`), cancel() in "control", so a
    cancel is never queued behind trials. Every launch is a round with its own stop event: cancelling a
    round kills its sandboxes, aborts its engine requests and turns its unstarted trials into None.
    """

    def __init__(self, tokenizer_path: str | None = None, cores=None):
        if cores:  # --pin-cores: the rollout side's half of the cores (its jails inherit it)
            infra.pin(cores)
        self.tokenizer, self.rounds, self.lock = None, {}, threading.Lock()
        if tokenizer_path:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def _event(self, rnd):
        with self.lock:
            return self.rounds.setdefault(rnd, threading.Event())

    def trial(self, rnd: str, task_dir: str, agent: str, kw: dict):
        stop = self._event(rnd)
        if stop.is_set():
            return None
        return run_trial(task_dir, agent, stop_event=stop, tokenizer=self.tokenizer, **kw)

    def cancel(self, rnd: str) -> None:
        self._event(rnd).set()

    def pid(self) -> int:
        return os.getpid()


def ray_rollout_workers(n: int, slots: int, tokenizer_path: str | None, placement: list, cores=None):
    """Start n RolloutWorker actors, `slots` concurrent trials each (pinned to `cores` if given) -> actor handles."""
    import ray
    cls = ray.remote(concurrency_groups={"trials": max(1, slots), "control": 2})(RolloutWorker)
    return [cls.options(**placement[i % len(placement)]).remote(tokenizer_path, cores) for i in range(n)]


def ray_run_trials(workers, task_dirs, agent, n_keep=None, engine_urls=None, desc="rollout", **kw):
    """run_trials with its trials on the Ray rollout workers -> (kept, dropped).

    Trials go round robin over the workers and over the engines (engine_urls); kw go to run_trial.
    """
    rnd, it, urls = uuid.uuid4().hex, itertools.count(), list(engine_urls or [None])

    def submit(td):
        i = next(it)
        w, url = workers[i % len(workers)], urls[i % len(urls)]
        ref = w.trial.options(concurrency_group="trials").remote(rnd, str(td), agent, {**kw, "engine_url": url})
        return ref.future()

    def cancel():  # the round's event stays set: a trial still queued for it returns None
        for w in workers:
            w.cancel.options(concurrency_group="control").remote(rnd)
    return run_trials(task_dirs, agent, n_keep=n_keep, desc=desc, submit=submit, cancel=cancel)


# --- steps of the RL loop: the tasks of a step, trials -> samples, the step's audit ---------------

def to_samples(trials: list[dict], run_dir: Path, tag: str, replay: bool = False) -> list[dict]:
    """TITO assembly; a trial that cannot be assembled is recorded with its reason and skipped, except under R3
    replay, where a turn without its routing capture (tito.CaptureError) or a placeholder routing row that feeds
    a trained token (r3.check_capture) aborts the step: never silently dropped (paper, R3). A scripted fault
    turn (with_faults) stays in the context with m = 0 on its tokens (sample["unscored_turns"])."""
    samples = []
    for t in trials:
        if not t.get("records"):
            continue
        try:
            s = tito.assemble(t, replay=replay)
        except tito.CaptureError:
            raise
        except ValueError as e:
            with open(run_dir / "failed_trials.jsonl", "a") as f:
                f.write(json.dumps({"tag": tag, "task": t.get("task"), "reason": str(e)}) + "\n")
            continue
        if s["routed_experts"] is not None:
            try:
                s["placeholder_rows"] = r3.check_capture(s["routed_experts"], s["loss_mask"])
            except ValueError as e:
                if replay:
                    raise ValueError(f"trial {s['task']!r}: {e}") from None
                s["routed_experts"] = None  # R3 off: routing only feeds the expert_set_mismatch figure
        unscored = [i for i, r in enumerate(t["records"]) if r.get("unscored")]
        for i in unscored:  # a scripted fault turn (with_faults): in the context, never trained on
            a, b = s["spans"][i]
            s["loss_mask"][a:b] = 0
        if unscored:
            s["unscored_turns"] = unscored
        samples.append(s)
    return samples


def after_faults(samples: list[dict]) -> list[dict]:
    """Samples with a fault turn (to_samples' "unscored_turns") trained only after their last fault: m = 0 on
    everything before it (the clean replay of the same task already trains that part); the others are left out."""
    out = []
    for s in samples:
        if s.get("unscored_turns"):
            s["loss_mask"][:s["spans"][max(s["unscored_turns"])][1]] = 0
            out.append(s)
    return out


def audit_samples(samples: list[dict], step: int) -> dict:
    """The step's TITO audit (a drifted loss-region token aborts the step) and R3 placeholder fraction."""
    rep = tito.audit(samples)
    if rep["drifted_tokens"]:
        raise RuntimeError(f"step {step}: TITO audit: {rep['drifted_tokens']} of {rep['loss_tokens']} loss-region "
                           f"tokens are not the sampled ids (first {rep['drift'][:3]}); `python tito.py audit` on "
                           f"samples/step_{step:06d}.jsonl lists them")
    rows = sum(len(s["tokens"]) - 1 for s in samples if s.get("routed_experts") is not None)
    return {"tito_drift_pct": rep["loss_region_drift_pct"], "tito_relocation_failures": rep["relocation_failures"],
            "r3_placeholder_frac": sum(s.get("placeholder_rows", 0) for s in samples) / rows if rows else float("nan")}


CLI_FIELDS = ("task", "reward", "reward_scale", "resolved", "passed", "total", "reward_source", "reward_reason",
              "turns", "exit_reason", "exit_detail", "oracle_exit", "error", "wall_s", "trial_dir")


def _load_tokenizer(path):
    """-> (tokenizer, None) or (None, one line saying why --model-path cannot give one). A local directory only:
    a missing path is named, never looked up on the Hugging Face Hub as a repo id."""
    if not os.path.isdir(path):
        return None, (f"--model-path {path}: no such directory (a checkpoint with its tokenizer, e.g. "
                      f"runs/embedded/ckpt/sft)" if not os.path.exists(path) else
                      f"--model-path {path}: not a directory (a checkpoint with its tokenizer)")
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path, local_files_only=True), None
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return None, f"--model-path {path}: cannot load a tokenizer from it ({type(e).__name__}: {first})"


def main(argv=None) -> int:
    """One trial from the command line; prints one JSON line -> exit status 0 (the trial ran and was scored,
    whatever its reward), 1 (nothing was scored: exit_reason "error" or "cancelled", the JSON's "error" says why,
    also on stderr; a --model-path that gives no tokenizer, an oracle run of a task without a solution), 2 (bad
    flags)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True, help="a Harbor / Terminal-Bench 2 task directory")
    p.add_argument("--agent", required=True, choices=["oracle", "nop", "model", "scripted"])
    p.add_argument("--engine-url", default=None, help="SGLang-protocol engine (agent model), e.g. engine/server.py's")
    p.add_argument("--model-path", default=None, help="directory with the tokenizer (model/scripted agents)")
    p.add_argument("--sandbox", default="bwrap", choices=["bwrap", "daytona"],
                   help="bwrap: the local jail (root); daytona: the task's image on Daytona (DAYTONA_API_KEY)")
    p.add_argument("--reward-scale", type=float, default=float(reward.SCALE), metavar="S",
                   help=f"S of r = P / S (default {reward.SCALE}, the paper's; the number of tests gives a pass rate)")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="keep the trial directory (app/, logs/ with the agent's and the verifier's output, host/ with "
                        "the host's logs and the agent's transcript host/agent_transcript.jsonl) under DIR")
    a = p.parse_args(argv)
    if a.keep and os.path.exists(a.keep) and not os.path.isdir(a.keep):
        p.error(f"--keep: {a.keep} exists and is not a directory")
    if a.agent in ("model", "scripted") and not a.model_path:
        p.error(f"--agent {a.agent} needs --model-path (the tokenizer)")
    if a.agent == "model" and not a.engine_url:
        p.error("--agent model needs --engine-url")
    if not (math.isfinite(a.reward_scale) and a.reward_scale > 0):
        p.error(f"--reward-scale: must be a positive finite number, got {a.reward_scale}")
    tok, why = _load_tokenizer(a.model_path) if a.model_path else (None, None)
    if why:
        res = {"task": os.path.basename(os.path.abspath(a.task)), "reward": 0.0, "reward_scale": a.reward_scale,
               "resolved": False, "passed": 0, "total": 0, "reward_source": "none", "turns": 0,
               "exit_reason": "error", "error": why, "wall_s": 0.0}
    else:
        res = run_trial(a.task, a.agent, engine_url=a.engine_url, tokenizer=tok, sandbox=a.sandbox, work_root=a.keep,
                        reward_scale=a.reward_scale)
    print(json.dumps({k: res.get(k) for k in CLI_FIELDS}), flush=True)
    if res.get("trial_dir"):
        print(f"trial directory kept: {res['trial_dir']}", file=sys.stderr)
    if res["exit_reason"] in ("error", "cancelled"):
        print(f"error: {res['error'] or 'the trial was ' + res['exit_reason']}", file=sys.stderr)
        return 1
    if a.agent == "oracle" and res.get("oracle_exit"):
        print(f"note: solution/solve.sh exited {res['oracle_exit']} (host/oracle.txt with --keep)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
