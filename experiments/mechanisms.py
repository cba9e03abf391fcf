"""The mechanism figures: R3's routing replay (|delta log p| engine vs trainer, replay off / on, the cost of
capture), TITO against naive re-tokenisation through the token gateway, and context-parallel Gated DeltaNet
(exactness and activation peak per rank against kappa).

    python -m experiments.bench r3 --quick                               # one JSON line: r3_measure
    python -m experiments.bench tito --quick [--harness client|harbor]   # one JSON line: tito_measure
    python -m experiments.bench cp [--kappas 1 2 4 8] [--seq-len 1024]   # a table: cp_bench
"""
import os
import tempfile
import threading
import time
import uuid

import torch
import torch.nn.functional as F

import chat_tokens
import data
import model
import r3
import rollout
import tito
from cluster import cp_gdn
from engine import gateway
from engine.server import EngineServer
from experiments import ranks
from experiments.engine_speed import post_json
from sandbox.harbor_run import run_harbor_trial


# --- R3: abs(delta log p) engine vs trainer with R3 off / on, capture overhead -------------------------------
def _generate_wave(engine, bodies):
    """POST every body while the engine is paused, then resume: they join the batch together (one prefill, then
    decode side by side), the same batch every time."""
    outs = [None] * len(bodies)

    def post(i):
        outs[i] = post_json(engine.url + "/generate", bodies[i])

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
                    res = run_harbor_trial(td, gw, trials_dir=os.path.join(work, f"harbor-{mode}"),
                                                   sampling=sampling, limits=limits)
                else:
                    sid = uuid.uuid4().hex
                    res = rollout.run_text_trial(td, gw.url, sid, sampling=sampling, limits=limits, work_root=work)
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
    res = ranks.gloo_ranks(cp_gdn.cp_rank_share, kappa, shape, chunk_size)
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
