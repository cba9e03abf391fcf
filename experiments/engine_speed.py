"""The engine's speed: the embedded engine against Hugging Face generate, its prefix cache, the cost of routed-expert
capture, and one decode step's sampling row by row against batched.

    python -m experiments.bench engine [--arch A] [--dp 2]   # one JSON line: engine_bench
    python -m experiments.bench sampling                     # one JSON line: sampling_bench

Ratios are measured in one run, repeats interleaved (a shared machine drifts), never asserted in tests; ratios > 1
favour the engine (or the cache).
"""
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import chat_tokens
import model
import r3
from engine.batcher import sample_rows
from engine.client import EngineClient
from engine.kvcache import _build_cache, _cache_state
from engine.server import EngineServer

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train_t1.py, engine/, ...


# --- engine: the embedded engine vs Hugging Face generate; prefix cache; capture overhead ---------------
def post_json(url, obj):
    """POST obj as JSON -> the decoded reply (10 minutes at most)."""
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _bench_prompts(tok, n, length, seed):
    """n chat prompts of `length` token ids (a user turn of random corpus pieces, then the assistant prefix)."""
    g = torch.Generator().manual_seed(seed)
    head, tail = model.render_ids(tok, "user", "")[:-2], tok.encode(chat_tokens.ASSISTANT_PREFIX)
    body = length - len(head) - len(tail) - 2
    return [head + torch.randint(3, len(tok), (body,), generator=g).tolist() + model.render_ids(tok, "user", "")[-2:]
            + tail for _ in range(n)]


def _hf_generate(hf, histories, new_tokens, cache=None, sample=True, compile_config=None):
    """HF generate over a left-padded batch (sampling at T = 1, or greedy; fixed length) -> (each row's new ids, the
    KV cache it leaves). Passed back as `cache` with the same rows grown, generate prefills only what the cache
    lacks; a transformers.StaticCache passed in is written in place (generate's static-cache path); compile_config:
    generate's torch.compile of the decode forward (which needs a static cache)."""
    T = max(len(h) for h in histories)
    ids = torch.tensor([[0] * (T - len(h)) + h for h in histories])
    mask = torch.tensor([[0] * (T - len(h)) + [1] * len(h) for h in histories])
    kw = {"cache": cache} if cache is not None else {}
    if compile_config is not None:
        kw["compile_config"] = compile_config
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=sample, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                          return_dict_in_generate=True, **kw)
    return out.sequences[:, T:].tolist(), getattr(out, "cache", None) or out.past_key_values


def _engine_agents(url, histories, turns, new_tokens, tool, routing=True):
    """Each history is one agent running `turns` turns concurrently with the others (one request in flight each):
    turn t sends the whole trajectory so far; the reply and a tool output of fixed tokens are appended. url: one
    engine, or a list: agent i on engine i mod len (as train_t1 deals trials round robin over its engines)."""
    urls = url if isinstance(url, list) else [url]

    def agent(i):
        h = histories[i]
        for t in range(turns):
            out = post_json(urls[i % len(urls)] + "/generate", {
                "input_ids": h, "return_logprob": True, "return_routed_experts": routing,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}})
            h = h + out["output_ids"] + tool
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(histories))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


HF_CACHES = ("none", "dynamic", "static", "compiled")  # _hf_agents' ways of carrying HF's state between turns


def _compile_config():
    """generate's torch.compile settings for the "compiled" HF (static shapes; transformers compiles on CUDA-like
    devices only unless told to compile on all)."""
    cc = transformers.CompileConfig(dynamic=False, fullgraph=False)
    cc._compile_all_devices = True
    return cc


