"""Measurement commands that need the engine or a whole pipeline: each prints the figures of one claim.

    python -m experiments.bench engine [--arch A] [--dp 2] # engine vs HF generate (8 / 32 concurrent; multi-turn,
    prefix cache on
                                               # / off; the same cores as --dp engines); routed-expert capture overhead
    python -m experiments.bench sampling                   # one decode step's sampling: row by row vs batched (ms)
    python -m experiments.bench r3 --quick                 # R3: |delta log p| engine vs trainer, replay off / on;
    capture overhead python -m experiments.bench tito --quick [--harness client|harbor]  # TITO: naive retokenization vs
    TITO through the gateway python -m experiments.bench cp [--kappas 1 2 4 8] [--seq-len 1024]  # CP Gated DeltaNet:
    exactness, activation peak vs kappa python -m experiments.bench copy [--arch qwen3_moe qwen3_5_moe] [--steps 1000]
    [--seed 0]  # the copy gate vs steps python -m experiments.bench pg-snr runs/x [--ckpt sft] [--steps 1 2 3] [--n 96]
     # policy-gradient signal / noise per trajectory
    python -m experiments.bench plot runs/x                # a run's curves (curves.png); train_t1.py prints its table
    at the end python -m experiments.bench compare A B                # two evaluations paired; exit 1 naming the file
    that evaluated nothing python train_t1.py trainer-bench [--shape t1-tiny|probe|122b-slice] [train_t1 flags]  # the
    trainer's Megatron
                                               # path on this node (the cluster model on CUDA): step time, dlogp,
                                               # peak memory vs the memory model (needs Args: run through train_t1)
 Each one writes what it measures to stdout (one JSON line, or a table for cp); the figures measured so far are in
RESULTS.md. Ratios are measured in one run (interleaved where a shared machine drifts), never asserted in tests.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import chat_tokens
from cluster import launch
from cluster import cp_gdn
import data
from engine import gateway
import infra
import model
import ppo
import r3
import rollout
import tito
from engine.server import EngineServer, sample_rows
from engine.kvcache import _build_cache, _cache_state
from trainer import Metrics

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train_t1.py, engine/, ...


# --- engine: the embedded engine vs Hugging Face generate; prefix cache; capture overhead ---------------
def _post(url, obj):
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


def _hf_generate(hf, histories, new_tokens):
    """HF generate over a left-padded batch (sampling at T = 1, fixed length) -> each row's new ids."""
    T = max(len(h) for h in histories)
    ids = torch.tensor([[0] * (T - len(h)) + h for h in histories])
    mask = torch.tensor([[0] * (T - len(h)) + [1] * len(h) for h in histories])
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, T:].tolist()


def _engine_agents(url, histories, turns, new_tokens, tool, routing=True):
    """Each history is one agent running `turns` turns concurrently with the others (one request in flight each):
    turn t sends the whole trajectory so far; the reply and a tool output of fixed tokens are appended. url: one
    engine, or a list: agent i on engine i mod len (as train_t1 deals trials round robin over its engines)."""
    urls = url if isinstance(url, list) else [url]

    def agent(i):
        h = histories[i]
        for t in range(turns):
            out = _post(urls[i % len(urls)] + "/generate", {
                "input_ids": h, "return_logprob": True, "return_routed_experts": routing,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}})
            h = h + out["output_ids"] + tool
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(histories))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _hf_agents(hf, histories, turns, new_tokens, tool):
    """The same workload through HF generate: every turn, all agents as one batch, re-prefilled from scratch."""
    hs = list(histories)
    for t in range(turns):
        outs = _hf_generate(hf, hs, new_tokens)
        hs = [h + o + tool for h, o in zip(hs, outs)]


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


def _serve(path, threads, *flags):
    """`python -m engine.server serve` in its own process (as train_t1's engine actors and SGLang run: a process whose
    main thread does no torch work) -> (Popen, url) once it answers."""
    port = infra.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.server", "serve", "--model-path", path, "--port", str(port),
                             "--weight-dtype", "fp32", "--threads", str(threads), *flags], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    if "engine serving" not in proc.stdout.readline():  # printed once healthy
        proc.kill()
        raise RuntimeError(f"engine.server serve --model-path {path}: exited with {proc.wait()} before serving")
    return proc, f"http://127.0.0.1:{port}"


def engine_bench(arch="qwen3_moe", repeats=3, prompt_len=300, new_tokens=128, turns=8, turn_tokens=48,
                 n_agents=8, capture_steps=400, dp=2, work_dir=None) -> dict:
    """Issue 15's figures in one run, repeats interleaved (the machine drifts): generated tokens/s of the engine
    (`engine/server.py serve` processes with this process's torch threads; HTTP clients, logprobs + routed experts
    returned) vs HF `generate` in this process on the same fp32 checkpoint at 8 and 32 concurrent single-turn
    requests (~prompt_len-token prompts, new_tokens each), and the engine's own forward vs its transformers
    one (--forward hf); a multi-turn workload (n_agents agents x `turns` turns,
    turn_tokens new + 40 tool tokens per turn, the history growing) through HF, the engine with its prefix cache
    off, and on; the capture overhead (_capture_overhead, in this process). Medians; ratios > 1 favour the engine /
    the cache. dp > 1 adds the same cores as dp engines of threads / dp torch threads each (prefix cache on; the
    requests dealt round robin: `train_t1.py --n-engines dp --torch-threads threads/dp`, SGLang's data parallelism)
    on the 32-request and multi-turn workloads, against the same HF generate (one process, all threads)."""
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
                               turn_tokens, n_agents, capture_steps)
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait()


