"""The training side measured: the trainer's Megatron path on this node (step time, dlogp with R3 on / off, peak
memory against the memory model), the copy gate of the base phase, and the policy gradient's signal to noise.

    python -m experiments.bench trainer [--shape t1-tiny|probe|122b-slice] [train_t1 flags]  # one JSON line
    python -m experiments.bench copy [--arch qwen3_moe qwen3_5_moe] [--steps 1000] [--seed 0] [--share 0.5]  # JSON
                                                                                # lines
    python -m experiments.bench pg-snr runs/x [--ckpt sft] [--steps 1 2 3] [--n 96]            # one JSON line

trainer_bench takes train_t1's Args (its preset's learning rates, clips, --param-dtype): experiments/bench.py
parses them with train_t1's own parser, so this module does not import the entry point.
"""
import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import critic as C
import data
import infra
import model
import ppo
import r3
import tito
import trainer
from cluster import gpu_check
from rundir import Metrics
from tasks import copying, splits


# --- the copy gate: greedy copy accuracy of the embedded model over base-phase steps -----------------------------
def copy_gate(arch: str, steps: int = 1000, every: int = 100, n_tasks: int = 60, seed: int = 0,
              share: float = copying.NAME_SHARE, n_names: int = copying.N_NAMES, n_unseen: int = 30,
              tokenizer_names: int = 0) -> list[dict]:
    """The base phase's loop (ppo.sft on data.copy_samples, ppo.BASE_LR and ppo.BASE_BATCH) on a fresh tiny model
    of `arch`, a share `share` of the copied items random names (tasks/copying.py: n_names of them; 0: the corpus's
    pieces alone). First a row of the tokenizer's pieces per character on the pool's names, on the names of n_unseen
    tasks of the unseen vocabulary (families.UNSEEN, never trained on) and on the random probe names; then every
    `every` steps the greedy copy accuracy on 64 held-back samples of each: the corpus's pieces (copy_accuracy, the
    base phase's gate), random names never trained on (copy_accuracy_names) and the unseen-vocabulary task names
    (copy_accuracy_unseen), with the seconds and tokens/s. tokenizer_names: that many other random names join the
    tokenizer's training texts (0: the corpus alone, as train_t1's)."""
    with tempfile.TemporaryDirectory() as tmp:
        pool, _ = data.generate_tasks(os.path.join(tmp, "tasks"), n_tasks, 0, seed, validate_tasks=False)
        _, unseen = data.generate_tasks(os.path.join(tmp, "unseen"), 0, n_unseen, seed, validate_tasks=False,
                                        vocab="unseen")
        texts = data.corpus(pool)
        items = data.copy_items(texts)
        extra = copying.random_names(tokenizer_names, f"tokenizer/{seed}", avoid=items)
        tok = model.train_tokenizer(texts + extra)
        names = copying.random_names(n_names, seed, avoid=items) if share else []
        fresh = copying.random_names(512, f"probe/{seed}", avoid=set(items) | set(names) | set(extra))
        seen = sorted({n for d in pool for n in splits.names_of(d)})
        new = sorted({n for d in unseen for n in splits.names_of(d)} - set(items))
        probes = {"copy_accuracy": data.copy_samples(tok, items, 64, -1),
                  "copy_accuracy_names": data.copy_samples(tok, fresh, 64, -1),
                  "copy_accuracy_unseen": data.copy_samples(tok, new, 64, -1)}

        def per_char(xs):
            return round(sum(len(tok.encode(x, add_special_tokens=False)) for x in xs) / sum(map(len, xs)), 3)
        ppc = dict(train_names=per_char(seen), unseen_names=per_char(new), random_names=per_char(fresh))
        print(json.dumps(dict(arch=arch, share=share, items=len(items), names=len(names), tokenizer_names=len(extra),
                              pieces_per_char=ppc, n_train_names=len(seen), n_unseen_names=len(new))), flush=True)
        actor = model.build_actor(model.tiny_config(model.padded_vocab(len(tok), 1), arch), seed=seed)
        args = argparse.Namespace(seed=seed, reward_scale=1.0, max_grad_norm=1.0)
        rows, t0, n_tok = [], time.time(), 0
        for k in range(steps // every):
            chunk = data.copy_samples(tok, items, every * ppo.BASE_BATCH, seed * 1000 + k, names=names, share=share)
            n_tok += sum(len(s["tokens"]) for s in chunk)
            ppo.sft(actor, chunk, args, Metrics(Path(tmp)), phase="base", epochs=1, lr=ppo.BASE_LR,
                    batch_size=ppo.BASE_BATCH)
            dt = time.time() - t0
            rows.append(dict(arch=arch, share=share, step=(k + 1) * every,
                             **{key: round(ppo.copy_accuracy(actor, p), 4) for key, p in probes.items()},
                             seconds=round(dt, 1), tokens_per_s=round(n_tok / dt)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# --- policy-gradient signal to noise: how many trajectories an RL update needs at this scale -------------------
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



# --- the trainer's Megatron path on this node: step time, dlogp, peak memory vs the memory model ----------------
def trainer_bench(args, shape: str = "t1-tiny", tokens: int = 256, n_samples: int = 4, steps: int = 2,
                  seed: int = 0) -> dict:
    """The trainer's Megatron path on this node, in one process (world size 1): an HF Qwen3.5-MoE checkpoint of
    `shape` with random weights (rounded to bf16, so both sides hold the same values), written and read back the
    way --model-path is (mcore.trainer_models: on CUDA the cluster model, TE and DeepEP where they import, Megatron's
    distributed optimizer; on the CPU local modules and ShardedAdam), then `steps` real trainer.Trainer.train_step calls
    (critic update, old logprobs with R3 replay, PPO epochs, checkpoint) on n_samples trajectories of `tokens` tokens
    sampled nowhere but recorded by the HF model in fp32 (its routing replayed, its logprobs the rollout's: dlogp is
    the HF-vs-Megatron mismatch of the same weights). -> the node's facts, seconds and trajectory tokens/s per step,
    dlogp with R3 on and off, and on CUDA the peak allocated bytes against infra.device_memory's prediction for the
    co-located actor (+ behaviour copy) and critic. `args`: train_t1's Args (its preset's lrs, clips, --param-dtype).
    Shapes: infra.MODEL_SHAPES' t1-tiny, cluster.gpu_check.probe_config(), and "122b-slice": 4 layers (3 GDN + 1
    attention) of the 122B's widths with 16 of its 256 experts (the whole model's trainer state does not fit one
    GPU)."""
    shapes = {"t1-tiny": infra.MODEL_SHAPES["t1-tiny"], "probe": gpu_check.probe_config(),
              "122b-slice": dataclasses.replace(infra.MODEL_SHAPES["qwen35-122b-a10b"], name="122b-slice",
                                                n_layers=4, n_gdn=3, n_attn=1, n_experts=16)}
    if shape not in shapes:
        raise ValueError(f"--shape: expected one of {'|'.join(shapes)}, got {shape!r}")
    c, cuda = shapes[shape], torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="t1-trainer-bench-") as tmp:  # removed with what it holds
        work = Path(tmp)
        t_start = time.time()

        def phase(what):  # progress on stderr: a run cut off by a time limit still says where its time went
            print(f"[bench trainer {shape}] {time.time() - t_start:.1f} s: {what}", file=sys.stderr, flush=True)
        torch.manual_seed(seed)
        hf = transformers.Qwen3_5MoeForCausalLM(gpu_check.hf_config(c)).to(torch.bfloat16)
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
            samples.append({"tokens": ids.numpy(), "loss_mask": mask,
                            "routed_experts": rec.experts[0, :tokens - 1].numpy(),
                            "rollout_logprobs": (np.concatenate([[0.0], lp.double().numpy()]) * mask),
                            "reward": (i % 4) / 20, "passed": i % 4, "total": 4, "reward_source": "ctrf",
                            "weight_version": 0, "turns": 1})
        del hf
        phase(f"{n_samples} samples recorded by the HF model")
        a = dataclasses.replace(args, backend="megatron", run_dir=str(work / "run"), minibatch_size=1, plan="",
                                trainer_ranks=1, kl_coef=0.0, entropy_coef=0.0, aux_loss_coef=0.0, reward_scale=20.0)
        (work / "run" / "ckpt").mkdir(parents=True)
        t0 = time.time()
        tr = trainer.Trainer(a, str(work / "sft"), 0)
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
                         **{key: st.get(key) for key in ("dlogp", "dlogp_r3_off", "approx_kl", "clipfrac",
                                                         "value_loss")}})
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



