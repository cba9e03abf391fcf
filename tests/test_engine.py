"""Tests for the embedded engine (engine/server.py, batcher.py, protocol.py, weights.py, kvcache.py) over real HTTP:
wire format, batching, weight updates, the CLI, and requests refused before they join a batch."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import server as engine_lib  # noqa: E402
from engine import batcher  # noqa: E402
from engine import httpjson  # noqa: E402
from engine import kvcache  # noqa: E402
from engine import protocol  # noqa: E402
import model as model_lib  # noqa: E402
import r3  # noqa: E402
from test_model import prompt  # noqa: E402

torch.set_num_threads(2)


def post(url, obj, raw=None):
    data = raw if raw is not None else json.dumps(obj).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())


def get_status(url):
    """get() that returns an error status and its JSON body instead of raising."""
    try:
        return get(url)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=8).start()
    yield eng
    eng.stop()


def generate(engine, ids, **sp):
    sp.setdefault("max_new_tokens", 12)
    status, out = post(engine.url + "/generate", {"input_ids": ids, "sampling_params": sp,
                                                  "return_logprob": True, "return_routed_experts": True})
    assert status == 200, out
    return out


def generate_together(engine, prompts, seeds=None, **sp):
    """The replies to `prompts` sent while the engine is paused, so that all of them wait in its queue and then run
    as ONE left-padded batch; seeds: one per prompt (None: unseeded)."""
    seeds = list(seeds) if seeds is not None else [None] * len(prompts)
    results = [None] * len(prompts)

    def worker(i):
        extra = {} if seeds[i] is None else {"seed": seeds[i]}
        results[i] = generate(engine, prompts[i], **sp, **extra)
    assert post(engine.url + "/pause_generation", {})[0] == 200
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 10
    while len(engine.queue) < len(prompts) and time.time() < deadline:
        time.sleep(0.01)
    assert len(engine.queue) == len(prompts)  # all waiting
    assert post(engine.url + "/continue_generation", {})[0] == 200
    for t in threads:
        t.join()
    return results


# --- engine ------------------------------------------------------------------------------------------
def test_engine_wire_format_logprobs_and_routing_match_a_teacher_forced_forward(engine, tok, ckpt):
    check_wire_format(engine, tok, ckpt)


def test_engine_serves_the_qwen3_moe_layout_of_the_megatron_backend(tok, tmp_path):
    path = str(tmp_path / "q3")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_moe"), seed=0), tok, path)
    eng = engine_lib.EngineServer(path, port=0, max_batch=4).start()
    try:
        assert type(eng.model).__name__ == "Qwen3MoeForCausalLM"
        check_wire_format(eng, tok, path)
    finally:
        eng.stop()


def test_the_engines_own_forward_equals_the_transformers_forward(tok, tmp_path):
    """model.engine_forward (Qwen3-MoE prefills and decode steps, forward="own") against the transformers forward
    (forward="hf"): prompts of different lengths prefilled and decoded together (left padding; one prompt past
    DENSE_EXPERT_ROWS tokens, so both expert paths run), then each conversation's next turn on top of its
    prefix-cache entry; sampled with seeds: the same tokens, logprobs within _same_reply's 1e-4 (measured:
    <= 1e-6), the same routed experts. The hybrid layout stays on the transformers forward."""
    path = str(tmp_path / "q3")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_moe"), seed=2), tok, path)
    own = engine_lib.EngineServer(path, port=0, max_batch=4).start()
    hf = engine_lib.EngineServer(path, port=0, max_batch=4, forward="hf").start()
    try:
        assert own.own_forward and not hf.own_forward
        prompts = [prompt(tok, t) for t in ("a", "list the files in /app please", "grep error in every log " * 20)]
        assert len(prompts[2]) > model_lib.DENSE_EXPERT_ROWS
        replies = {}
        for name, eng in (("own", own), ("hf", hf)):
            out = generate_together(eng, prompts, seeds=range(len(prompts)), temperature=1.0, max_new_tokens=24,
                                    ignore_eos=True)
            nxt = [generate(eng, p + r["output_ids"] + prompt(tok, "ok"), temperature=1.0, max_new_tokens=8,
                            ignore_eos=True, seed=7) for p, r in zip(prompts, out)]
            assert all(r["meta_info"]["cached_tokens"] > 0 for r in nxt)
            replies[name] = out + nxt
        for a, b in zip(replies["own"], replies["hf"]):
            _same_reply(a, b)
    finally:
        own.stop()
        hf.stop()
    with pytest.raises(ValueError, match="forward"):
        engine_lib.EngineServer(path, port=0, forward="fast")
    hybrid = model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_5_moe"), seed=0)
    assert not model_lib.supports_engine_forward(hybrid)


@pytest.mark.parametrize("n", [1, 8, model_lib.GROUPED_EXPERT_ROWS - 1, model_lib.GROUPED_EXPERT_ROWS, 40,
                               model_lib.DENSE_EXPERT_ROWS, model_lib.DENSE_EXPERT_ROWS + 1, 300])
def test_every_expert_path_equals_the_transformers_experts(tok, n):
    """engine_forward's routed experts (model._experts: every expert on every token, grouped by expert and padded, or
    one expert at a time, by token count) against transformers' own experts module on the same routing: random
    routing, and routing that leaves most experts without a token (the padded groups then hold one expert's tokens;
    an empty expert must add nothing). Measured differences <= 1e-6."""
    m = model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_moe"), seed=3).eval()
    (L, *_), _, _, _ = model_lib.engine_layers(m)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, m.config.hidden_size, generator=g)
    k, E = m.config.num_experts_per_tok, m.config.num_experts
    top, ids = torch.randn(n, E, generator=g).topk(k, dim=-1)
    skewed = torch.stack([torch.tensor([1, 6])[torch.randperm(2, generator=g)] for _ in range(n)])  # experts 1, 6
    for route in (ids, skewed):
        w = top.softmax(-1)
        with torch.inference_mode():
            want = L.experts(x, route, w)
            got = model_lib._experts(L, x, w, route, torch.zeros_like(x))
        assert (got - want).abs().max() < 1e-5, f"{n} tokens: experts differ by {(got - want).abs().max():.2e}"


def test_engine_forward_follows_weight_loads(tok):
    """engine_forward keeps fused copies of the weights (model.engine_layers): a load into the parameters (as the
    engine's weight updates do) must reach the next forward, and dropping the copies frees them."""
    cfg = model_lib.tiny_config(len(tok), "qwen3_moe")
    a, b = (model_lib.build_actor(cfg, seed=s).eval() for s in (0, 1))
    ids = torch.tensor([prompt(tok, "list the files")])
    mask = torch.ones_like(ids)
    pos = torch.arange(ids.shape[1])[None]

    def logits(m):
        return model_lib.engine_forward(m, ids, pos, mask, kvcache.DynamicCache(config=cfg))
    before, want = logits(a), logits(b)
    assert not torch.allclose(before, want)
    a.load_state_dict(b.state_dict())
    assert torch.equal(logits(a), want)
    assert "_engine_layers" in a.__dict__
    model_lib.drop_engine_layers(a)
    assert "_engine_layers" not in a.__dict__ and torch.equal(logits(a), want)


def check_wire_format(engine, tok, ckpt):
    ids = prompt(tok, "count the errors")
    out = generate(engine, ids, temperature=0.8, max_new_tokens=16, seed=3)
    meta, out_ids = out["meta_info"], out["output_ids"]
    n_in, n_out = len(ids), len(out_ids)
    assert meta["prompt_tokens"] == n_in and meta["completion_tokens"] == n_out >= 1
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "0"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out_ids
    routed = r3.decode_routed_experts(meta["routed_experts"], 4, 2)
    assert routed.shape == (n_in + n_out - 1, 4, 2) and routed.dtype.name == "int32"
    # teacher-forced forward of the same bf16-rounded weights
    ref, _ = model_lib.load_actor(ckpt)
    model_lib.round_to_bf16(ref.eval())
    full = torch.tensor([ids + out_ids])  # (1, n_in + n_out)
    with torch.no_grad(), r3.routing(ref, "record") as rec:
        logits = ref(full).logits[0, n_in - 1:-1]  # (n_out, V): predicts each output token
    want = torch.log_softmax(logits / 0.8, dim=-1).gather(1, torch.tensor(out_ids)[:, None])[:, 0]
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert (rec.experts[0, :-1].numpy() == routed).mean() > 0.99  # sampler routing == trainer routing
    # greedy: logprob of the raw distribution; same seed -> same sample
    greedy = generate(engine, ids, temperature=0, max_new_tokens=4)["meta_info"]["output_token_logprobs"]
    first = torch.log_softmax(logits[0], -1)
    assert greedy[0][1] == int(first.argmax()) and abs(greedy[0][0] - float(first.max())) < 1e-4
    assert generate(engine, ids, temperature=0.8, max_new_tokens=16, seed=3)["output_ids"] == out_ids


def test_stop_token_is_included_in_output_with_its_logprob(engine, tok):
    ids = prompt(tok, "stop early")
    first = generate(engine, ids, temperature=0, max_new_tokens=3)["output_ids"][0]
    out = generate(engine, ids, temperature=0, max_new_tokens=10, stop_token_ids=[first])
    meta = out["meta_info"]
    assert out["output_ids"] == [first] and meta["finish_reason"] == {"type": "stop", "matched": first}
    assert len(meta["output_token_logprobs"]) == 1
    assert r3.decode_routed_experts(meta["routed_experts"], 4, 2).shape == (len(ids), 4, 2)
    length = generate(engine, ids, temperature=0, max_new_tokens=3, ignore_eos=True)["meta_info"]
    assert length["finish_reason"]["type"] == "length" and length["completion_tokens"] == 3


def test_concurrent_requests_are_batched_and_match_sequential_greedy(engine, tok):
    prompts = [prompt(tok, t) for t in ("a", "list the files in /app please", "grep error", "cat notes1.txt")]
    sequential = [generate(engine, p, temperature=0, max_new_tokens=10, ignore_eos=True) for p in prompts]
    results = generate_together(engine, prompts, temperature=0, max_new_tokens=10, ignore_eos=True)
    for seq, par in zip(sequential, results):
        assert par["output_ids"] == seq["output_ids"]
        a = [lp for lp, _, _ in seq["meta_info"]["output_token_logprobs"]]
        b = [lp for lp, _, _ in par["meta_info"]["output_token_logprobs"]]
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_update_weights_from_disk_bumps_version_and_changes_outputs(engine, tok, ckpt, tmp_path):
    """(The module's engine is given back its checkpoint and version "0" at the end: the other tests of this module
    compare it with `ckpt` and may run after this one, on the same worker.)"""
    ids = prompt(tok, "hello")
    before = generate(engine, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
    other = str(tmp_path / "step1")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok)), seed=7), tok, other)
    try:
        n = str(engine.n_updates + 1)  # without a weight_version the version is the count of updates
        status, res = post(engine.url + "/update_weights_from_disk", {"model_path": other})
        assert status == 200 and res["success"] is True
        after = generate(engine, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert (after["meta_info"]["weight_version"] == n
                and get(engine.url + "/get_model_info")[1]["weight_version"] == n)
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        status, res = post(engine.url + "/update_weights_from_disk", {"model_path": other, "weight_version": "step-7"})
        assert status == 200 and get(engine.url + "/get_model_info")[1] == {
            "model_path": other, "weight_version": "step-7", "num_moe_layers": 4, "top_k": 2, "vocab_size": len(tok)}
    finally:
        status, res = post(engine.url + "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "0"})
        assert status == 200 and res["success"] is True
    back = generate(engine, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
    assert back["output_ids"] == before["output_ids"] and back["meta_info"]["weight_version"] == "0"


def test_bad_requests_get_400_naming_the_field(engine, tok, tmp_path):
    ids = prompt(tok, "x")
    cases = [
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [10**6]}, "input_ids"),
        ({"input_ids": ids, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"input_ids": ids, "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": ids, "sampling_params": {"max_new_tokens": "12"}}, "sampling_params.max_new_tokens"),
        ({"input_ids": ids, "sampling_params": {"max_new_tokens": 10**5}}, "sampling_params.max_new_tokens"),
        ({"input_ids": ids, "sampling_params": {"stop_token_ids": [1.5]}}, "sampling_params.stop_token_ids"),
        ({"input_ids": ids, "sampling_params": []}, "sampling_params"),
        ({"input_ids": ids, "rid": 5}, "rid"),
    ]
    for body, field in cases:
        status, res = post(engine.url + "/generate", body)
        assert status == 400 and res["error"].startswith(field + ":"), (body, res)
    status, res = post(engine.url + "/generate", None, raw=b"{not json")
    assert status == 400 and res["error"].startswith("body:")
    status, res = post(engine.url + "/update_weights_from_disk", {})
    assert status == 400 and res["error"].startswith("model_path:")
    status, res = post(engine.url + "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and res["success"] is False and "model_path" in res["error"]
    assert get(engine.url + "/health")[0] == 200  # still serving


def test_abort_request_ends_a_queued_request(engine, tok):
    result = {}
    post(engine.url + "/pause_generation", {})
    body = {"input_ids": prompt(tok, "x"), "sampling_params": {"max_new_tokens": 5}, "rid": "r-1"}
    t = threading.Thread(target=lambda: result.update(res=post(engine.url + "/generate", body)))
    t.start()
    while not engine.queue:
        time.sleep(0.01)
    assert post(engine.url + "/abort_request", {"rid": "r-1"}) == (200, {"success": True})
    t.join(timeout=10)
    post(engine.url + "/continue_generation", {})
    status, res = result["res"]
    assert status == 200 and res["meta_info"]["finish_reason"]["type"] == "abort" and res["output_ids"] == []


def test_serve_command_line_starts_a_server(ckpt):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", ckpt,
                             "--port", "0", "--weight-dtype", "fp32"], cwd=root,  # 0: the kernel picks the port
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # printed once healthy, with the port bound
        assert "engine serving" in line and re.search(r" at http://127\.0\.0\.1:\d+$", line.strip()), line
        url = line.strip().rsplit(" at ", 1)[1]
        info = get(f"{url}/get_model_info")[1]
        assert info["num_moe_layers"] == 4 and info["top_k"] == 2 and info["weight_version"] == "0"
        server = get(f"{url}/get_server_info")[1]
        assert server["torch_threads"] == 2 and server["prefix_cache"]["enabled"], server  # serve's default
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_forwards_run_on_the_scheduler_thread_with_the_engines_own_thread_count(ckpt, tok):
    """OpenMP's thread count is per calling thread: the engine sets `threads` on its scheduler thread, where every
    forward runs (a second multi-threaded thread beside a main thread that owns an OpenMP team runs 3-4x slower),
    whatever the constructing thread uses; the default is 1."""
    before = torch.get_num_threads()
    for threads, want in ((None, 1), (2, 2), (1, 1)):
        kw = {} if threads is None else {"threads": threads}
        eng = engine_lib.EngineServer(ckpt, port=0, **kw).start()
        try:
            seen = {}

            def probe(*a, **k):
                seen["thread"] = threading.current_thread() is eng.threads[1]
                seen["threads"] = torch.get_num_threads()
                return forward(*a, **k)
            forward, eng._forward = eng._forward, probe
            status, _ = post(eng.url + "/generate", {"input_ids": prompt(tok, "x"), "sampling_params": {
                "max_new_tokens": 2, "ignore_eos": True}})
            assert status == 200 and seen == {"thread": True, "threads": want}, (threads, seen)
            assert get(eng.url + "/get_server_info")[1]["torch_threads"] == want
        finally:
            eng.stop()
    assert torch.get_num_threads() == before  # the caller's own count is untouched
    with pytest.raises(ValueError, match="threads"):
        engine_lib.EngineServer(ckpt, port=0, threads=0)


# --- hardening: bad requests are refused before they join a batch; the HTTP layer never hangs ----------------
def raw_http(engine, data: bytes, shut=False, timeout=20):
    """Send raw bytes to the engine, read one HTTP response -> (status, parsed JSON body or raw text)."""
    import socket
    host, port = engine.httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed without a response (got {buf[:200]!r})")
            buf += chunk
        head, _, rest = buf.partition(b"\r\n\r\n")
        n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(rest) < n:
            rest += s.recv(65536)
    return int(head.split()[1]), json.loads(rest[:n])


def http_post(path, body: bytes, headers=()):
    lines = [f"POST {path} HTTP/1.1", "Host: x", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def test_non_finite_denormal_and_out_of_range_sampling_fields_get_400(engine, tok):
    ids = prompt(tok, "x")
    cases = [
        ({"temperature": 1e-310}, "sampling_params.temperature"),
        ({"seed": 2**70}, "sampling_params.seed"),
        ({"seed": -1}, "sampling_params.seed"),
        ({"top_p": 1.5}, "sampling_params.top_p"),
        ({"top_k": 0}, "sampling_params.top_k"),
        ({"top_k": "5"}, "sampling_params.top_k"),
        ({"max_new_tokens": True}, "sampling_params.max_new_tokens"),
        ({"stop_token_ids": [10**6]}, "sampling_params.stop_token_ids"),
        ({"stop_token_ids": 2}, "sampling_params.stop_token_ids"),
        ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty"),
    ]
    for sp, field in cases:
        status, res = post(engine.url + "/generate", {"input_ids": ids, "sampling_params": sp})
        assert status == 400 and res["error"].startswith(field + ":"), (sp, status, res)
    raw_cases = [  # JSON that json.dumps would not write: NaN / Infinity / a 400-digit integer
        (b'{"input_ids": %s, "sampling_params": {"temperature": NaN}}', "sampling_params.temperature"),
        (b'{"input_ids": %s, "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature"),
        (b'{"input_ids": %s, "sampling_params": {"temperature": 1' + b"0" * 400 + b'}}', "sampling_params.temperature"),
        (b'{"input_ids": %s, "sampling_params": {"top_p": NaN}}', "sampling_params.top_p"),
    ]
    for raw, field in raw_cases:
        status, res = post(engine.url + "/generate", None, raw=raw % json.dumps(ids).encode())
        assert status == 400 and res["error"].startswith(field + ":"), (raw[-60:], status, res)
    for body, field in [({"input_ids": [True, 3]}, "input_ids"), ({"input_ids": [-1]}, "input_ids"),
                        ({"input_ids": ids, "text": "hi"}, "text"), ({"input_ids": ids, "stream": True}, "stream"),
                        ([1, 2], "body")]:
        status, res = post(engine.url + "/generate", body)
        assert status == 400 and res["error"].startswith(field + ":"), (body, status, res)
    # a tiny but normal temperature is greedy (SGLang's 1e-6 rule), not an overflow
    greedy = generate(engine, ids, temperature=0, max_new_tokens=4, ignore_eos=True)["output_ids"]
    assert generate(engine, ids, temperature=1e-30, max_new_tokens=4, ignore_eos=True)["output_ids"] == greedy


def _paused_batch(engine, tok, n_good, extra):
    """Queue n_good valid requests while paused, run extra() (which adds bad ones), continue; -> good results."""
    results = [None] * n_good
    body = {"input_ids": prompt(tok, "list the files"), "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}}
    assert post(engine.url + "/pause_generation", {})[0] == 200
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, post(engine.url + "/generate", body)))
               for i in range(n_good)]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 30
        while len(engine.queue) < n_good and time.time() < deadline:
            time.sleep(0.01)
        extra()
    finally:
        assert post(engine.url + "/continue_generation", {})[0] == 200
    for t in threads:
        t.join(timeout=120)
    return results


def test_a_bad_request_is_refused_before_it_joins_a_batch(engine, tok):
    ids, bad = prompt(tok, "x"), {}

    def send_bad():  # while the good ones wait in the queue: NaN temperature, a seed torch cannot take
        raws = {"nan": b'{"input_ids": %s, "sampling_params": {"temperature": NaN}}' % json.dumps(ids).encode(),
                "seed": json.dumps({"input_ids": ids, "sampling_params": {"seed": 2**70}}).encode()}
        threads = [threading.Thread(target=lambda k=k, r=r: bad.__setitem__(k, post(engine.url + "/generate", None, r)))
                   for k, r in raws.items()]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(bad) < 2 and len(engine.queue) < 5 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        return threads
    good = _paused_batch(engine, tok, 3, send_bad)
    deadline = time.time() + 60
    while len(bad) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert bad["nan"][0] == 400 and bad["seed"][0] == 400, bad
    for status, res in good:
        assert status == 200 and res["meta_info"]["finish_reason"]["type"] == "length", res
        assert len(res["output_ids"]) == 6


def test_a_request_that_fails_inside_a_batch_fails_alone(engine, tok):
    """Second line of defence: requests that bypass parse_generate. A row whose sampling fails (a denormal
    temperature overflows to inf) and a request that breaks the whole wave (a seed torch refuses) each get
    their own error; the valid requests of the same batch finish normally."""
    ids, bad, threads = prompt(tok, "x"), [], []

    def submit_bad():
        for rid, temperature, seed in (("row-fails", 1e-310, None), ("wave-fails", 1.0, 2**70)):
            r = protocol.Request(rid, ids, temperature, 1.0, 6, {2}, seed)
            bad.append(r)
            threads.append(threading.Thread(target=engine.submit, args=(r,)))
            threads[-1].start()
        deadline = time.time() + 10
        while len(engine.queue) < 5 and time.time() < deadline:
            time.sleep(0.01)
    good = _paused_batch(engine, tok, 3, submit_bad)
    for t in threads:
        t.join(timeout=120)
    for status, res in good:
        assert status == 200 and res["meta_info"]["finish_reason"]["type"] == "length", res
        assert len(res["output_ids"]) == 6
    assert all(r.done.is_set() and r.finish["type"] == "abort" for r in bad), [r.finish for r in bad]
    assert "non-finite" in bad[0].error and "Overflow" in bad[1].error, [r.error for r in bad]


def test_64_concurrent_generate_requests_are_held_in_the_backlog_and_all_served(engine, tok):
    """The oversampling fan-out: 64 clients connect while the server is not accepting (its accept loop
    stopped); every connection must be held by the listen backlog (socketserver's default of 5 drops the
    SYNs of the rest), then every request is answered."""
    import select
    import socket
    addr = engine.httpd.server_address[:2]
    body = json.dumps({"input_ids": prompt(tok, "x"), "sampling_params": {"max_new_tokens": 2}}).encode()
    engine.httpd.shutdown()  # the accept loop stops; the listening socket stays open
    socks = []
    try:
        for _ in range(64):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(addr)
            socks.append(s)
        pending, deadline = set(socks), time.time() + 2.5
        while pending and time.time() < deadline:  # a SYN dropped for a full backlog is retried after 1 s, 3 s
            _, writable, _ = select.select([], list(pending), [], 0.1)
            pending -= {s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0}
        assert not pending, f"{len(pending)} of 64 connections not held while the server was busy"
        for s in socks:
            s.setblocking(True)
            s.settimeout(120)
            s.sendall(http_post("/generate", body, [f"Content-Length: {len(body)}", "Connection: close"]))
    finally:
        engine.threads[0] = threading.Thread(target=engine.httpd.serve_forever, daemon=True)
        engine.threads[0].start()
    statuses = []
    for s in socks:
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
        s.close()
        statuses.append(int(buf.split()[1]))
    assert statuses == [200] * 64


def test_a_client_that_hangs_up_has_its_generation_aborted(engine, tok):
    import socket
    body = json.dumps({"input_ids": prompt(tok, "x"), "rid": "hangs-up",
                       "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}).encode()
    s = socket.create_connection(engine.httpd.server_address[:2], timeout=30)
    s.sendall(http_post("/generate", body, [f"Content-Length: {len(body)}"]))
    deadline = time.time() + 60
    while "hangs-up" not in engine.running and time.time() < deadline:
        time.sleep(0.01)
    assert "hangs-up" in engine.running
    s.close()
    deadline = time.time() + 120
    while not any(d["rid"] == "hangs-up" for d in engine.disconnects) and time.time() < deadline:
        time.sleep(0.05)
    (rec,) = [d for d in engine.disconnects if d["rid"] == "hangs-up"]
    assert rec["finish"] == "abort" and rec["completion_tokens"] < 4000, rec
    # a client that hangs up right after sending (possibly before its request is queued)
    early = body.replace(b'"hangs-up"', b'"hangs-up-early"')
    s = socket.create_connection(engine.httpd.server_address[:2], timeout=30)
    s.sendall(http_post("/generate", early, [f"Content-Length: {len(early)}"]))
    s.close()
    deadline = time.time() + 120
    while not any(d["rid"] == "hangs-up-early" for d in engine.disconnects) and time.time() < deadline:
        time.sleep(0.05)
    (rec,) = [d for d in engine.disconnects if d["rid"] == "hangs-up-early"]
    assert rec["finish"] == "abort" and rec["completion_tokens"] < 4000, rec
    out = generate(engine, prompt(tok, "y"), temperature=0, max_new_tokens=3, ignore_eos=True)
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # the engine is free again
    deadline = time.time() + 10  # the reply goes out (req.done) just before the scheduler clears its wave
    while (engine.running or engine.queue) and time.time() < deadline:
        time.sleep(0.01)
    assert not engine.running and not engine.queue


def test_bad_content_length_or_body_gets_4xx_never_a_hang_or_500(engine, tok):
    good = json.dumps({"input_ids": prompt(tok, "x"), "sampling_params": {"max_new_tokens": 1}}).encode()
    cases = [
        (http_post("/generate", good, ["Content-Length: -5"]), 400, "Content-Length:"),
        (http_post("/generate", good, ["Content-Length: abc"]), 400, "Content-Length:"),
        (http_post("/generate", good, [f"Content-Length: {len(good)}", "Content-Length: 3"]), 400, "Content-Length:"),
        (http_post("/generate", good, ["Content-Length: 99999999999999999999999"]), 413, "Content-Length:"),
        (http_post("/generate", good, [f"Content-Length: {httpjson.MAX_BODY_BYTES + 1}"]), 413, "Content-Length:"),
        (http_post("/generate", b"5\r\nabcde\r\n0\r\n\r\n", ["Transfer-Encoding: chunked"]), 411, "Content-Length:"),
        (http_post("/generate", b""), 400, "body:"),  # no Content-Length: an empty body
        (http_post("/generate", b"1" * 5000, ["Content-Length: 5000"]), 400, "body:"),  # int of 5000 digits
        (http_post("/generate", b"[" * 100000, ["Content-Length: 100000"]), 400, "body:"),  # nesting
        (http_post("/generate", b"\xff\xfe{", ["Content-Length: 3"]), 400, "body:"),  # not UTF-8
        (http_post("/generate", b"", [f"X-{i}: y" for i in range(101)]), 431, "request:"),  # http.server's own
        # refusals (here: over 100 headers) answer JSON too
        (b"PUT /generate HTTP/1.1\r\nHost: x\r\n\r\n", 501, "request:"),
    ]
    for data, want, field in cases:
        status, res = raw_http(engine, data)
        assert status == want and res["error"].startswith(field), (data[:80], status, res)
    # fewer bytes than announced: the client closed (400) or stalls (408 after the read timeout)
    status, res = raw_http(engine, http_post("/generate", good[:10], [f"Content-Length: {len(good)}"]), shut=True)
    assert status == 400 and res["error"].startswith("body:"), res
    handler = engine.httpd.RequestHandlerClass
    handler.timeout = 1.0
    try:
        status, res = raw_http(engine, http_post("/generate", good[:10], [f"Content-Length: {len(good)}"]))
    finally:
        handler.timeout = httpjson.READ_TIMEOUT_S
    assert status == 408 and res["error"].startswith("body:"), res
    assert get(engine.url + "/health")[0] == 200 and not engine.queue


def test_a_rid_already_in_flight_is_refused(engine, tok):
    body = {"input_ids": prompt(tok, "x"), "sampling_params": {"max_new_tokens": 2}, "rid": "dup"}
    first = {}
    assert post(engine.url + "/pause_generation", {})[0] == 200
    t = threading.Thread(target=lambda: first.update(res=post(engine.url + "/generate", body)))
    t.start()
    try:
        deadline = time.time() + 30
        while not engine.queue and time.time() < deadline:
            time.sleep(0.01)
        status, res = post(engine.url + "/generate", body)
        assert status == 400 and res["error"].startswith("rid:"), res
    finally:
        post(engine.url + "/continue_generation", {})
    t.join(timeout=60)
    assert first["res"][0] == 200 and first["res"][1]["meta_info"]["id"] == "dup"


def test_health_is_503_when_the_scheduler_is_not_running(ckpt):
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=2).start()
    try:
        assert get(eng.url + "/health") == (200, {"status": "ok", "errors_500": 0})
        dead = threading.Thread(target=lambda: None)
        dead.start()
        dead.join()
        eng.threads[1], live = dead, eng.threads[1]  # as if the scheduler thread had died
        try:
            urllib.request.urlopen(eng.url + "/health", timeout=30)
            raise AssertionError("/health answered 200 without a scheduler")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "scheduler" in json.loads(e.read())["error"]
        eng.threads[1] = live
    finally:
        eng.stop()


# --- batched sampling (engine.batcher.sample_rows) --------------------------------------------------------
def test_batched_sampling_draws_each_rows_distribution():
    """One call samples many rows: frequencies of 12,000 draws at T = 0.7 within 4.5 sigma of softmax(logits / T);
    top-k 2 and top-p 0.8 / 0.6 never draw outside their kept set and keep its proportions; every logprob is
    log_softmax(logits / T) at the drawn token."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    gen = torch.Generator().manual_seed(0)
    n, rounds = 1000, 12
    for top_k, top_p, keep in ((-1, 1.0, range(6)), (2, 1.0, (0, 1)), (-1, 0.8, (0, 1)), (-1, 0.6, (0,))):
        probs = torch.softmax(logits / 0.7, -1)
        want = torch.zeros(6)
        want[list(keep)] = probs[list(keep)] / probs[list(keep)].sum()
        counts = torch.zeros(6)
        for _ in range(rounds):
            out = batcher.sample_rows(logits.expand(n, 6), [0.7] * n, [top_p] * n, [top_k] * n, [gen] * n)
            for tok, lp in out:
                counts[tok] += 1
                assert lp == pytest.approx(float(torch.log_softmax(logits / 0.7, -1)[tok]), abs=1e-6)
        freq, N = counts / (n * rounds), n * rounds
        assert (counts[[i for i in range(6) if i not in keep]] == 0).all()
        sigma = (want * (1 - want) / N).sqrt()
        assert ((freq - want).abs() <= 4.5 * sigma + 1e-9).all(), (top_k, top_p, freq, want)


def test_batched_sampling_rows_are_independent_of_their_batch():
    """A seeded row draws the same tokens alone and inside a batch (no cross-row state); greedy rows take the argmax
    with the raw-logit logprob; a row with a NaN logit fails alone."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g)
    params = ([0.8, 0, 1.3, 0.8, 1.0], [0.9, 1.0, 1.0, 0.5, 1.0], [-1, -1, 20, -1, 1])

    def gens():
        return [torch.Generator().manual_seed(s) for s in (11, 12, 13, 14, 15)]
    together = batcher.sample_rows(logits, *params, gens())
    alone = [batcher.sample_rows(logits[i:i + 1], *[[p[i]] for p in params], [gens()[i]])[0] for i in range(5)]
    assert together == alone
    assert together[1] == (int(logits[1].argmax()), pytest.approx(float(torch.log_softmax(logits[1], -1).max())))
    assert together[4][0] == int(logits[4].argmax())  # top_k 1 at T = 1
    bad = logits.clone()
    bad[2, 7] = float("nan")
    out = batcher.sample_rows(bad, *params, gens())
    assert isinstance(out[2], ValueError) and "non-finite" in str(out[2])
    assert [o for i, o in enumerate(out) if i != 2] == [o for i, o in enumerate(together) if i != 2]


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_plain_sampling_equals_the_general_path(monkeypatch, temperature):
    """Rows sharing a temperature and a generator, keeping the whole vocabulary (the rollouts' case) take
    _sample_plain: the same tokens and bit-equal logprobs as the general path from the same generator state; a row
    with a NaN or infinite logit fails alone; a greedy, top-p, top-k or differently tempered row leaves the fast
    path."""
    logits = torch.randn(9, 283, generator=torch.Generator().manual_seed(3)) * 4
    logits[4, 10], logits[6, 0] = float("nan"), float("inf")
    n = logits.shape[0]
    args = ([temperature] * n, [1.0] * n, [-1] * n)
    fast = batcher.sample_rows(logits, *args, [torch.Generator().manual_seed(5)] * n)
    monkeypatch.setattr(batcher, "_plain", lambda *a: False)
    general = batcher.sample_rows(logits, *args, [torch.Generator().manual_seed(5)] * n)
    assert [o for i, o in enumerate(fast) if i not in (4, 6)] == [o for i, o in enumerate(general) if i not in (4, 6)]
    assert all(isinstance(fast[i], ValueError) and isinstance(general[i], ValueError) for i in (4, 6))
    monkeypatch.undo()
    g = torch.Generator()
    assert batcher._plain(*args, [g] * n)
    for t, p, k in (([0.0] + args[0][1:], args[1], args[2]), ([2.0] + args[0][1:], args[1], args[2]),
                    (args[0], [0.9] + args[1][1:], args[2]), (args[0], args[1], [5] + args[2][1:])):
        assert not batcher._plain(t, p, k, [g] * n)
    assert not batcher._plain(*args, [torch.Generator()] + [g] * (n - 1))


# --- prefix cache, continuous batching, capture buffer --------------------------------------------------
def _turns(eng, tok, n_turns, seed=0, new=12):
    """An agent's trajectory: each turn re-sends the whole history plus a tool reply -> [(input_ids, response)]."""
    ids, out = prompt(tok, "list the files in /app"), []
    for t in range(n_turns):
        res = generate(eng, ids, temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed + t)
        out.append((ids, res))
        ids = ids + res["output_ids"] + prompt(tok, f"file{t}.txt notes{t}.txt")
    return out


def _same_reply(a, b):
    """Cache hit vs cold prefill: the same tokens, logprobs within 1e-4 (the spread measured over 1 / 2 threads and a
    loaded machine was 4.8e-7: a hit forwards the suffix on top of cached states, a cold prefill all of it), the
    same routed experts in every row."""
    assert a["output_ids"] == b["output_ids"]
    la = torch.tensor([x[0] for x in a["meta_info"]["output_token_logprobs"]])
    lb = torch.tensor([x[0] for x in b["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(la, lb, atol=1e-4, rtol=0), (la - lb).abs().max()
    ra, rb = (r3.decode_routed_experts(x["meta_info"]["routed_experts"], 4, 2) for x in (a, b))
    assert ra.shape == rb.shape and (ra == rb).all()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_a_prefix_cache_hit_equals_a_cold_prefill(tok, tmp_path, arch):
    """Turn k re-sends turn k-1's trajectory: the engine forwards only the new suffix on top of the cached state
    (attention KV; for the hybrid also the Gated DeltaNet conv + recurrent state) and returns the prefix's routed
    experts from the cache; replies equal an engine without the cache, and the prompt's routing rows equal a
    teacher-forced forward's."""
    path = str(tmp_path / arch)
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), arch), seed=1), tok, path)
    hot = engine_lib.EngineServer(path, port=0, max_batch=4, weight_dtype="fp32").start()
    cold = engine_lib.EngineServer(path, port=0, max_batch=4, weight_dtype="fp32", prefix_cache_mb=0).start()
    try:
        turns = _turns(hot, tok, 4)
        stats = hot.cache_stats()
        assert stats["hits"] == 3 and stats["entries"] == 1  # each turn's entry supersedes the previous one
        for k, (ids, res) in enumerate(turns):
            meta = res["meta_info"]
            want = len(turns[k - 1][0]) + len(turns[k - 1][1]["output_ids"]) - 1 if k else 0
            assert meta["cached_tokens"] == want and meta["prompt_tokens"] == len(ids)
            again = generate(cold, ids, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=k)
            assert again["meta_info"]["cached_tokens"] == 0
            _same_reply(res, again)
        ids, res = turns[-1]
        ref, _ = model_lib.load_actor(path)
        with torch.no_grad(), r3.routing(ref.eval(), "record") as rec:
            ref(torch.tensor([ids + res["output_ids"]]))
        routed = r3.decode_routed_experts(res["meta_info"]["routed_experts"], 4, 2)
        assert (rec.experts[0, :len(ids)].numpy() == routed[:len(ids)]).all()
    finally:
        hot.stop()
        cold.stop()


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe"])
def test_next_turns_admitted_together_share_one_prefill_on_their_cached_prefixes(tok, tmp_path, arch):
    """Agents whose next turns arrive together (each history + its reply + a tool output) are prefilled as one
    forward per number of new tokens, on top of their prefix-cache entries of different lengths (stacked,
    left-padded); each reply equals a cold prefill's (tokens, logprobs, every routing row), and the next turn hits
    the entry each reply left (the row's columns stayed contiguous)."""
    path = str(tmp_path / arch)
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), arch), seed=2), tok, path)
    hot = engine_lib.EngineServer(path, port=0, max_batch=8, weight_dtype="fp32").start()
    cold = engine_lib.EngineServer(path, port=0, max_batch=8, weight_dtype="fp32", prefix_cache_mb=0).start()
    groups, prefill = [], hot._prefill
    hot._prefill = lambda group: groups.append((len(group), group[0][2] is not None)) or prefill(group)
    sp = dict(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    try:
        hist = [prompt(tok, "list the files in " + "/app" * (i + 1)) for i in range(4)]
        tools = [prompt(tok, "a.txt b.txt")] * 3 + [prompt(tok, "a.txt b.txt c.txt d.txt e.txt")]
        assert len({len(h) for h in hist}) == 4 and len(tools[3]) > len(tools[0])
        for turn in range(3):
            outs = generate_together(hot, hist, seeds=[10 * turn + i for i in range(4)], **sp)
            if turn == 0:
                assert groups == [(4, False)]
            else:  # the three short tool replies in one forward, the long one in its own
                assert sorted(groups) == [(1, True), (3, True)], groups
            for i, (h, out) in enumerate(zip(hist, outs)):
                want = 0 if turn == 0 else len(h) - len(tools[i]) - 1
                assert out["meta_info"]["cached_tokens"] == want
                _same_reply(out, generate(cold, h, seed=10 * turn + i, **sp))
            hist = [h + out["output_ids"] + t for h, out, t in zip(hist, outs, tools)]
            groups.clear()
        assert hot.cache_stats()["hits"] == 8
    finally:
        hot.stop()
        cold.stop()


def test_cold_requests_admitted_together_are_prefilled_in_forwards_within_the_token_budget(tok, tmp_path):
    """30 requests of ~300 tokens admitted in one step: ONE prefill forward of 9,000+ padded tokens (more rows than
    the model's positions: the routing capture buffer holds a whole group; a group that overflowed it was re-run
    one request at a time); with max_prefill_tokens at 1,000, groups of 3 (the budget / the longest), replies
    unchanged."""
    path = str(tmp_path / "q3")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_moe"), seed=3), tok, path)
    eng = engine_lib.EngineServer(path, port=0, max_batch=32, weight_dtype="fp32", prefix_cache_mb=0).start()
    groups, prefill = [], eng._prefill
    eng._prefill = lambda group: groups.append(len(group)) or prefill(group)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, len(tok), (300 + i,), generator=g).tolist() for i in range(30)]
        assert 30 * 329 > eng.model.config.max_position_embeddings
        one = generate_together(eng, prompts, seeds=range(30), temperature=1.0, max_new_tokens=3, ignore_eos=True)
        assert groups == [30] and not eng.prefill_splits
        eng.max_prefill_tokens, groups[:] = 1000, []
        cut = generate_together(eng, prompts, seeds=range(30), temperature=1.0, max_new_tokens=3, ignore_eos=True)
        assert groups == [3] * 10 and not eng.prefill_splits
        for a, b in zip(one, cut):
            _same_reply(a, b)
        with pytest.raises(ValueError, match="max_prefill_tokens"):
            engine_lib.EngineServer(path, port=0, max_prefill_tokens=0)
    finally:
        eng.stop()