def _engine_figures(hf, tok, on, off, off_hf, dp, buffers, arch, repeats, prompt_len, new_tokens, turns, turn_tokens,
                    n_agents, capture_steps):
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
    for url in [on] + dp:
        _engine_agents(url, single[8][:2], 1, 8, tool)  # warm-up both sides
    _hf_generate(hf, single[8][:2], 8)
    for _ in range(repeats):
        for n in (8, 32):
            timed(f"hf_{n}", lambda: _hf_generate(hf, single[n], new_tokens))
            timed(f"engine_{n}", lambda: _engine_agents(off, single[n], 1, new_tokens, tool))
            timed(f"engine_hf_forward_{n}", lambda: _engine_agents(off_hf, single[n], 1, new_tokens, tool))
        if dp:
            timed("engine_dp_32", lambda: _engine_agents(dp, single[32], 1, new_tokens, tool))
        timed("hf_multi", lambda: _hf_agents(hf, agents, turns, turn_tokens, tool))
        timed("engine_multi_nocache", lambda: _engine_agents(off, agents, turns, turn_tokens, tool))
        timed("engine_multi_cache", lambda: _engine_agents(on, agents, turns, turn_tokens, tool))
        if dp:
            timed("engine_dp_multi", lambda: _engine_agents(dp, agents, turns, turn_tokens, tool))
    med = {k: float(np.median(v)) for k, v in t.items()}
    fig = {"arch": arch, "repeats": repeats, "prompt_tokens": prompt_len, "new_tokens": new_tokens}
    for n in (8, 32):
        fig[f"hf_tok_s_{n}"] = round(n * new_tokens / med[f"hf_{n}"], 1)
        fig[f"engine_tok_s_{n}"] = round(n * new_tokens / med[f"engine_{n}"], 1)
        fig[f"engine_vs_hf_{n}"] = round(med[f"hf_{n}"] / med[f"engine_{n}"], 2)
        fig[f"own_vs_hf_forward_{n}"] = round(med[f"engine_hf_forward_{n}"] / med[f"engine_{n}"], 2)
    multi = n_agents * turns * turn_tokens
    fig["multi_turn"] = {"agents": n_agents, "turns": turns, "new_tokens_per_turn": turn_tokens,
                         "hf_tok_s": round(multi / med["hf_multi"], 1),
                         "engine_nocache_tok_s": round(multi / med["engine_multi_nocache"], 1),
                         "engine_cache_tok_s": round(multi / med["engine_multi_cache"], 1),
                         "engine_cache_vs_hf": round(med["hf_multi"] / med["engine_multi_cache"], 2),
                         "cache_on_vs_off": round(med["engine_multi_nocache"] / med["engine_multi_cache"], 2)}
    if dp:
        fig["data_parallel"] = {"engines": len(dp), "threads_each": torch.get_num_threads() // len(dp),
                                "engine_tok_s_32": round(32 * new_tokens / med["engine_dp_32"], 1),
                                "engine_vs_hf_32": round(med["hf_32"] / med["engine_dp_32"], 2),
                                "multi_turn_tok_s": round(multi / med["engine_dp_multi"], 1),
                                "multi_turn_vs_hf": round(med["hf_multi"] / med["engine_dp_multi"], 2)}
    fig["capture"] = _capture_overhead(hf, buffers, n_rows=32, prompt_len=prompt_len, steps=capture_steps)
    fig["prefix_cache"] = rollout.EngineClient(on).server_info()["prefix_cache"]
    fig["seconds"] = {k: [round(x, 2) for x in v] for k, v in t.items()}
    return fig


# --- R3: abs(delta log p) engine vs trainer with R3 off / on, capture overhead -------------------------------
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


def _generate_wave(engine, bodies):
    """POST every body while the engine is paused, then resume: they join the batch together (one prefill, then
    decode side by side), the same batch every time."""
    outs = [None] * len(bodies)

    def post(i):
        outs[i] = _post(engine.url + "/generate", bodies[i])

    engine.pause()
    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    while True:  # every request queued before they are admitted
        with engine.cv:
            if len(engine.queue) == len(bodies):
                break
        time.sleep(0.005)
    t0, c0 = time.perf_counter(), time.process_time()
    engine.resume()
    for t in threads:
        t.join()
    return outs, (time.perf_counter() - t0, time.process_time() - c0)  # (wall s, CPU s of this process)