# --- the PPO update against the model's own speed on the same rows without padding ------------------------------
def update_samples(n: int, mean_len: int, sd_len: int, arch: str, seed: int = 0):
    """(an HF actor of the embedded size, n recorded trajectories): lengths drawn from N(mean_len, sd_len) (the --full
    preset's RL steps: 32 kept trajectories of ~730-780 tokens, 20-23% of a minibatch of 8 padding), a prompt of a
    quarter of the tokens, then replies (m = 1) and tool outputs (m = 0) in turns; tokens random, their routing and
    logprobs recorded by the actor itself (R3 replay has something to replay)."""
    actor = model.build_actor(model.tiny_config(2048, arch), seed=seed)
    g, rs = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    out = []
    for i, T in enumerate(np.clip(rs.normal(mean_len, sd_len, n).round().astype(int), 16, 3072)):
        ids = torch.randint(3, 2048, (int(T),), generator=g)
        mask = np.zeros(T, dtype=np.int8)
        for j in range(T // 4, T, 100):  # turns: 40 tokens of reply, 60 of tool output; the last token a reply's
            mask[j:j + 40] = 1
        mask[-1] = 1
        with torch.no_grad(), r3.routing(actor, "record") as rec:
            logits = actor(input_ids=ids[None]).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
        out.append({"tokens": ids.numpy(), "loss_mask": mask, "routed_experts": rec.experts[0, :T - 1].numpy(),
                    "rollout_logprobs": np.concatenate([[0.0], lp.double().numpy()]) * mask, "task": f"t{i}",
                    "reward": (i % 7) / 6, "passed": i % 7, "total": 6, "weight_version": 0})
    return actor, out


def unpadded_passes(actor, behaviour, critic, ref, samples, args, diagnose: bool = True) -> None:
    """The passes of ppo.train_step, each row alone (B = 1, no padding, no attention mask): V_old, old logprobs
    (R3 replay), the R3-off logprobs (diagnose), the KL reference's (kl_coef > 0), the critic's fwd + bwd, ppo_epochs
    of the actor's fwd + bwd; no loss beyond a sum, no optimizer step (gradients dropped): the model's own speed."""
    rows = [ppo.pad_batch([s], args.reward_scale, True) for s in samples]
    for b in rows:
        with torch.no_grad():
            C.compute_values(critic, b["input_ids"], b["attention_mask"])
            ppo.forward_logprobs(behaviour, b, "replay", args.temperature)
            if diagnose:
                with r3.routing(behaviour, "record"):
                    ppo.token_logprobs(behaviour, b, args.temperature)
            if args.kl_coef > 0:
                ppo.forward_logprobs(ref, b, "replay", args.temperature)
    critic.train()
    for b in rows:
        critic(b["input_ids"], b["attention_mask"]).sum().backward()
    actor.train()
    for _ in range(args.ppo_epochs):
        for b in rows:
            with ppo.batch_routing(actor, b, "replay"):
                ppo.token_logprobs(actor, b, args.temperature).sum().backward()
    actor.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)


