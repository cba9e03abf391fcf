"""The OpenAI chat-completions request format as the token gateway (engine/gateway.py) takes it: parse_chat validates
a /v1/chat/completions body before anything else happens, APIError is OpenAI's error shape
{"error": {message, type, param, code}} with the HTTP status.

Machinery of the paper's TITO section (the gateway is where text harnesses get their token ids back). What is refused:
400 naming any invalid field (OpenAI's types and ranges; messages of {role: system|user|assistant, content: str |
null | text parts}); 400 "not supported" (code unsupported_parameter) for the non-neutral values of UNSUPPORTED (n > 1,
stream, tools, response_format other than text, penalties, ...), image parts, tool messages; 404 model_not_found for
a model other than MODEL_ID; 400 naming the field for text that is not Unicode (a lone surrogate). Unknown fields are
ignored (LiteLLM adds vendor extras). Run: not by itself; tests/test_gateway.py sends it malformed bodies.
"""
import json
import math

from engine import httpjson

MODEL_ID = "t1"  # the one model served (Harbor's config names it openai/t1; LiteLLM sends "t1")
MAX_STOP = 4  # OpenAI's limit on `stop` strings
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


def content_text(content, where) -> str:
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
        messages.append({"role": m["role"], "content": content_text(m.get("content"), where + ".content")})
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