def r3_measure(n_requests=8, new_tokens=24, repeats=8, seed=0) -> dict:
    """The R3 figures on one set of rollouts from the embedded engine (bf16-rounded weights, default)."""
    texts = [f"task {i}: list the files in /srv/data{i}, count lines of log{i}.txt, write the sum to out{i}"
             for i in range(64)]
    tok = model.train_tokenizer(texts, 400)
    work = tempfile.mkdtemp(prefix="r3_measure_")
    model.save_checkpoint(model.build_actor(model.tiny_config(len(tok)), seed), tok, work)
    prompts = [model.render_ids(tok, "user", texts[i * 7 % 64][: 20 + 9 * i]) + tok.encode(chat_tokens.ASSISTANT_PREFIX)
               for i in range(n_requests)]

    def bodies(capture):  # same requests and per-request seeds whether capture is on or off
        return [{"input_ids": p, "return_logprob": True, "return_routed_experts": capture,
                 "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True,
                                     "seed": seed + i}} for i, p in enumerate(prompts)]

    engine = EngineServer(work, max_batch=n_requests, weight_dtype="bf16").start()
    try:
        outs, _ = _generate_wave(engine, bodies(True))
        times = {True: [], False: []}  # capture -> [(wall s, CPU s)]
        for r in range(repeats):  # interleaved, order alternating, to cancel drift on a shared machine
            for capture in ((True, False) if r % 2 else (False, True)):
                times[capture].append(_generate_wave(engine, bodies(capture))[1])
        L, k = engine.num_layers, engine.top_k
    finally:
        engine.stop()

    # trainer: fp32 master weights, the same checkpoint, the exact sampled token ids
    trainer, _ = model.load_actor(work)
    trainer.eval()
    B, T = len(outs), max(len(p) + len(o["output_ids"]) for p, o in zip(prompts, outs))
    ids = torch.zeros(B, T, dtype=torch.long)  # (B, T) right-padded
    am, m, lp_rollout = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T), torch.zeros(B, T)
    experts = torch.full((B, T, L, k), -1, dtype=torch.int32)  # (B, T, L, k)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        n_in, n = len(p), len(p) + len(o["output_ids"])
        ids[b, :n] = torch.tensor(p + o["output_ids"])
        am[b, :n] = 1
        m[b, n_in:n] = 1  # loss on sampled tokens only
        lp_rollout[b, n_in:n] = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
        experts[b, :n - 1] = torch.from_numpy(r3.decode_routed_experts(o["meta_info"]["routed_experts"], L, k))
    r3.check_capture(experts[0, :int(am[0].sum())], m[0, :int(am[0].sum())])

    def dlogp(mode):
        with torch.no_grad(), r3.routing(trainer, mode, experts if mode == "replay" else None):
            logits = trainer(input_ids=ids, attention_mask=am).logits.float()  # (B, T, V)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        lp = F.pad(lp, (1, 0))  # lp[:, j] = log pi(tokens[j] | tokens[:j])
        return float(((lp - lp_rollout).abs() * m).sum() / m.sum())  # mask-weighted mean |delta log p|

    wall = {c: sum(x[0] for x in v) for c, v in times.items()}
    cpu = {c: sum(x[1] for x in v) for c, v in times.items()}  # CPU time: robust to other jobs on the machine
    return {"dlogp_off": dlogp("off"), "dlogp_on": dlogp("replay"),
            "expert_set_mismatch_off": r3.mismatch(trainer, ids, am, experts, m),
            "capture_overhead_ratio": cpu[True] / cpu[False], "capture_overhead_ratio_wall": wall[True] / wall[False],
            "bytes_per_position": L * k * 4, "bytes_per_position_paper": 48 * 8 * 4,
            "num_layers": L, "top_k": k, "n_requests": B, "sampled_tokens": int(m.sum()),
            "engine_weights": "bf16-rounded", "trainer_weights": "fp32",
            "wave_cpu_s_on": cpu[True] / repeats, "wave_cpu_s_off": cpu[False] / repeats, "repeats": repeats}


# --- TITO: naive retokenization vs TITO through the token gateway ---------------------------------------------
def tito_measure(quick=True, harness="client", work_dir=None, seed=0, ckpt=None) -> dict:
    """The same tasks through the gateway in naive and in TITO mode (+ the native token-first harness):
    boundary cases and loss-region drift of what a trainer would train on in each case. ckpt: the checkpoint
    that samples (experiments/paper.py passes the shared SFT model); None: a random-init tiny model on its own
    tokenizer."""
    work = work_dir or tempfile.mkdtemp(prefix="t1-measure-")
    n_tasks, max_turns, new_tokens = (3, 4, 48) if quick else (8, 10, 128)
    train, _ = data.generate_tasks(os.path.join(work, "tasks"), n_tasks, 0, seed=seed, validate_tasks=False)
    if ckpt is None:
        tok = model.train_tokenizer(data.corpus(train), vocab_size=1024)
        ckpt = os.path.join(work, "ckpt")
        model.save_checkpoint(model.build_actor(model.tiny_config(len(tok)), seed=seed), tok, ckpt)
    else:
        tok = model.load_config(ckpt)[1]
    eng = EngineServer(ckpt, port=0).start()
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": new_tokens}
    limits = {"max_turns": max_turns, "max_total_tokens": 8192, "trial_timeout_s": 300}
    out = {"harness": harness, "tasks": len(train), "ckpt": ckpt}
    try:
        for mode in ("naive", "tito"):
            gw = gateway.Gateway(eng.url, tok, mode, max_total_tokens=8192).start()
            trials = []
            for td in train:
                if harness == "harbor":
                    res = gateway.run_harbor_trial(td, gw, trials_dir=os.path.join(work, f"harbor-{mode}"),
                                                   sampling=sampling, limits=limits)
                else:
                    sid = uuid.uuid4().hex
                    res = gateway.run_text_trial(td, gw.url, sid, sampling=sampling, limits=limits, work_root=work)
                    res["records"] = gw.pop(sid)["records"]
                if res["records"]:
                    trials.append(res)
            gw.stop()
            cases = dict.fromkeys(tito.CASES, 0)
            for t in trials:
                for k, v in tito.case_counts(t, tok).items():
                    cases[k] += v
            repaired = tito.audit([s for t in trials for s in tito.assemble_segments(t, tok)])
            trained = tito.audit([tito.assemble_naive(t, tok) for t in trials]) if mode == "naive" else repaired
            out[mode] = {"trials": len(trials), "turns": sum(len(t["records"]) for t in trials), "cases": cases,
                         "loss_region_drift_pct": trained["loss_region_drift_pct"],
                         "repaired_drift_pct": repaired["loss_region_drift_pct"],
                         "harness_drift_pct": repaired["harness_drift_pct"]}
        native = [rollout.run_trial(td, "model", engine_url=eng.url, tokenizer=tok, sampling=sampling, limits=limits)
                  for td in train]
        native = [t for t in native if t["records"]]
        rep = tito.audit([tito.assemble(t) for t in native])
        out["native"] = {"trials": len(native), "turns": sum(len(t["records"]) for t in native),
                         "cases": rep["cases"], "loss_region_drift_pct": rep["loss_region_drift_pct"]}
    finally:
        eng.stop()
    return out