def update_bench(args, n: int = 32, mean_len: int = 776, sd_len: int = 150, repeats: int = 3, seed: int = 0) -> dict:
    """ppo.train_step (row by row: critic.pieces) and the padded update before it (padded=True) against the same
    passes on unpadded rows (unpadded_passes), interleaved in this process, on n trajectories of update_samples.
    `args`: train_t1's Args (the --full preset: minibatches of 8, 2 PPO epochs, KL to SFT, R3 replay).
    -> wall and CPU seconds (this process's, time.process_time: on a shared machine with one torch thread the work
    done, not the waiting) of each per repeat, trajectory tokens per CPU second (median), ratio = unpadded /
    train_step CPU time (1: the update at the model's own speed; ratio_wall the same on wall time), the padded
    update's, and the minibatches' padding fraction."""
    args = dataclasses.replace(args, r3_mode="replay", advantage="gae", backend="hf")
    actor, samples = update_samples(n, mean_len, sd_len, args.arch, seed)
    critic = C.Critic.from_actor(actor)
    behaviour, ref = copy.deepcopy(actor), copy.deepcopy(actor).eval().requires_grad_(False)
    a0, c0 = copy.deepcopy(actor.state_dict()), copy.deepcopy(critic.state_dict())
    tokens = sum(len(s["tokens"]) for s in samples)
    with tempfile.TemporaryDirectory(prefix="t1-update-bench-") as tmp:  # removed with what it holds
        work = Path(tmp)

        def step(padded):
            actor.load_state_dict(a0)
            critic.load_state_dict(c0)
            aopt = torch.optim.Adam(actor.parameters(), lr=args.actor_lr)
            copt = torch.optim.Adam(critic.parameters(), lr=args.critic_lr)
            ppo.train_step(actor, behaviour, critic, aopt, copt, samples, args, random.Random(seed), work, 1, None,
                           ref if args.kl_coef > 0 else None, padded=padded)
        runs = {"train_step": lambda: step(False), "padded": lambda: step(True),
                "unpadded": lambda: unpadded_passes(actor, behaviour, critic, ref, samples, args,
                                                    ppo.r3_off_step(args, 1))}
        secs, cpu = {k: [] for k in runs}, {k: [] for k in runs}
        for r in range(repeats):
            for k in list(runs)[r % 3:] + list(runs)[:r % 3]:  # the order rotated: a drifting machine biases none
                t0, p0 = time.perf_counter(), time.process_time()
                runs[k]()
                secs[k].append(round(time.perf_counter() - t0, 2))
                cpu[k].append(round(time.process_time() - p0, 2))
        med = {k: float(np.median(v)) for k, v in cpu.items()}
        wall = {k: float(np.median(v)) for k, v in secs.items()}
        lens = [len(s["tokens"]) for s in samples]
        mbs = ppo.minibatches(n, args.minibatch_size, random.Random(seed))
        pad = 1 - sum(lens) / sum(len(mb) * max(lens[i] for i in mb) for mb in mbs)
        return {"samples": n, "tokens": tokens, "mean_len": round(float(np.mean(lens)), 1),
                "minibatch_padding": round(pad, 3),
                "threads": torch.get_num_threads(), "seconds": secs, "cpu_seconds": cpu,
                "train_step_tokens_per_s": round(tokens / med["train_step"], 1),
                "unpadded_tokens_per_s": round(tokens / med["unpadded"], 1),
                "padded_tokens_per_s": round(tokens / med["padded"], 1),
                "ratio": round(med["unpadded"] / med["train_step"], 3),
                "ratio_wall": round(wall["unpadded"] / wall["train_step"], 3),
                "padded_ratio": round(med["unpadded"] / med["padded"], 3),
                "speedup_vs_padded": round(med["padded"] / med["train_step"], 3)}