@pytest.mark.parametrize("drop", [[1, 3], [0, 1], [4], [0, 2, 4], [3, 4]])
def test_rows_leave_the_batch_in_place(tok, drop):
    """kvcache.drop_rows: the rows left are exactly the old rows `order` names (every attention column, every Gated
    DeltaNet state of the hybrid), the leaving ones gone, and a decode step appends to the right rows."""
    cfg = model_lib.tiny_config(len(tok), "qwen3_5_moe")
    m = model_lib.build_actor(cfg, seed=0).eval()
    ids = torch.randint(3, len(tok), (5, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        c = kvcache.DynamicCache(config=cfg)
        m(input_ids=ids, cache=c, use_cache=True)
    before = kvcache._cache_state(c, slice(None), 9)
    cache, mask = kvcache._merged_cache(cfg, [(before, torch.ones(5, 9, dtype=torch.long))])
    order = kvcache.drop_rows(cache, 5, drop)
    assert sorted(order) == [b for b in range(5) if b not in drop]
    after = kvcache._cache_state(cache, slice(None), 9)
    for (kind, a0, b0), (_, a1, b1) in zip(before, after):
        assert torch.equal(a1, a0[order]) and torch.equal(b1, b0[order]), kind
    layer = next(l for l in cache.layers if isinstance(l, kvcache.GrowingKV))
    k = torch.randn(len(order), *layer.keys.shape[1:-2], 1, layer.keys.shape[-1])
    keys, _ = layer.update(k, k)
    assert keys.shape[0] == len(order) and torch.equal(keys[:, :, -1:], k)
    assert torch.equal(keys[:, :, :9], next(s for s in before if s[0] == "attn")[1][order])


def test_a_merge_drops_columns_no_row_uses():
    """kvcache._merged_cache: columns that are padding in every row of a part (a long row left the batch) are not
    copied; the rest keep their keys, right-aligned."""
    k = torch.randn(2, 2, 10, 4)
    m = torch.ones(2, 10, dtype=torch.long)
    m[:, :3] = 0  # the first 3 columns: nobody's
    m[1, :6] = 0
    new = torch.randn(1, 2, 5, 4)
    cfg = model_lib.tiny_config(400, "qwen3_moe")
    cache, mask = kvcache._merged_cache(cfg, [([("attn", k, k)] * 4, m),
                                              ([("attn", new, new)] * 4, torch.ones(1, 5, dtype=torch.long))])
    assert mask.tolist() == [[1] * 7, [0] * 3 + [1] * 4, [0] * 2 + [1] * 5]
    assert torch.equal(cache.layers[0].keys[:2], k[:, :, 3:]) and torch.equal(cache.layers[0].keys[2, :, 2:], new[0])


@pytest.mark.parametrize("arch", model_lib.ARCHS)
def test_rows_that_join_in_place_equal_a_rebuilt_batch(tok, arch):
    """kvcache.append_rows: new rows written into the batch's spare rows give the same keys, values, Gated DeltaNet
    states and mask as rebuilding the batch from every part (_merged_cache); a part wider than the batch, or more
    new rows than spare ones, is refused (None) with the cache untouched."""
    cfg = model_lib.tiny_config(len(tok), arch)
    m = model_lib.build_actor(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(1)

    def state(b, t):
        with torch.no_grad():
            c = kvcache.DynamicCache(config=cfg)
            m(input_ids=torch.randint(3, len(tok), (b, t), generator=g), cache=c, use_cache=True)
        return kvcache._cache_state(c, slice(None), t), torch.ones(b, t, dtype=torch.long)
    batch = state(3, 12)
    batch[1][0, :4] = 0  # a row shorter than the batch
    joins = [state(2, 7), state(1, 12)]
    want, want_mask = kvcache._merged_cache(cfg, [batch] + joins)
    cache, mask = kvcache._merged_cache(cfg, [batch], rows=6)
    got_mask = kvcache.append_rows(cache, mask, joins)
    assert torch.equal(got_mask, want_mask)
    for (kind, a0, b0), (_, a1, b1) in zip(kvcache._cache_state(want, slice(None), 12),
                                           kvcache._cache_state(cache, slice(None), 12)):
        assert torch.equal(a1, a0) and torch.equal(b1, b0), kind
    layer = next(l for l in cache.layers if isinstance(l, kvcache.GrowingKV))
    keys, _ = layer.update(*(torch.randn(6, *layer.keys.shape[1:-2], 1, layer.keys.shape[-1]),) * 2)
    assert keys.shape[:3] == (6, layer.keys.shape[1], 13)  # the next decode step sees every row
    small, small_mask = kvcache._merged_cache(cfg, [batch], rows=4)
    before = [t.clone() for _, a, b in kvcache._cache_state(small, slice(None), 12) for t in (a, b)]
    assert kvcache.append_rows(small, small_mask, joins) is None  # 3 new rows, 1 spare
    assert kvcache.append_rows(small, small_mask, [state(1, 13)]) is None  # wider than the batch
    after = [t for _, a, b in kvcache._cache_state(small, slice(None), 12) for t in (a, b)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


@pytest.mark.parametrize("arch", model_lib.ARCHS)
def test_the_kv_columns_grow_past_their_capacity_while_rows_are_spare(tok, arch):
    """GrowingKV: a batch with spare rows (built for later joins, or left by rows that left) decodes past its columns'
    capacity (2x the widest row, at least 64): the new buffer takes the running rows only, and every step's logits
    equal a batch without spare rows. Copying into every row of the new buffer raised 'The expanded size of the
    tensor (12) must match the existing size (8)', an HTTP 500 for every running request."""
    cfg = model_lib.tiny_config(len(tok), arch)
    m = model_lib.build_actor(cfg, seed=0).eval()
    ids = torch.randint(3, len(tok), (3, 10), generator=torch.Generator().manual_seed(0))

    def decode(rows, spare_rows):
        with torch.no_grad():
            c = kvcache.DynamicCache(config=cfg)
            m(input_ids=ids[rows], cache=c, use_cache=True)
            cache, mask = kvcache._merged_cache(cfg, [(kvcache._cache_state(c, slice(None), 10),
                                                       torch.ones(len(rows), 10, dtype=torch.long))], rows=spare_rows)
            if len(rows) == 3:
                order = kvcache.drop_rows(cache, 3, [1])  # the middle row leaves: 2 run, spare_rows - 2 spare
                mask = mask[torch.tensor(order)]
            x, out = ids[[0, 2], -1:], []
            for step in range(58):  # past 64 columns
                mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
                logits = m(input_ids=x, attention_mask=mask, position_ids=torch.full((2, 1), 10 + step), cache=cache,
                           use_cache=True).logits[:, -1]
                out.append(logits)
                x = logits.argmax(-1, keepdim=True)
        layer = next(x for x in cache.layers if isinstance(x, kvcache.GrowingKV))
        return torch.stack(out), layer
    want, plain = decode([0, 2], None)
    got, layer = decode([0, 1, 2], 4)
    assert layer.kbuf.shape[0] == 4 and layer.kbuf.shape[2] > 64 and layer.keys.shape[:3] == (2, 2, 68)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    assert plain.kbuf.shape[0] == 2
    with pytest.raises(ValueError, match="key_states: 3 rows, the cache holds 2"):  # more rows than the buffer
        plain.update(torch.zeros(3, 2, 1, 32), torch.zeros(3, 2, 1, 32))


@pytest.mark.parametrize("arch", model_lib.ARCHS)
def test_a_prefix_hit_joins_in_the_step_where_running_rows_finish(tok, tmp_path, arch):
    """An agent's next turn (a prefix-cache hit) is admitted in the very step where a running row samples its last
    token and leaves (and another row keeps running): the hit joins the batch's spare rows, the finished row is
    dropped in place, and every reply equals an engine without the cache (tokens, logprobs, routing)."""
    path = str(tmp_path / arch)
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), arch), seed=5), tok, path)
    hot = engine_lib.EngineServer(path, port=0, max_batch=4, weight_dtype="fp32").start()
    cold = engine_lib.EngineServer(path, port=0, max_batch=4, weight_dtype="fp32", prefix_cache_mb=0).start()
    sp = dict(temperature=1.0, ignore_eos=True)
    try:
        ids = prompt(tok, "list the files in /app")
        first = generate(hot, ids, max_new_tokens=6, seed=1, **sp)
        hit = protocol.Request("hit", ids + first["output_ids"] + prompt(tok, "a.txt b.txt"), 1.0, 1.0, 8, set(), 2)
        step, seen = hot._step, {}

        def stepped(admit):  # on the scheduler thread, between steps
            before = {r.req.rid for r in hot.rows}
            step(admit)
            if hit in admit:
                seen["left as the hit joined"] = sorted(before - {r.req.rid for r in hot.rows})
            ending = next((r for r in hot.rows if r.req.rid == "ends"), None)
            if ending is not None and len(ending.req.output_ids) == 9:  # its last token is drawn in the next step
                with hot.cv:
                    hot.queue.append(hit)
        hot._step = stepped
        jobs = {"ends": (prompt(tok, "cat notes.txt"), 10, 3), "runs": (prompt(tok, "wc -l count.txt"), 30, 4)}
        out = {}
        assert post(hot.url + "/pause_generation", {})[0] == 200
        threads = [threading.Thread(target=lambda k=k, j=j: out.__setitem__(k, post(hot.url + "/generate", {
            "input_ids": j[0], "rid": k, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": dict(sp, max_new_tokens=j[1], seed=j[2])}))) for k, j in jobs.items()]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(hot.queue) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert post(hot.url + "/continue_generation", {})[0] == 200
        for t in threads:
            t.join(timeout=120)
        assert hit.done.wait(60) and hit.error is None, hit.error
        assert seen["left as the hit joined"] == ["ends"] and hit.cached_tokens > 0, (seen, hit.cached_tokens)
        for k, (p, n, seed) in jobs.items():
            assert out[k][0] == 200, out[k]
            _same_reply(out[k][1], generate(cold, p, max_new_tokens=n, seed=seed, **sp))
        _same_reply(hot.response(hit), generate(cold, hit.input_ids, max_new_tokens=8, seed=2, **sp))
    finally:
        hot.stop()
        cold.stop()


def test_a_join_rebuilds_a_batch_whose_columns_are_mostly_padding():
    """kvcache.append_rows refuses (None: the engine rebuilds, trimming them) when over half the batch's columns are
    padding in every row (left by a long row that left): in place, the batch's width grew by a column a step for as
    long as rows kept joining, and every row attends over it."""
    cfg = model_lib.tiny_config(400, "qwen3_moe")
    k = torch.randn(2, 2, 12, 32)
    new = ([("attn", k[:1, :, :3], k[:1, :, :3])] * 4, torch.ones(1, 3, dtype=torch.long))
    for nobodys, in_place in ((7, False), (6, True)):
        m = torch.ones(2, 12, dtype=torch.long)
        m[1, :nobodys] = 0  # row 1 uses the last 12 - nobodys columns
        cache, mask = kvcache._merged_cache(cfg, [([("attn", k, k)] * 4, m)], rows=4)
        order = kvcache.drop_rows(cache, 2, [0])  # the long row leaves
        out = kvcache.append_rows(cache, mask[torch.tensor(order)], [new])
        assert (out is not None) == in_place, nobodys
        if in_place:
            assert out.tolist() == [[0] * 6 + [1] * 6, [0] * 9 + [1] * 3]


def test_every_500_is_logged_with_its_traceback_and_counted(ckpt, tok, capfd):
    """Each HTTP 500 (a request failed inside the batcher: a decode forward that raises, a fault outside a forward;
    a fault in the handler, POST or GET) is logged on stderr with its full traceback (for a request that failed on
    the scheduler thread, that thread's) and the request's rid and client, and counted: errors_500 in /health and
    /get_server_info. A 400 is not a 500."""
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=2).start()
    forward = eng._forward

    def fwd(ids, mask, pos, cache):
        if ids.shape[1] == 1 and any(r.req.rid == "poisoned" for r in eng.rows):  # its decode steps
            raise RuntimeError("poisoned decode step")
        return forward(ids, mask, pos, cache)

    def broken(*a, **k):
        raise RuntimeError("injected fault")
    body = {"input_ids": prompt(tok, "x"), "rid": "poisoned", "sampling_params": {"max_new_tokens": 3,
                                                                                "ignore_eos": True}}
    try:
        capfd.readouterr()
        eng._forward = fwd
        status, out = post(eng.url + "/generate", body)
        eng._forward = forward
        assert status == 500 and "poisoned decode step" in out["error"], out
        err = capfd.readouterr().err
        assert "HTTP 500 (#1) POST /generate rid=poisoned client=127.0.0.1:" in err and "prompt_tokens=" in err, err
        assert "Traceback (most recent call last)" in err and "in fwd" in err and "RuntimeError: poisoned" in err, err
        insert, eng.prefix.insert = eng.prefix.insert, broken  # a fault outside a forward
        assert post(eng.url + "/generate", dict(body, rid="outside", input_ids=prompt(tok, "y")))[0] == 500
        eng.prefix.insert = insert
        err = capfd.readouterr().err
        assert "HTTP 500 (#2) POST /generate rid=outside" in err and "in _step" in err and "in broken" in err, err
        response, eng.response = eng.response, broken  # a fault of the handler itself
        assert post(eng.url + "/generate", dict(body, rid="handler", input_ids=prompt(tok, "z")))[0] == 500
        eng.response = response
        err = capfd.readouterr().err
        assert "HTTP 500 (#3) POST /generate rid=handler client=" in err and "in generate" in err, err
        assert err.count("Traceback (most recent call last)") == 1, err  # logged once
        stats, eng.cache_stats = eng.cache_stats, broken
        status, out = get_status(eng.url + "/get_server_info")
        eng.cache_stats = stats
        assert status == 500 and "injected fault" in out["error"], out
        err = capfd.readouterr().err
        assert "HTTP 500 (#4) GET /get_server_info" in err and "in _get" in err and "in broken" in err, err
        assert post(eng.url + "/generate", {"input_ids": []})[0] == 400  # not counted
        assert get(eng.url + "/health") == (200, {"status": "ok", "errors_500": 4})
        assert get(eng.url + "/get_server_info")[1]["errors_500"] == 4
        assert post(eng.url + "/generate", dict(body, rid="fine"))[0] == 200
    finally:
        eng.stop()


def test_a_prefill_group_that_fails_is_rerun_one_by_one_and_says_why(tok, tmp_path):
    """A group prefill that raises (here: one request's ids poison the forward) is re-run one request at a time: the
    request at fault gets its error (HTTP 500), the others their replies, and /get_server_info's prefill_splits
    names the group's failure (the split was silent before, and hid a group that always failed)."""
    path = str(tmp_path / "q3")
    model_lib.save_checkpoint(model_lib.build_actor(model_lib.tiny_config(len(tok), "qwen3_moe"), seed=3), tok, path)
    eng = engine_lib.EngineServer(path, port=0, max_batch=4, prefix_cache_mb=0).start()
    poison, forward = 7, eng._forward

    def fwd(ids, mask, pos, cache):
        if (ids == poison).any() and ids.shape[1] > 1:
            raise ValueError("poisoned prefill")
        return forward(ids, mask, pos, cache)
    eng._forward = fwd
    try:
        prompts = [prompt(tok, "a"), prompt(tok, "b")[:-2] + [poison] + prompt(tok, "b")[-2:], prompt(tok, "c")]
        assert post(eng.url + "/pause_generation", {})[0] == 200
        out = [None] * 3

        def worker(i):
            out[i] = post(eng.url + "/generate", {"input_ids": prompts[i], "sampling_params": {"max_new_tokens": 2}})
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while len(eng.queue) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert post(eng.url + "/continue_generation", {})[0] == 200
        for t in threads:
            t.join()
        assert [o[0] for o in out] == [200, 500, 200] and "poisoned prefill" in out[1][1]["error"]
        status, info = get(eng.url + "/get_server_info")
        assert status == 200 and info["prefill_splits"] == ["3 requests: ValueError: poisoned prefill"]
    finally:
        eng.stop()


def test_the_prefix_cache_is_lru_under_its_cap_and_cleared_by_a_weight_update(engine, tok, ckpt):
    cache = kvcache.PrefixCache(cap_bytes=10_000)
    state = [("attn", torch.zeros(1, 2, 100, 4), torch.zeros(1, 2, 100, 4))]  # 6,400 bytes + 8 per id
    cache.insert([1, 2, 3], state, None)
    cache.insert([4, 5, 6], state, None)  # over the cap: [1, 2, 3] is evicted
    assert list(cache.entries) == [(4, 5, 6)] and cache.bytes == 6400 + 24
    assert cache.lookup([4, 5, 6]) is None  # an entry equal to the input is not a proper prefix
    assert cache.lookup([4, 5, 6, 7])[0] == [4, 5, 6] and cache.lookup([4, 5, 7, 7]) is None
    cache.insert([9] * 2000, state, None)  # bigger than the cap alone: not kept, nothing evicted for it
    assert list(cache.entries) == [(4, 5, 6)]
    # the engine: an entry after a request, none after /update_weights_from_disk
    ids = prompt(tok, "lru")
    res = generate(engine, ids, temperature=0, max_new_tokens=4, ignore_eos=True)
    assert engine.cache_stats()["entries"] >= 1
    # the same weights at version "0": the module's other tests expect the engine as `ckpt` made it
    assert post(engine.url + "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "0"})[0] == 200
    assert engine.cache_stats()["entries"] == 0
    nxt = generate(engine, ids + res["output_ids"] + prompt(tok, "x"), temperature=0, max_new_tokens=2)
    assert nxt["meta_info"]["cached_tokens"] == 0


def test_a_request_joins_the_running_batch_and_a_finished_row_leaves_at_once(engine, tok):
    """Continuous batching: a short request sent while a long one decodes is answered while the long one still
    runs (no wave to wait for), and the long one's reply is unchanged by the rows that joined and left."""
    long_ids = prompt(tok, "a long answer")
    alone = generate(engine, long_ids, temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=4)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("long", generate(
        engine, long_ids, temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=4)))
    t.start()
    deadline = time.time() + 60
    while not engine.running and time.time() < deadline:
        time.sleep(0.005)
    shorts = [generate(engine, prompt(tok, f"short {i}"), temperature=0, max_new_tokens=3, ignore_eos=True)
              for i in range(3)]
    assert t.is_alive() and len(engine.running) == 1, "the short requests waited for the long one"
    t.join(timeout=120)
    assert all(len(s["output_ids"]) == 3 for s in shorts)
    assert box["long"]["output_ids"] == alone["output_ids"]
    la = torch.tensor([x[0] for x in alone["meta_info"]["output_token_logprobs"]])
    lb = torch.tensor([x[0] for x in box["long"]["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(la, lb, atol=1e-4, rtol=0)


def test_routing_capture_writes_into_a_preallocated_buffer(ckpt, tok):
    """r3.routing(..., into=buf): the routers copy each forward's top-k ids into buf (row b * T + t) with no list
    of tensors; the same ids as the list capture; a buffer of the wrong shape or dtype is refused by name."""
    actor, _ = model_lib.load_actor(ckpt)
    ids = torch.tensor([prompt(tok, "buffer"), prompt(tok, "reffub")])  # (2, T)
    buf = torch.full((64, 4, 2), -7, dtype=torch.int32)
    with torch.no_grad():
        with r3.routing(actor, "record") as rec:
            actor(ids)
        with r3.routing(actor, "record", into=buf) as rec2:
            actor(ids)
    n = ids.numel()
    assert (buf[:n].view(2, -1, 4, 2) == rec.experts).all() and (buf[n:] == -7).all() and not rec2.forwards
    for bad in (torch.zeros(8, 4, 2, dtype=torch.int64), torch.zeros(8, 3, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="into:"):
            with r3.routing(actor, "record", into=bad):
                pass
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=2, capture_routing=False).start()
    try:
        status, out = post(eng.url + "/generate", {"input_ids": prompt(tok, "x"), "return_routed_experts": True})
        assert status == 400 and out["error"].startswith("return_routed_experts:")
        assert post(eng.url + "/generate", {"input_ids": prompt(tok, "x"),
                                            "sampling_params": {"max_new_tokens": 2}})[0] == 200
    finally:
        eng.stop()


def test_a_distributed_weight_update_is_refused_before_it_allocates(engine, tok):
    """/update_weights_from_distributed: a bucket announcing more than twice the model's bytes is refused before
    anything is allocated or received; a group never joined is refused by name; malformed lists are 400."""
    huge = {"names": ["x"], "dtypes": ["float32"], "shapes": [[2**20, 2**12]], "group_name": "g"}  # 16 GiB
    status, out = post(engine.url + "/update_weights_from_distributed", huge)
    assert status == 400 and out["error"].startswith("shapes:"), out
    small = dict(huge, shapes=[[2, 2]])
    status, out = post(engine.url + "/update_weights_from_distributed", small)
    assert status == 400 and out["error"].startswith("group_name:"), out
    for bad in (dict(small, dtypes=["int64"]), dict(small, shapes=[[-1]]), dict(small, names=[1]),
                dict(small, dtypes=[])):
        status, out = post(engine.url + "/update_weights_from_distributed", bad)
        assert status == 400 and "names / dtypes / shapes" in out["error"], (bad, out)
    if not torch.cuda.is_available():  # a CPU engine cannot join an NCCL group
        status, out = post(engine.url + "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"})
        assert status == 400 and out["error"].startswith("backend:"), out


def test_the_engine_benchmark_runs_and_reports_every_figure(capsys, tmp_path, monkeypatch):
    """`python -m experiments.bench engine --quick`: one JSON line with the HF comparison at 8 / 32, the multi-turn
    workload (whose later turns hit the prefix cache), the same workloads over two 1-thread engines, and the capture
    overhead; no figure asserted, only that each exists. Its checkpoint's temporary folder is gone afterwards."""
    import tempfile
    from experiments import bench
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bench.main(["engine", "--quick", "--threads", "2"])
    assert not list(tmp_path.glob("t1_engine_bench_*"))
    fig = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in ("engine_vs_hf_8", "engine_vs_hf_32", "hf_tok_s_32", "engine_tok_s_32"):
        assert fig[k] > 0, k
    assert fig["multi_turn"]["cache_on_vs_off"] > 0 and fig["prefix_cache"]["hits"] >= 2
    assert fig["data_parallel"]["engines"] == 2 and fig["data_parallel"]["multi_turn_vs_hf"] > 0
    assert fig["multi_turn"]["engine_cache_vs_hf_cache"] > 0 and fig["data_parallel"]["multi_turn_vs_hf_cache"] > 0
    mt = fig["multi_turn"]  # HF at its best: the fastest of its caches, named
    assert set(mt["hf_tok_s_by_cache"]) == {"dynamic", "static"} and mt["engine_cache_vs_hf_best"] > 0
    assert mt["hf_tok_s_by_cache"][mt["hf_baseline"].split(", ")[1].split()[0]] == max(mt["hf_tok_s_by_cache"].values())
    for n in (8, 32):
        by_cache, best = fig[f"hf_tok_s_{n}_by_cache"], fig[f"hf_baseline_{n}"].split(", ")[1].split()[0]
        assert by_cache[best] == fig[f"hf_tok_s_{n}"] == max(by_cache.values())
    assert {"overhead_pct", "overhead_pct_95ci", "capture_ops_pct_of_step"} <= set(fig["capture"])
    for bad in ("1", "3"):  # one engine is the single-engine figure; 3 engines cannot share 2 threads
        with pytest.raises(ValueError, match="dp: expected 0"):
            bench.main(["engine", "--quick", "--threads", "2", "--dp", bad])


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_the_benchmarks_hf_with_its_cache_carried_between_turns_gives_the_re_prefilled_tokens(arch):
    """The engine benchmark's HF baseline at its best keeps its KV cache across an agent's turns, a DynamicCache or a
    StaticCache: the same greedy tokens, turn after turn, as HF re-prefilling the whole history each turn (so they
    time the same work)."""
    from experiments import engine_speed
    tok = model_lib.train_tokenizer([f"echo line {i} > file{i}.txt" for i in range(30)], 300)
    hf = model_lib.build_actor(model_lib.tiny_config(len(tok), arch), seed=0).eval()
    agents, tool = engine_speed._bench_prompts(tok, 3, 80, seed=1), engine_speed._bench_prompts(tok, 1, 40, seed=2)[0]
    seen = []  # positions the model embeds, per forward: the work each way does
    hf.get_input_embeddings().register_forward_hook(lambda mod, inp, out: seen.append(inp[0].shape[1]))
    fresh = engine_speed._hf_agents(hf, agents, 3, 8, tool, sample=False)
    n_fresh, seen[:] = sum(seen), []
    for cache in ("dynamic", "static"):
        seen[:] = []
        cached = engine_speed._hf_agents(hf, agents, 3, 8, tool, cache=cache, sample=False)
        assert cached == fresh and len(cached[0]) == 80 + 3 * (8 + 40), cache
        # re-prefilling embeds 80, 128, 176 prompt positions + 7 decode steps a turn; a cache only what it lacks
        assert n_fresh == 80 + 128 + 176 + 3 * 7 and sum(seen) == 80 + 2 * (1 + 40) + 3 * 7, (cache, n_fresh, seen)


def test_a_fault_outside_a_forward_fails_the_running_requests_and_the_engine_goes_on(ckpt, tok, monkeypatch):
    """Any exception of a scheduler step (here: the prefix cache's insert raising) answers each running request
    with HTTP 500 naming it, instead of killing the scheduler thread and leaving clients waiting forever; the next
    request is served."""
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=2).start()
    try:
        def broken(*a, **k):
            raise RuntimeError("injected fault")
        monkeypatch.setattr(eng.prefix, "insert", broken)
        status, out = post(eng.url + "/generate", {"input_ids": prompt(tok, "x"), "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        assert status == 500 and "injected fault" in out["error"], out
        monkeypatch.undo()
        assert eng.health() is None and not eng.running and len(eng.free_slots) == 2
        status, out = post(eng.url + "/generate", {"input_ids": prompt(tok, "x"), "sampling_params": {
            "max_new_tokens": 3, "ignore_eos": True}})
        assert status == 200 and len(out["output_ids"]) == 3
    finally:
        eng.stop()


def test_release_and_resume_memory_as_the_colocated_preset_uses_them(ckpt, tok):
    """SGLang's /release_memory_occupation and /resume_memory_occupation on the embedded engine (train_t1 --colocate):
    released, /generate is refused with 409 naming the endpoint and weights cannot be loaded; after resume the
    weights storage is back but uninitialised, so /generate stays refused until weights are loaded; then greedy
    replies equal the engine's before the release (same checkpoint). Bad tags get 400; the KV-cache tag alone clears
    the prefix cache and keeps the weights."""
    eng = engine_lib.EngineServer(ckpt, port=0, max_batch=4).start()
    try:
        ids = prompt(tok, "hello")
        before = generate(eng, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert eng.prefix.entries  # the reply's states are cached
        assert post(eng.url + "/release_memory_occupation", {"tags": ["gpu"]})[0] == 400
        assert post(eng.url + "/release_memory_occupation", {"tags": []})[0] == 400
        status, out = post(eng.url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 200 and out["released"] == ["kv_cache"]
        assert not eng.prefix.entries and eng.prefix.bytes == 0
        assert post(eng.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})[0] == 409
        assert post(eng.url + "/resume_memory_occupation", {"tags": ["kv_cache"]})[1]["released"] == []
        again = generate(eng, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert again["output_ids"] == before["output_ids"]
        status, out = post(eng.url + "/release_memory_occupation", {})  # both
        assert status == 200 and out["released"] == ["kv_cache", "weights"]
        assert sum(p.numel() for p in eng.model.parameters()) == 0  # the storage is gone
        status, out = post(eng.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert status == 409 and "/resume_memory_occupation" in out["error"]
        status, out = post(eng.url + "/update_weights_from_disk", {"model_path": ckpt})
        assert status == 400 and "released" in out["message"]
        assert post(eng.url + "/resume_memory_occupation", {})[1]["released"] == []
        status, out = post(eng.url + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert status == 409 and "load weights" in out["error"]  # storage back, contents not
        assert post(eng.url + "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "back"})[0] == 200
        after = generate(eng, ids, temperature=0, max_new_tokens=6, ignore_eos=True)
        assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "back"
    finally:
        eng.stop()