# --- CP Gated DeltaNet: forward / grad error against the single-rank reference, saved bytes per rank --------
def run_cp(kappa: int, shape: dict, chunk_size: int = 64):
    """Spawn kappa gloo ranks on 127.0.0.1; returns (out, grads [q, k, v, g, beta], saved bytes per rank),
    outputs and grads concatenated along the sequence."""
    res = infra.gloo_ranks(cp_gdn.cp_rank_share, kappa, shape, chunk_size)
    out = torch.cat([torch.from_numpy(r[0]) for r in res], dim=1)
    grads = [torch.cat([torch.from_numpy(r[1][i]) for r in res], dim=1) for i in range(5)]
    return out, grads, [r[2] for r in res]


def cp_bench(kappas=(1, 2, 4, 8), shape=None):
    shape = shape or dict(B=1, S=1024, nk=2, nv=4, dk=32, dv=32)
    ref_out, ref_grads, ref_bytes = cp_gdn.reference_gdn(shape)
    base = None
    print(f"shape {shape}; reference saved {ref_bytes / 2**20:.2f} MiB")
    print(f"{'kappa':>5} {'fwd max|diff|':>14} {'bitwise':>8} {'grad max|diff|':>15} {'grad rel':>9}"
          f" {'peak MiB/rank':>14} {'vs kappa=1':>10}")
    for kappa in kappas:
        out, grads, nbytes = run_cp(kappa, shape)
        peak = max(nbytes)
        base = base or peak
        gerr = max((a - b).abs().max().item() for a, b in zip(grads, ref_grads))
        grel = gerr / max(b.abs().max().item() for b in ref_grads)
        print(f"{kappa:>5} {(out - ref_out).abs().max().item():>14.3e} {str(torch.equal(out, ref_out)):>8}"
              f" {gerr:>15.3e} {grel:>9.2e} {peak / 2**20:>14.2f} {peak / base:>10.3f}")

# --- CLI ------------------------------------------------------------------------------------------------
# --- a run's report (train_t1.train prints it at the end): async vs sequential, the table, curves --------------
# --- the copy gate (issue 13): greedy copy accuracy of the embedded model over base-phase steps ---------
def copy_gate(arch: str, steps: int = 1000, every: int = 100, n_tasks: int = 60, seed: int = 0) -> list[dict]:
    """The base phase's loop (ppo.sft on data.copy_samples, ppo.BASE_LR and ppo.BASE_BATCH) on a fresh tiny model
    of `arch`; every `every` steps the copy accuracy on 64 held-back samples, the seconds and tokens/s."""
    with tempfile.TemporaryDirectory() as tmp:
        pool, _ = data.generate_tasks(os.path.join(tmp, "tasks"), n_tasks, 0, seed, validate_tasks=False)
        texts = data.corpus(pool)
        tok = model.train_tokenizer(texts)
        items = data.copy_items(texts)
        actor = model.build_actor(model.tiny_config(model.padded_vocab(len(tok), 1), arch), seed=seed)
        probe = data.copy_samples(tok, items, 64, -1)
        args = argparse.Namespace(seed=seed, reward_scale=1.0, max_grad_norm=1.0)
        rows, t0, n_tok = [], time.time(), 0
        for k in range(steps // every):
            chunk = data.copy_samples(tok, items, every * ppo.BASE_BATCH, seed * 1000 + k)
            n_tok += sum(len(s["tokens"]) for s in chunk)
            ppo.sft(actor, chunk, args, Metrics(Path(tmp)), phase="base", epochs=1, lr=ppo.BASE_LR,
                    batch_size=ppo.BASE_BATCH)
            dt = time.time() - t0
            rows.append(dict(arch=arch, step=(k + 1) * every, copy_accuracy=round(ppo.copy_accuracy(actor, probe), 4),
                             seconds=round(dt, 1), tokens_per_s=round(n_tok / dt)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- policy-gradient signal to noise (issue 13): how many trajectories an RL update needs at this scale --------
def snr_stats(G: torch.Tensor) -> dict:
    """Per-trajectory gradients G (N, P) -> rho = |mu|^2 / tr(Sigma), both estimated without bias (|gbar|^2 is
    |mu|^2 + tr(Sigma) / N), so that the mean of N trajectories has signal / noise = N * rho; and the cosine of two
    disjoint halves' mean gradients."""
    G = G.double()
    n = G.shape[0]
    if n < 4:
        raise ValueError(f"snr_stats: need >= 4 trajectories, got {n}")
    gbar = G.mean(0)
    tr = ((G - gbar) ** 2).sum(1).sum() / (n - 1)
    rho = float(((gbar ** 2).sum() - tr / n) / tr)
    h = n // 2
    cos = float(F.cosine_similarity(G[:h].mean(0), G[h:2 * h].mean(0), dim=0))
    return dict(n=n, rho=rho, trajectories_for_snr_1=(1 / rho if rho > 0 else math.inf), snr_at_32=32 * rho,
                snr_at_512=512 * rho, split_half_cos=cos)


def pg_snr(run_dir, ckpt: str = "sft", steps=(1, 2, 3), n: int = 96, seed: int = 0) -> dict:
    """The policy gradient of each of n trajectories of a run's samples (samples/step_*.jsonl, R3 replay of their
    recorded routing) at ckpt/<ckpt>: g_i = grad sum_t m_t log pi(a_t) * (r_i - b), b the mean reward of the same task
    family among the n (a plain baseline standing in for the critic); -> snr_stats. The paper's batch is 512."""
    run_dir = Path(run_dir)
    actor, _ = model.load_actor(run_dir / "ckpt" / ckpt)
    samples = [s for k in steps for s in tito.load_samples(run_dir / "samples" / f"step_{int(k):06d}.jsonl")]
    np.random.default_rng(seed).shuffle(samples)
    samples = samples[:n]
    scale = json.loads((run_dir / "args.json").read_text())["reward_scale"]  # the run's S
    family = [s["task"].rsplit("-", 1)[-1] for s in samples]
    base = {f: np.mean([s["reward"] for s, g in zip(samples, family) if g == f]) for f in set(family)}
    params = [p for p in actor.parameters() if p.requires_grad]
    G = []
    for s, f in zip(samples, family):
        batch = ppo.pad_batch([s], scale, replay=s.get("routed_experts") is not None)
        mode = "replay" if batch["experts"] is not None else "off"
        lp = ppo.forward_logprobs(actor, batch, mode, 1.0, grad=True)
        actor.zero_grad(set_to_none=True)
        ((lp * batch["mask"]).sum() * (s["reward"] - base[f])).backward()
        G.append(torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel()) for p in params]))
    return dict(run_dir=str(run_dir), ckpt=ckpt, steps=list(steps), baseline="family mean",
                **snr_stats(torch.stack(G)))


