"""The HTTP clients of the project's two servers: the engine's SGLang protocol (EngineClient: /generate with input_ids,
the weight endpoints, pause / resume) and the token gateway's OpenAI chat completions (chat_completion), both with a
hard end per call (post_guarded); and the embedded publish barrier over every engine (publish_from_disk,
DiskPublisher).

Machinery of the paper's rollout and infrastructure sections: rollout.py and terminus2.py talk to the engine through
EngineClient (one client for both scales: engine/server.py and SGLang speak the same protocol); the trainer
publishes each step's weights with DiskPublisher at embedded scale (cluster.publish.WeightPublisher at cluster scale:
weights over a process group). Run: not by itself; tests/test_rollout_hardening.py cuts slow and hung servers with it.
"""
import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import r3


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


# --- the publish barrier over the engines (embedded scale) ---------------------------------------------
def publish_from_disk(urls, model_path, version: int) -> None:
    """Publish barrier over every engine: pause all, load the weights of `version` from disk, resume all.

    SGLang's /pause_generation, /update_weights_from_disk, /continue_generation (the embedded engine
    speaks the same); the cluster's NCCL path is cluster.publish.WeightPublisher.
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
    (publish_from_disk). The trainer's one publish interface, with cluster.publish.WeightPublisher (weights over a
    process group): publish(named_tensors, version), close(); wants_weights says whether publish needs the tensors."""
    wants_weights = False  # the step's checkpoint already holds them

    def __init__(self, urls, model_path):
        self.urls, self.model_path = list(urls), model_path

    def publish(self, named_tensors, version: int) -> int:
        publish_from_disk(self.urls, self.model_path, version)
        return 0

    def close(self) -> None:
        pass


# --- the OpenAI side: a minimal client of the gateway (engine/gateway.py) ------------------------------------
def chat_completion(url, messages, session_id=None, timeout=600, deadline=None, stop_event=None, **params) -> dict:
    """A minimal OpenAI client: POST /v1/chat/completions -> response dict (RuntimeError on HTTP errors).
    deadline (a time.time() value) / stop_event: the call ends there, its connection shut (post_guarded: the
    gateway sees the hang-up, aborts the engine request and records nothing) -> CallInterrupted."""
    body = json.dumps({"model": "t1", "messages": messages, **params}).encode()
    headers = {"Content-Type": "application/json", **({"X-Session-ID": session_id} if session_id else {})}
    status, raw = post_guarded(url.rstrip("/") + "/v1/chat/completions", body, headers, timeout=timeout,
                               deadline=deadline, stop_event=stop_event, what="gateway")
    if status >= 400:
        raise RuntimeError(f"gateway: HTTP {status}: {raw[:300].decode(errors='replace')}")
    return json.loads(raw)