def _hf_agents(hf, histories, turns, new_tokens, tool, cache="none", sample=True):
    """The same workload through HF generate, all agents as one batch each turn. cache: "none" re-prefills every
    history from scratch each turn; "dynamic" carries HF's own KV cache (a DynamicCache) from turn to turn, so only
    the reply's last token and the tool output are prefilled (greedy tokens equal the re-prefilled ones,
    tests/test_engine.py); "static" carries a transformers.StaticCache sized for the whole trajectory (written in
    place, no concatenation per step); "compiled" the static cache with generate's torch.compile of the decode
    forward (compiled on first use: warm it up at the timed shapes). A carried cache needs histories of one length
    (they are: _bench_prompts), so that the rows stay aligned as they grow."""
    if cache not in HF_CACHES:
        raise ValueError(f"cache: expected one of {'|'.join(HF_CACHES)}, got {cache!r}")
    if cache != "none" and len({len(h) for h in histories}) > 1:
        raise ValueError(f"_hf_agents(cache={cache!r}): histories of lengths {sorted({len(h) for h in histories})}; "
                         "a carried cache needs one length (left padding would shift between turns)")
    hs, kv = list(histories), None
    if cache in ("static", "compiled"):
        kv = transformers.StaticCache(config=hf.config, max_cache_len=len(hs[0]) + turns * (new_tokens + len(tool)))
    cc = _compile_config() if cache == "compiled" else None
    for t in range(turns):
        outs, out_kv = _hf_generate(hf, hs, new_tokens, kv, sample=sample, compile_config=cc)
        kv = None if cache == "none" else out_kv
        hs = [h + o + tool for h, o in zip(hs, outs)]
    return hs


@torch.inference_mode()
def _capture_overhead(hf, eng, n_rows, prompt_len, steps, seed=0):
    """What routed-expert capture adds to a decode step of n_rows rows, as the engine does it (the routers copy
    their top-k ids into the engine's step buffer, then one indexed copy into the rows' slots): steps decode steps
    with capture and steps without, alternating step by step on one growing cache (so drift and cache length hit
    both alike); -> median step ms each, the overhead in % of the step and its 95% bootstrap interval; and the
    added operations alone (routing context, the routers' copies, the slot copy; 2,000 repeats) in % of a step."""
    g = torch.Generator().manual_seed(seed)
    V, cfg = hf.config.vocab_size, hf.config
    cache = transformers.DynamicCache(config=cfg)
    hf(input_ids=torch.randint(3, V, (n_rows, prompt_len), generator=g), cache=cache, use_cache=True,
       logits_to_keep=1)
    cache = _build_cache(cfg, _cache_state(cache, slice(None), prompt_len, copy=False))
    mask = torch.ones(n_rows, prompt_len + 2 * steps, dtype=torch.long)
    slots = torch.arange(n_rows)
    ms = {True: [], False: []}
    for i in range(2 * steps):
        on = i % 2 == 0
        n = prompt_len + i
        if on:
            ctx = r3.routing(hf, "record", into=eng.step_buf)
            ctx.__enter__()
        kw = dict(input_ids=torch.randint(3, V, (n_rows, 1), generator=g), attention_mask=mask[:, :n + 1],
                  position_ids=torch.full((n_rows, 1), n), cache=cache, use_cache=True)
        t0 = time.perf_counter()
        if on:  # (entering the context is outside the timed region, as in the engine)
            hf(**kw)
            eng.slot_buf[slots, torch.full((n_rows,), n)] = eng.step_buf[:n_rows]
        else:
            hf(**kw)
        ms[on].append(1e3 * (time.perf_counter() - t0))
        if on:
            ctx.__exit__(None, None, None)
    # the added work alone, timed without the forward: the routers' copies, the slot copy (the engine holds the
    # routing context open, so entering it is not per step)
    live = torch.randint(0, cfg.num_experts, (n_rows, eng.top_k))
    ops = []
    for _ in range(2000):
        t0 = time.perf_counter()
        for layer in range(eng.num_layers):
            eng.step_buf[:n_rows, layer].copy_(live)
        eng.slot_buf[slots, torch.full((n_rows,), prompt_len)] = eng.step_buf[:n_rows]
        ops.append(1e3 * (time.perf_counter() - t0))
    on, off = np.array(ms[True]), np.array(ms[False])
    rng = np.random.default_rng(seed)
    boot = [np.median(rng.choice(on, on.size)) / np.median(rng.choice(off, off.size)) - 1 for _ in range(2000)]
    return {"rows": n_rows, "steps_each": steps, "step_ms_on": round(float(np.median(on)), 3),
            "step_ms_off": round(float(np.median(off)), 3),
            "overhead_pct": round(100 * (float(np.median(on) / np.median(off)) - 1), 2),
            "overhead_pct_95ci": [round(100 * float(np.percentile(boot, q)), 2) for q in (2.5, 97.5)],
            "capture_ops_ms": round(float(np.median(ops)), 4),
            "capture_ops_pct_of_step": round(100 * float(np.median(ops)) / float(np.median(off)), 3)}