def async_vs_sequential(run_dir) -> dict:
    """Step time with the next rollout beside the update (async) vs rollout then update (sequential).

    Goal (issue): async step <= 1.15 x max(rollout, update), both measured in sequential steps of the run.
    """
    rl = [json.loads(l) for l in open(Path(run_dir) / "metrics.jsonl") if json.loads(l)["phase"] == "rl"]
    nxt = {r["step"] - 1: r for r in rl}
    seq = [r for r in rl if not r.get("rollout_beside_update") and not r.get("sampled_beside_update")
           and "time_train" in r]  # rollout, then update, nothing beside
    asy = [r for r in rl if r.get("rollout_beside_update") and r.get("sampled_beside_update") and r["step"] in nxt
           and "time_train" in r]  # steady state: own rollout ran beside the last update, the next beside this one
    out = {"n_sequential": len(seq), "n_async": len(asy)}
    if seq:
        out.update(sequential_step_s=float(np.mean([r["time_step"] for r in seq])),
                   sequential_rollout_s=float(np.mean([r["time_rollout"] for r in seq])),
                   sequential_train_s=float(np.mean([r["time_train"] for r in seq])))
    if asy:
        out.update(async_step_s=float(np.mean([r["time_step"] for r in asy])),
                   async_over_own_max=float(np.mean([r["time_step"]
                                                     / max(nxt[r["step"]]["time_rollout"], r["time_train"])
                                                     for r in asy])))
    if seq and asy:
        out["async_over_sequential_max"] = out["async_step_s"] / max(out["sequential_rollout_s"],
                                                                     out["sequential_train_s"])
    return out


def trainer_bench(args, shape: str = "t1-tiny", tokens: int = 256, n_samples: int = 4, steps: int = 2,
                  seed: int = 0) -> dict:
    """The trainer's Megatron path on this node, in one process (world size 1): an HF Qwen3.5-MoE checkpoint of
    `shape` with random weights (rounded to bf16, so both sides hold the same values), written and read back the
    way --model-path is (mcore.trainer_models: on CUDA the cluster model, TE and DeepEP where they import, Megatron's
    distributed optimizer; on the CPU local modules and ShardedAdam), then `steps` real ppo.Trainer.train_step calls
    (critic update, old logprobs with R3 replay, PPO epochs, checkpoint) on n_samples trajectories of `tokens` tokens
    sampled nowhere but recorded by the HF model in fp32 (its routing replayed, its logprobs the rollout's: dlogp is
    the HF-vs-Megatron mismatch of the same weights). -> the node's facts, seconds and trajectory tokens/s per step,
    dlogp with R3 on and off, and on CUDA the peak allocated bytes against infra.device_memory's prediction for the
    co-located actor (+ behaviour copy) and critic. `args`: train_t1's Args (its preset's lrs, clips, --param-dtype).
    Shapes: infra.MODEL_SHAPES' t1-tiny, cluster.probe_config(), and "122b-slice": 4 layers (3 GDN + 1 attention) of
    the 122B's widths with 16 of its 256 experts (the whole model's trainer state does not fit one GPU)."""
    import dataclasses
    import importlib.util
    shapes = {"t1-tiny": infra.MODEL_SHAPES["t1-tiny"], "probe": launch.probe_config(),
              "122b-slice": dataclasses.replace(infra.MODEL_SHAPES["qwen35-122b-a10b"], name="122b-slice",
                                                n_layers=4, n_gdn=3, n_attn=1, n_experts=16)}
    if shape not in shapes:
        raise ValueError(f"--shape: expected one of {'|'.join(shapes)}, got {shape!r}")
    c, cuda = shapes[shape], torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="t1-trainer-bench-"))
    t_start = time.time()

    def phase(what):  # progress on stderr: a run cut off by a time limit still says where its time went
        print(f"[trainer-bench {shape}] {time.time() - t_start:.1f} s: {what}", file=sys.stderr, flush=True)
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5MoeForCausalLM(launch.hf_config(c)).to(torch.bfloat16)
    phase(f"HF model built ({sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M parameters)")
    tok = model.train_tokenizer(["ls -la /app\n", "cat notes.txt | wc -l\n"] * 20, vocab_size=300)
    model.save_checkpoint(hf, tok, work / "sft")  # bf16 on disk, as the cluster's checkpoints
    phase("HF checkpoint written")
    hf = r3.install(hf.float())
    g, samples = torch.Generator().manual_seed(seed), []
    for i in range(n_samples):
        ids = torch.randint(3, c.vocab, (tokens,), generator=g)
        mask = np.zeros(tokens, dtype=np.int8)
        mask[tokens // 4:] = 1  # a prompt, then the model's reply
        with torch.no_grad(), r3.routing(hf, "record") as rec:
            logits = hf(input_ids=ids[None]).logits.float()  # (1, T, V)
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]  # (T-1,) log p(token t | < t)
        samples.append({"tokens": ids.numpy(), "loss_mask": mask, "routed_experts": rec.experts[0, :tokens - 1].numpy(),
                        "rollout_logprobs": (np.concatenate([[0.0], lp.double().numpy()]) * mask),
                        "reward": (i % 4) / 20, "passed": i % 4, "total": 4, "reward_source": "ctrf",
                        "weight_version": 0, "turns": 1})
    del hf
    phase(f"{n_samples} samples recorded by the HF model")
    a = dataclasses.replace(args, backend="megatron", run_dir=str(work / "run"), minibatch_size=1, plan="",
                            trainer_ranks=1, kl_coef=0.0, entropy_coef=0.0, aux_loss_coef=0.0, reward_scale=20.0)
    (work / "run" / "ckpt").mkdir(parents=True)
    t0 = time.time()
    tr = ppo.Trainer(a, str(work / "sft"), 0)
    built = time.time() - t0
    phase("trainer built")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tr.mark_published(0)
    rows = []
    for k in range(steps):
        t0 = time.time()
        st = tr.train_step(samples, k + 1)
        if cuda:
            torch.cuda.synchronize()
        dt = time.time() - t0
        phase(f"train step {k + 1}: {dt:.1f} s")
        rows.append({"step": k + 1, "seconds": round(dt, 2), "tokens_per_s": round(n_samples * tokens / dt, 1),
                     **{key: st.get(key) for key in ("dlogp", "dlogp_r3_off", "approx_kl", "clipfrac", "value_loss")}})
    gpt = tr.actor.gpt
    out = {"shape": shape, "params": sum(p.numel() for p in gpt.parameters()),
           "device": str(gpt.embedding.word_embeddings.weight.device), "param_dtype": str(gpt.config.params_dtype),
           "transformer_impl": gpt.config.transformer_impl,
           "dispatcher": gpt.config.moe_token_dispatcher_type, "fla": importlib.util.find_spec("fla") is not None,
           "optimizer": type(tr.actor_opt).__name__, "build_s": round(built, 1), "tokens": tokens,
           "samples": n_samples, "steps": rows}
    if cuda:
        plan = infra.Plan(1, 1, 1, 1, 1, 1, recompute=False)
        act, cri = (infra.device_memory(c, plan, tokens, net, overhead_gib=0.0) for net in ("actor", "critic"))
        static = ("params", "behaviour", "grads", "optimizer", "expert_optimizer")
        pred = sum(act[k] + cri[k] for k in static) + max(act["activations"], cri["activations"])
        out.update(peak_bytes=torch.cuda.max_memory_allocated(), predicted_bytes=pred,
                   peak_over_predicted=round(torch.cuda.max_memory_allocated() / pred, 3))
    tr.close()
    return out


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson interval of a proportion k / n."""
    if n == 0:
        return float("nan"), float("nan")
    p, d = k / n, 1 + z * z / n
    c, h = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def mean_interval(xs: list, z: float = 1.96) -> tuple[float, float]:
    """95% normal interval of a mean (the standard error of xs)."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan")
    m = sum(xs) / n
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)
    return m - z * se, m + z * se


