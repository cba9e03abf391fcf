"""Terminus-2: the harness the agent acts through, one turn at a time (paper section "rollout", T1 arXiv 2609.11042).

The agent replies with one JSON object per turn {"analysis", "plan", "commands": [{"keystrokes", "duration"}],
"task_complete"} (PROMPT, parse_reply); the keystrokes go to a real shell in the sandbox and the new terminal output is
the next user message; `task_complete` must be confirmed on a second turn (CONFIRM); a reply that does not parse is
answered with the error (PARSE_ERROR). agent_loop runs these turns; rollout.run_trial sets up the sandbox around it and
scores the trial. The agent's side of the conversation is a chat:
- TokenChat (the trained path, TITO): the history is kept as token ids, prompt_{i+1} = prompt_i + output_i (the
  sampled ids, stop token included) + glue + observation ids, so every turn boundary is strict by construction and
  the loss tokens are exactly the sampled ones;
- TextChat: the whole message list re-sent as text to the OpenAI gateway (engine/gateway.py), which records the ids
  (the text harness that `python -m experiments.bench tito --harness client` measures).
fault_reply / with_faults write the mistakes a T = 1 sample makes into scripted replies (the SFT data's recoveries);
Transcript keeps a kept trial's turns in host/agent_transcript.jsonl.

Run: not by itself; `python rollout.py --task DIR --agent scripted|model ...` runs one trial with it.

Departures from the paper / Terminus-2:
1. Prompt texts are condensed (a few lines, same JSON schema): the embedded policy is a tiny model trained from
   scratch, Terminus-2's long prompt would dominate its context.
2. Tool output, the instruction and scripted replies are encoded as text (literal_ids): a token's spelling in them
   (<|im_end|>, <think>) is byte-level text, never the control token, so a command cannot forge chat structure (as chat
   servers escape it); text without such a spelling keeps its exact ids; sampled ids are untouched (TITO unchanged).
3. The first observation waits for the shell's prompt (up to FIRST_PROMPT_S, not a fixed 0.3 s), and the scripted
   expert (settle=True: the SFT transcripts) waits for each command's prompt (up to SETTLE_S) instead of its reply's
   `duration`: a fixed wait can cut a slow command's output at a timing-dependent point, so the SFT data would depend
   on the machine's load. The model's commands keep Terminus-2's duration semantics.
"""
import json
import math
import os
import threading
import time
import uuid
import weakref

from chat_tokens import ASSISTANT_PREFIX, IM_END, IM_START
from engine.client import CallInterrupted, chat_completion


# --- the protocol: prompt texts and the reply format ------------------------------------------------------
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


# --- fault turns: the mistakes a T = 1 sample makes, written into scripted replies -----------------------
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


# --- text as text: tool output never becomes a control token ----------------------------------------------
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


# --- the agent's side of the conversation: on token ids (TITO) or as text to the OpenAI gateway -----------
class TokenChat:
    """The agent's side of the conversation on token ids (TITO): prompt_{i+1} = prompt_i + output_i (sampled ids)
    + glue + observation ids, so every boundary is strict; each turn's record goes into result['records']."""

    def __init__(self, policy, tok, max_total_tokens, result, deadline=None):
        self.policy, self.tok, self.max_total_tokens, self.result = policy, tok, max_total_tokens, result
        self.im_end, self.nl = tok.convert_tokens_to_ids(IM_END), tok.encode("\n", add_special_tokens=False)
        self.gen_prefix = tok.encode(ASSISTANT_PREFIX, add_special_tokens=False)
        self.prompt, self.out, self.deadline = [], None, deadline

    def add_user(self, text):
        """The user message `text` (terminal output, the task's instruction) rendered literally (departure 2)."""
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


class TextChat:
    """The agent's side of agent_loop as an OpenAI client: the whole message list is re-sent as text each
    turn, the replies verbatim (as Harbor's Chat keeps them); the gateway records the token ids under session_id."""

    def __init__(self, gateway_url, session_id, sampling=None, deadline=None):
        self.url, self.session_id, self.messages, self.deadline = gateway_url, session_id, [], deadline
        self.sp = {**SAMPLING, **(sampling or {})}

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
        except CallInterrupted as e:
            return None, "timeout" if e.why == "deadline" else "cancelled"
        except RuntimeError as e:
            if "context length" in str(e):  # the gateway counts the tokens (ContextLengthExceeded)
                return None, "max_tokens"
            raise
        content = resp["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": content})
        return content, None


# --- the turns -----------------------------------------------------------------------------------------
FIRST_PROMPT_S = 5.0  # the first observation: the shell's prompt, read until it is back (early) or this long (ours)
SETTLE_S = 10.0  # settle=True: a command's output read until the prompt is back (early) or this long (ours)


def agent_loop(box, task, chat, limits, stop_event, t_end, result=None, transcript=None, settle=False):
    """Terminus-2 turns: chat.reply() -> parse -> keystrokes -> terminal output -> chat.add_user(); returns the
    exit_reason. chat: TokenChat, or TextChat (text to the OpenAI gateway, which records the ids); rollout.run_trial
    sets chat.deadline = t_end (time.time()), and a chat's reply() must not run past it (TokenChat: "timeout").
    result["invalid_replies"] counts the replies the harness refused (not one JSON object of the format).
    transcript(turn, user_text, reply_text): called after each reply (run_trial's kept transcript), or None.
    settle: each command's output is read until the shell's prompt is back (up to SETTLE_S, max_duration_s, t_end),
    whatever its duration says (the scripted expert: departure 3); box.read returns early once the prompt is back."""
    obs = PROMPT.format(instruction=task.instruction, terminal=box.read(max(0.05, min(FIRST_PROMPT_S,
                                                                                      t_end - time.time()))))
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
                wait = min(SETTLE_S if settle else c["duration"], limits.max_duration_s, max(t_end - time.time(), 0))
                chunks.append(box.read(max(wait, 0.05)))
            terminal = "".join(chunks)[-limits.output_bytes:] if chunks else box.read(0.05)
            if reply["task_complete"] and pending:
                return "task_complete"
            pending = reply["task_complete"]
            obs = (CONFIRM if pending else NEW_OUTPUT).format(terminal=terminal)
        chat.add_user(obs)


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