def _serve(path, threads, *flags, dtype="fp32"):
    """`python -m engine.server serve` in its own process (as train_t1's engine actors and SGLang run: a process whose
    main thread does no torch work) of weights `dtype` (fp32: the checkpoint as is) -> (Popen, url) once it answers.
    The server binds a port the kernel picks (--port 0) and prints its URL: a port picked here and bound there could
    be taken in between (a suite's many local connections); one that exits first is refused with its stderr's end."""
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", path, "--port", "0",
                             "--weight-dtype", dtype, "--threads", str(threads), *flags], stdout=subprocess.PIPE,
                            stderr=err, text=True, cwd=ROOT)
    line = proc.stdout.readline()  # "engine serving PATH at URL", printed once healthy
    if "engine serving" not in line:
        proc.kill()
        code = proc.wait()
        err.seek(0)
        raise RuntimeError(f"engine.server serve --model-path {path}: exited with {code} before serving; stderr "
                           f"ends: {err.read()[-2000:]}")
    err.close()
    return proc, line.rsplit(" at ", 1)[1].strip()


def engine_bench(arch="qwen3_moe", repeats=3, prompt_len=300, new_tokens=128, turns=8, turn_tokens=48,
                 n_agents=8, capture_steps=400, dp=2, work_dir=None, hf_compile=False) -> dict:
    """The engine's figures in one run, repeats interleaved (the machine drifts): generated tokens/s of the engine
    (`engine/server.py serve` processes with this process's torch threads; HTTP clients, logprobs + routed experts
    returned) vs HF `generate` in this process on the same fp32 checkpoint at 8 and 32 concurrent single-turn
    requests (~prompt_len-token prompts, new_tokens each), and the engine's own forward vs its transformers
    one (--forward hf); a multi-turn workload (n_agents agents x `turns` turns,
    turn_tokens new + 40 tool tokens per turn, the history growing) through HF re-prefilling every turn, HF carrying
    its own KV cache between turns, the engine with its prefix cache off, and on; the capture overhead
    (_capture_overhead, in this process). HF at its best: each HF workload runs with a DynamicCache and with a
    StaticCache (and hf_compile: the static cache with generate's torch.compile), and each ratio is against the
    fastest, named in the figures (hf_baseline_8, hf_baseline_32, multi_turn.hf_baseline). Every engine and HF
    configuration gets the same warm-up before timing. Medians; ratios > 1 favour the engine / the cache. dp > 1
    adds the same cores as dp engines of threads / dp torch threads each (prefix cache on; the requests dealt round
    robin: `train_t1.py --n-engines dp --torch-threads threads/dp`, SGLang's data parallelism) on the 32-request
    and multi-turn workloads, against the same HF generate (one process, all threads)."""
    threads = torch.get_num_threads()
    if dp < 0 or dp == 1 or dp > threads:
        raise ValueError(f"dp: expected 0 (not measured) or 2..{threads} engines sharing the {threads} threads, "
                         f"got {dp}")
    work = work_dir or tempfile.mkdtemp(prefix="t1_engine_bench_")
    tok = model.train_tokenizer([f"echo line {i} > file{i}.txt && cat file{i}.txt | wc -l" for i in range(50)], 400)
    model.save_checkpoint(model.build_actor(model.tiny_config(len(tok), arch), seed=0), tok, work)
    hf, _ = model.load_actor(work)
    hf.eval()
    procs = []
    try:
        procs.append(_serve(work, threads))
        procs.append(_serve(work, threads, "--prefix-cache-mb", "0"))
        procs.append(_serve(work, threads, "--prefix-cache-mb", "0", "--forward", "hf"))
        for _ in range(dp):
            procs.append(_serve(work, threads // dp))
        return _engine_figures(hf, tok, *(url for _, url in procs[:3]), [url for _, url in procs[3:]],
                               EngineServer(work, weight_dtype="fp32"), arch, repeats, prompt_len, new_tokens, turns,
                               turn_tokens, n_agents, capture_steps, hf_compile)
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait()
        if work_dir is None:  # a folder of our own: removed with its checkpoint (a given one is the caller's)
            shutil.rmtree(work, ignore_errors=True)


def _engine_figures(hf, tok, on, off, off_hf, dp, buffers, arch, repeats, prompt_len, new_tokens, turns, turn_tokens,
                    n_agents, capture_steps, hf_compile=False):
    """engine_bench's measurements: `on` / `off` the engines' URLs (prefix cache on / off), `off_hf` off's twin
    forwarding through the transformers forward (--forward hf), `dp` the data-parallel engines' URLs (or []);
    `buffers` an unstarted EngineServer whose capture buffers _capture_overhead writes."""
    tool = _bench_prompts(tok, 1, 40, seed=99)[0]
    single = {n: _bench_prompts(tok, n, prompt_len, seed=n) for n in (8, 32)}
    agents = _bench_prompts(tok, n_agents, prompt_len, seed=7)
    t = {}

    def timed(key, fn):
        t0 = time.perf_counter()
        fn()
        t.setdefault(key, []).append(time.perf_counter() - t0)
    hf_kw = {"dynamic": {}, "static": {"cache": True}, "compiled": {"cache": True, "compile_config": _compile_config()}}
    singles = ("dynamic", "static") + (("compiled",) if hf_compile else ())  # HF generate at 8 / 32: its caches
    multis = ("dynamic", "static") + (("compiled",) if hf_compile else ())  # HF multi-turn: carried caches

    def hf_single(name, n):
        kw = dict(hf_kw[name])
        if kw.pop("cache", False):
            kw["cache"] = transformers.StaticCache(config=hf.config, max_cache_len=prompt_len + new_tokens)
        return _hf_generate(hf, single[n], new_tokens, **kw)
    # warm-up: the same calls and tokens on every side (2 agents x 2 turns x 8 tokens: a cold prefill, then a turn
    # on the carried cache / prefix cache), each engine and each HF configuration
    for url in [on, off, off_hf] + dp:
        _engine_agents(url, agents[:2], 2, 8, tool)
    for c in ("none",) + multis:
        _hf_agents(hf, agents[:2], 2, 8, tool, cache=c)
    if hf_compile:  # torch.compile compiles per shape: one untimed pass at each timed shape
        for n in (8, 32):
            hf_single("compiled", n)
        _hf_agents(hf, agents, turns, turn_tokens, tool, cache="compiled")
    for _ in range(repeats):
        for n in (8, 32):
            for name in singles:
                timed(f"hf_{name}_{n}", lambda: hf_single(name, n))
            timed(f"engine_{n}", lambda: _engine_agents(off, single[n], 1, new_tokens, tool))
            timed(f"engine_hf_forward_{n}", lambda: _engine_agents(off_hf, single[n], 1, new_tokens, tool))
        if dp:
            timed("engine_dp_32", lambda: _engine_agents(dp, single[32], 1, new_tokens, tool))
        for c in ("none",) + multis:
            timed(f"hf_multi_{c}", lambda: _hf_agents(hf, agents, turns, turn_tokens, tool, cache=c))
        timed("engine_multi_nocache", lambda: _engine_agents(off, agents, turns, turn_tokens, tool))
        timed("engine_multi_cache", lambda: _engine_agents(on, agents, turns, turn_tokens, tool))
        if dp:
            timed("engine_dp_multi", lambda: _engine_agents(dp, agents, turns, turn_tokens, tool))
    med = {k: float(np.median(v)) for k, v in t.items()}
    fig = {"arch": arch, "repeats": repeats, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
           "warmup": "each engine and HF configuration: 2 agents x 2 turns x 8 new tokens"
           + ("; compiled HF: also one pass at each timed shape" if hf_compile else "")}
    for n in (8, 32):
        best = min(singles, key=lambda c: med[f"hf_{c}_{n}"])  # HF at its best: the fastest configuration
        med[f"hf_{n}"] = med[f"hf_{best}_{n}"]
        fig[f"hf_baseline_{n}"] = f"generate, {best} cache"
        fig[f"hf_tok_s_{n}_by_cache"] = {c: round(n * new_tokens / med[f"hf_{c}_{n}"], 1) for c in singles}
        fig[f"hf_tok_s_{n}"] = round(n * new_tokens / med[f"hf_{n}"], 1)
        fig[f"engine_tok_s_{n}"] = round(n * new_tokens / med[f"engine_{n}"], 1)
        fig[f"engine_vs_hf_{n}"] = round(med[f"hf_{n}"] / med[f"engine_{n}"], 2)
        fig[f"own_vs_hf_forward_{n}"] = round(med[f"engine_hf_forward_{n}"] / med[f"engine_{n}"], 2)
    multi = n_agents * turns * turn_tokens
    best = min(multis, key=lambda c: med[f"hf_multi_{c}"])
    med["hf_multi_best"] = med[f"hf_multi_{best}"]
    fig["multi_turn"] = {"agents": n_agents, "turns": turns, "new_tokens_per_turn": turn_tokens,
                         "hf_tok_s": round(multi / med["hf_multi_none"], 1),
                         "engine_nocache_tok_s": round(multi / med["engine_multi_nocache"], 1),
                         "engine_cache_tok_s": round(multi / med["engine_multi_cache"], 1),
                         "engine_cache_vs_hf": round(med["hf_multi_none"] / med["engine_multi_cache"], 2),
                         "hf_cache_tok_s": round(multi / med["hf_multi_dynamic"], 1),
                         "hf_tok_s_by_cache": {c: round(multi / med[f"hf_multi_{c}"], 1) for c in multis},
                         "hf_baseline": f"generate, {best} cache carried across turns",
                         "engine_cache_vs_hf_cache": round(med["hf_multi_dynamic"] / med["engine_multi_cache"], 2),
                         "engine_cache_vs_hf_best": round(med["hf_multi_best"] / med["engine_multi_cache"], 2),
                         "cache_on_vs_off": round(med["engine_multi_nocache"] / med["engine_multi_cache"], 2)}
    if dp:
        fig["data_parallel"] = {"engines": len(dp), "threads_each": torch.get_num_threads() // len(dp),
                                "engine_tok_s_32": round(32 * new_tokens / med["engine_dp_32"], 1),
                                "engine_vs_hf_32": round(med["hf_32"] / med["engine_dp_32"], 2),
                                "multi_turn_tok_s": round(multi / med["engine_dp_multi"], 1),
                                "multi_turn_vs_hf": round(med["hf_multi_none"] / med["engine_dp_multi"], 2),
                                "multi_turn_vs_hf_cache": round(med["hf_multi_dynamic"] / med["engine_dp_multi"], 2),
                                "multi_turn_vs_hf_best": round(med["hf_multi_best"] / med["engine_dp_multi"], 2)}
    fig["capture"] = _capture_overhead(hf, buffers, n_rows=32, prompt_len=prompt_len, steps=capture_steps)
    fig["prefix_cache"] = EngineClient(on).server_info()["prefix_cache"]
    fig["seconds"] = {k: [round(x, 2) for x in v] for k, v in t.items()}
    return fig




# --- sampling: one decode step, row by row vs batched ------------------------------------------------------
def _sample_one_row(logits, temperature, top_p, gen):
    """The engine's per-row sampler before sample_rows (2026-11-30), kept as the baseline of sampling_bench."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # (V,)
    probs = logp.exp()
    if not torch.isfinite(probs).all():
        raise ValueError("sampling: non-finite probabilities")
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(logp[tok])


def sampling_bench(rows=(8, 32), vocab=2048, repeats=200, seed=0) -> dict:
    """One decode step's sampling: the engine's former per-row sampler row by row vs one sample_rows call for all
    rows; T = 1, top-p 0.95, seeded rows; interleaved repeats, median ms per step."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in rows:
        logits = torch.randn(n, vocab, generator=g) * 3
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        t_row, t_batch = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(n):
                _sample_one_row(logits[i], 1.0, 0.95, gens[i])
            t1 = time.perf_counter()
            sample_rows(logits, [1.0] * n, [0.95] * n, [-1] * n, gens)
            t2 = time.perf_counter()
            t_row.append(t1 - t0)
            t_batch.append(t2 - t1)
        row_ms, batch_ms = 1e3 * float(np.median(t_row)), 1e3 * float(np.median(t_batch))
        out[f"rows_{n}"] = {"per_row_ms": round(row_ms, 3), "batched_ms": round(batch_ms, 3),
                            "speedup": round(row_ms / batch_ms, 2)}
    return out