def mcnemar_p(gain: int, loss: int) -> float:
    """Exact two-sided McNemar p over the discordant pairs: 2 P(X <= min(gain, loss)), X ~ Bin(gain + loss, 1/2)."""
    m = gain + loss
    return min(1.0, 2 * sum(math.comb(m, i) for i in range(min(gain, loss) + 1)) / 2 ** m) if m else 1.0


def paired(a: dict, b: dict, n_boot: int = 2000, seed: int = 0) -> dict:
    """b against a over the same (task, attempt) trials: exact two-sided McNemar p on the solved / unsolved flips
    (over trials: exact with one attempt per task), and the paired bootstrap over tasks of the mean-reward
    difference: its 95% interval and one-sided p of b <= a. a, b: evaluations (gateway.evaluate_trials)."""
    ka = {(t["task"], t["attempt"]): t for t in a["trials"]}
    kb = {(t["task"], t["attempt"]): t for t in b["trials"]}
    if set(ka) != set(kb):
        raise ValueError(f"paired: the two evaluations cover different trials ({len(ka)} vs {len(kb)})")
    keys = sorted(ka)
    gain = sum(kb[k]["resolved"] and not ka[k]["resolved"] for k in keys)
    loss = sum(ka[k]["resolved"] and not kb[k]["resolved"] for k in keys)
    p = mcnemar_p(gain, loss)
    d = [kb[k]["reward"] - ka[k]["reward"] for k in keys]
    per_task = {}  # the bootstrap resamples tasks (their attempts together: attempts of one task are not independent)
    for k, x in zip(keys, d):
        per_task.setdefault(k[0], []).append(x)
    groups = [np.array(v) for v in per_task.values()]
    rng, boots = np.random.default_rng(seed), []
    for _ in range(n_boot):
        pick = [groups[i] for i in rng.integers(0, len(groups), len(groups))]
        boots.append(float(np.concatenate(pick).mean()))
    boots.sort()
    return {"n": len(keys), "solved_gained": gain, "solved_lost": loss, "mcnemar_p": p,
            "reward_diff": sum(d) / len(d) if d else 0.0,
            "reward_diff_ci": (boots[int(0.025 * n_boot)], boots[int(0.975 * n_boot) - 1]),
            "reward_p_le": sum(x <= 0 for x in boots) / n_boot}


def compare(path_a: str, path_b: str) -> dict:
    """`experiments/bench.py compare A B`: two held-out evaluations of one run or two (evals/step_NNNNNN.json,
    train_t1.eval_row)
    over the same tasks: each one's solve rate with its 95% interval and tasks solved per family (the task name's
    last part), then the paired tests of B against A (paired). ValueError naming the file when one is not an
    evaluation, or evaluated nothing (no trials, or every trial errored / was cancelled: gateway.trial_failed)."""
    evs, rows = [], {}
    for key, path in (("a", path_a), ("b", path_b)):
        try:
            ev = json.loads(Path(path).read_text())
            fams = {}
            for t in ev["trials"]:
                fams.setdefault(t["task"].rsplit("-", 1)[-1], []).append(bool(t["resolved"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"compare: {path} is not an evaluation with per-trial rows (evals/step_*.json): "
                             f"{type(e).__name__}: {e}") from None
        k, n = sum(sum(v) for v in fams.values()), len(ev["trials"])
        failed = sum(gateway.trial_failed(t) for t in ev["trials"] if "exit_reason" in t)
        if n == 0 or failed == n:  # nothing was evaluated: a solve rate of 0 here would be a silent zero
            raise ValueError(f"compare: {path} evaluated nothing: " + (
                "it has no trials" if n == 0 else
                f"all {n} trials failed before a verdict (first: {ev['trials'][0].get('error')!r})"))
        rows[key] = {"path": path, "solve_rate": round(k / max(1, n), 4), "ci": [round(x, 4) for x in wilson(k, n)],
                     "n": n, "per_family": {f: sum(v) for f, v in sorted(fams.items())}}
        evs.append(ev)
    t = paired(*evs)
    t["reward_diff_ci"] = [round(x, 4) for x in t["reward_diff_ci"]]
    return {**rows, **{k: round(v, 4) if isinstance(v, float) else v for k, v in t.items()}}


def best_val(run_dir) -> dict | None:
    """The RL step chosen on the validation set (--n-val-tasks): of the steps > 0 with both evaluations on disk
    (evals/val_step_N.json and evals/step_N.json), the one with the highest validation solve rate, then mean
    reward, then the earlier step; -> that step's held-out evaluation with step, val_solve_rate, val_reward_mean
    and val_n added, or None (no validation set). Chosen on validation alone: the held-out figures are not read."""
    evals, best = Path(run_dir) / "evals", None
    for f in sorted(evals.glob("val_step_*.json")) if evals.is_dir() else []:
        step = int(f.stem[len("val_step_"):])
        if step == 0 or not (evals / f"step_{step:06d}.json").exists():
            continue
        try:
            v = json.loads(f.read_text())
            key = (float(v["solve_rate"]), float(v["reward_mean"]), -step)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"best_val: {f} is not a validation evaluation (train_t1.eval_row): "
                             f"{type(e).__name__}: {e}") from None
        if best is None or key > best[0]:
            best = (key, step, v)
    if best is None:
        return None
    _, step, v = best
    held = json.loads((evals / f"step_{step:06d}.json").read_text())
    return {**held, "step": step, "val_solve_rate": v["solve_rate"], "val_reward_mean": v["reward_mean"],
            "val_n": v["n_trials"]}


def print_table(summary: dict) -> None:
    """The end-of-run table: held-out (and first training tasks) solve rate and mean reward of each checkpoint with
    95% intervals and n (with a validation set, also the RL step it chose: RL@val), then the paired tests RL vs
    SFT (and RL@val vs SFT, SFT vs base), then the phase times."""
    print("\n| pool | checkpoint | solve rate [95% CI] | mean reward P/S [95% CI] | mean turns | n |\n"
          "|---|---|---|---|---|---|")
    for pool, key in (("held-out", "eval_{}"), ("train (first tasks)", "eval_{}_train")):
        for ck in ("base", "sft", "rl", "rl_best_val"):
            e = summary.get(key.format(ck))
            if not e or not e.get("n_trials"):
                continue
            name = f"RL@val (step {e['step']}, val {e['val_solve_rate']:.3f})" if ck == "rl_best_val" else ck.upper()
            if "trials" not in e:  # recorded by a version that kept no per-trial rows: no intervals to give
                print(f"| {pool} | {name} | {e['solve_rate']:.3f} [n/a] | {e['reward_mean']:.3f} [n/a] | "
                      f"{e['turns_mean']:.1f} | {e['n_trials']} |")
                continue
            lo, hi = wilson(sum(t["resolved"] for t in e["trials"]), e["n_trials"])
            rlo, rhi = mean_interval([t["reward"] for t in e["trials"]])
            print(f"| {pool} | {name} | {e['solve_rate']:.3f} [{lo:.3f}, {hi:.3f}] | {e['reward_mean']:.3f} "
                  f"[{rlo:.3f}, {rhi:.3f}] | {e['turns_mean']:.1f} | {e['n_trials']} |")
    for a, b in (("sft", "rl"), ("sft", "rl_best_val"), ("base", "sft")):
        ea, eb = summary.get(f"eval_{a}"), summary.get(f"eval_{b}")
        if ea and eb and ea.get("trials") and eb.get("trials"):
            t = paired(ea, eb)
            name = f"RL@val (step {eb['step']})" if b == "rl_best_val" else b.upper()
            print(f"held-out {name} vs {a.upper()} (paired, n {t['n']}): solved +{t['solved_gained']} "
                  f"-{t['solved_lost']}, McNemar p = {t['mcnemar_p']:.3g}; mean reward {t['reward_diff']:+.3f} "
                  f"[{t['reward_diff_ci'][0]:+.3f}, {t['reward_diff_ci'][1]:+.3f}], bootstrap p(<= 0) = "
                  f"{t['reward_p_le']:.3g}")
    print("\n| phase | wall time (s) |\n|---|---|")
    for k, v in summary["phase_times"].items():
        print(f"| {k} | {v:.0f} |")


def plot(run_dir) -> Path:
    """PNG curves of a run: reward and solve rate (training rollouts; held-out evaluations), EV (warm-up and RL),
    |dlogp|, turns, step times, SFT loss."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = Path(run_dir)
    recs = [json.loads(l) for l in open(run_dir / "metrics.jsonl")] if (run_dir / "metrics.jsonl").exists() else []
    rl = [r for r in recs if r["phase"] == "rl"]
    panels = [("reward_mean", "reward (P/S)"), ("solve_rate", "solve rate"),
              ("explained_variance", "explained variance"), ("dlogp", "|dlogp| (R3 on)"), ("turns_mean", "turns"),
              ("time_step", "step time (s)")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    axes = axes.ravel()
    held = [r for r in recs if r["phase"] == "eval"]  # held-out evaluations (step 0: SFT; --eval-every, the last)
    for ax, (k, title) in zip(axes, panels):
        ax.plot([r["step"] for r in rl], [r.get(k) for r in rl], marker="o", label="training rollouts")
        if k in ("reward_mean", "solve_rate") and held:
            ax.plot([r["step"] for r in held], [r[f"heldout_{k}"] for r in held], marker="s", label="held-out")
            val = [r for r in held if f"val_{k}" in r]  # --n-val-tasks
            if val:
                ax.plot([r["step"] for r in val], [r[f"val_{k}"] for r in val], marker="^", label="validation")
            ax.legend()
        if k == "dlogp":
            ax.plot([r["step"] for r in rl], [r.get("dlogp_r3_off") for r in rl], marker="x", label="R3 off")
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("RL step")
    warm = [r for r in recs if r["phase"] == "critic_warmup"]
    axes[6].plot([r["step"] for r in warm], [r["explained_variance"] for r in warm], marker=".")
    axes[6].set_title("critic warm-up EV")
    sft_recs = [r for r in recs if r["phase"] == "sft"]
    axes[7].plot([r["step"] for r in sft_recs], [r["sft_loss"] for r in sft_recs])
    axes[7].set_title("SFT loss")
    fig.tight_layout()
    out = run_dir / "curves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="engine vs HF generate, multi-turn prefix cache, capture (one JSON line)")
    e.add_argument("--arch", choices=list(model.ARCHS), default="qwen3_moe")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--quick", action="store_true", help="small sizes (the test's form; figures not meaningful)")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--dp", type=int, default=2, help="also the same threads as this many engines (0: not measured)")
    sm = sub.add_parser("sampling", help="one decode step's sampling, row by row vs batched (one JSON line)")
    sm.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("r3", help="engine vs trainer logprobs with replay off / on (one JSON line)")
    s.add_argument("--quick", action="store_true", help="8 requests x 24 tokens (under a minute on 2 cores)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=2)
    m = sub.add_parser("tito", help="naive retokenization vs TITO through the token gateway (one JSON line)")
    m.add_argument("--quick", action="store_true", help="a few tasks and turns (minutes on 2 CPU cores)")
    m.add_argument("--harness", choices=["client", "harbor"], default="client",
                   help="client: a text client that re-renders the history like Terminus-2; harbor: Harbor's own")
    m.add_argument("--work-dir", default=None)
    m.add_argument("--ckpt", default=None, help="the checkpoint that samples (default: a random-init tiny model)")
    cb = sub.add_parser("cp", help="CP Gated DeltaNet: exactness and activation peak vs kappa")
    cb.add_argument("--kappas", type=int, nargs="+", default=[1, 2, 4, 8])
    cb.add_argument("--seq-len", type=int, default=1024)
    cg = sub.add_parser("copy", help="the copy gate: greedy copy accuracy vs base-phase steps (JSON lines)")
    cg.add_argument("--arch", nargs="+", default=["qwen3_moe"], choices=list(model.ARCHS))
    cg.add_argument("--steps", type=int, default=1000)
    cg.add_argument("--threads", type=int, default=2)
    cg.add_argument("--seed", type=int, default=0, help="tasks, tokenizer, init and data order (seed spread)")
    sn = sub.add_parser("pg-snr", help="a run's per-trajectory policy-gradient signal / noise (one JSON line)")
    sn.add_argument("run_dir")
    sn.add_argument("--ckpt", default="sft", help="ckpt/<name> whose gradient is measured (sft, latest)")
    sn.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3], help="RL steps whose samples are used")
    sn.add_argument("--n", type=int, default=96, help="trajectories")
    sn.add_argument("--threads", type=int, default=2)
    pl = sub.add_parser("plot", help="PNG curves of a run directory (reward, solve rate, EV, |dlogp|, ...)")
    pl.add_argument("run_dir")
    cm = sub.add_parser("compare", help="two held-out evaluations (RUN/evals/step_N.json), paired (one JSON line)")
    cm.add_argument("a")
    cm.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "engine":
        torch.set_num_threads(args.threads)
        kw = dict(repeats=1, prompt_len=60, new_tokens=8, turns=2, turn_tokens=4, n_agents=2, capture_steps=4) \
            if args.quick else dict(repeats=args.repeats)
        print(json.dumps(engine_bench(args.arch, dp=args.dp, **kw)))
    elif args.cmd == "sampling":
        torch.set_num_threads(args.threads)
        print(json.dumps(sampling_bench()))
    elif args.cmd == "r3":
        torch.set_num_threads(args.threads)
        kw = (dict(n_requests=8, new_tokens=24, repeats=8) if args.quick
              else dict(n_requests=16, new_tokens=96, repeats=6))
        print(json.dumps(r3_measure(seed=args.seed, **kw)))
    elif args.cmd == "tito":
        print(json.dumps(tito_measure(quick=args.quick, harness=args.harness, work_dir=args.work_dir, ckpt=args.ckpt)))
    elif args.cmd == "plot":
        print(plot(args.run_dir))
    elif args.cmd == "compare":
        try:
            print(json.dumps(compare(args.a, args.b)))
        except ValueError as e:  # a named reason and a non-zero exit, not a traceback or a silent zero
            sys.exit(f"experiments/bench.py {e}")
    elif args.cmd == "pg-snr":
        torch.set_num_threads(args.threads)
        print(json.dumps(pg_snr(args.run_dir, args.ckpt, args.steps, args.n)))
    elif args.cmd == "copy":
        torch.set_num_threads(args.threads)
        for arch in args.arch:
            copy_gate(arch, args.steps, seed=args.seed)
    else:
        cp_bench(args.kappas, dict(B=1, S=args.seq_len, nk=2, nv=4, dk=32, dv=32))


if __name__ == "__main__":
    main()
