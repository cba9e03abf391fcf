"""T1: PPO with a full-size critic that turns a Qwen3.5-MoE model into a terminal agent.

Paper: "T1: Terminal Agent Reinforcement Learning for Long-Horizon Tasks" (arXiv 2609.11042), the optimisation
section; DESIGN.md section 3. One RL step (rl_loop), read top to bottom:

    1-3. rollout (Terminus-2 in a sandbox, oversampled), reward r = P / S -> 4. TITO samples -> 5. V_old ->
    GAE (gamma = lambda = 1) -> critic update (first, 30x lr) -> 6. old logprobs and PPO actor update, both with
    R3 replay, checkpoint -> 7. publish (one-step async: the rollout of step t+1 overlaps the update of step t)

preceded by an SFT warm start on reference trajectories and one epoch of Critic Warm-Up, followed by held-out
evaluation. Steps 5-6 run on the trainer actor (trainer.py) with ppo.py's step functions.

Run:
    bash run.sh                                   # embedded preset, this machine (CPU)
    bash run.sh --quick                           # smoke-test preset, a few minutes
    bash run.sh --full                            # 150 held-out RST tasks, 48 RL steps on 1,152 (~1-2 h)
    python train_t1.py --run-dir runs/x --rl-steps 5 --actor-lr 2e-5   # any Args field as a flag
    python train_t1.py plot runs/x                # PNG curves of a run

A run directory holds tasks/, ckpt/ (HF layout), samples/step_XXXXXX.jsonl (TITO records, `python tito.py audit`),
metrics.jsonl, tb/ (TensorBoard), curves.png, summary.json, log.txt and state.json, the commit point: the same
--run-dir resumes after the last committed phase / RL step, none applied twice or skipped (trainer.resume_run).

Departures from the paper (numbered; what and why; the update's own are in ppo.py, the trainer's in trainer.py):
  1. Scale: the embedded preset trains a tiny random-init MoE on synthesized shell tasks, sized for 2 CPU cores
     (EMBEDDED); the paper's values are Args' defaults, used by the cluster presets. S = the pool's 90th
     percentile of assertion counts (the paper's rule, which gives 20 on T1-15k).
  2. One-step async on Ray actors (infra.py "Ray layout"); on 2 shared cores the overlap cannot give the paper's
     speed-up (RESULTS.md). A process samples its first step synchronously (staleness 0); --sync-steps N the first N.
  3. SFT data: scripted reference-solution trajectories (the paper's is not public) of the training pool, or with
     --n-sft-tasks of that many fresh tasks disjoint from the RL and held-out pools; --sft-faults adds recoveries
     (tasks replayed with one untrained wrong turn, trained after it) the scripted expert never makes on its own.
  4. --backend megatron trains Megatron-Core models (mcore.trainer_models): on the CPU local modules (mcore's shims)
     in fp32 or bf16 with mcore_parallel.ShardedAdam; on CUDA the cluster model (TE layers and DeepEP where they
     import, Megatron's own distributed optimizer), written against megatron-core 0.16.1 but not yet run on a GPU.
  5. Task draw: n_launch consecutive tasks of a stream of per-epoch shuffles: no step is short (launch_tasks).
  6. Evaluation: the paper's protocol (gateway.EVAL) through the native token-first harness, not Terminus-2 via
     Harbor (`engine/gateway.py eval`); the embedded preset runs 1 attempt, 8 turns, 120 s (EMBEDDED).
  7. The embedded model is Qwen3-MoE (--arch qwen3_moe: attention in every layer), not Qwen3.5's hybrid: at this
     size the hybrid does not learn to copy (issue 13: .16 flat over 1,000 steps; Qwen3-MoE .99 at 1,000 here,
     RESULTS.md), and held-out tasks need it. --arch qwen3_5_moe stays tested; the cluster model stays Qwen3.5.
  8. A base phase (--base-steps, embedded only): synthetic copy pretraining before SFT, standing in for the
     pretrained model the paper starts from; its copy gate is logged (experiments/bench.py copy runs it alone).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoTokenizer

from experiments import bench
import critic as C
import data
from engine import server
from tasks import families
from engine import gateway
import infra
import model as M
from experiments import paper
import ppo
import reward
import rollout
from sandbox import task_io
import tito
from trainer import (Metrics, actor_threads, load_state, log, parallel_plan, prune_previous, resume_run, rewrite_jsonl,
                     write_atomic)


@dataclass
class Args:
    """Defaults are the paper's values (cluster scale); EMBEDDED / QUICK below override what must shrink."""
    run_dir: str = "runs/embedded"  # where checkpoints, samples and metrics go; the same dir resumes
    seed: int = 1  # seed for task synthesis, init, sampling and data order
    # --- data (paper: T1-15k, quality-ordered, reshuffled per epoch)
    n_train_tasks: int = 15000  # training pool size (paper: T1-15k)
    # held-out pool size (paper evaluates on Terminal-Bench 2.1, 89 tasks, disjoint from training)
    n_heldout_tasks: int = 89
    # extra tasks synthesized only for the SFT warm start (their scripted trajectories, kept when the verifier resolves
    # them); 0 = SFT on the training pool's reference trajectories
    n_sft_tasks: int = 0
    rst_rounds: int = 0  # RST steps added to every synthesized task (families.rst_extend; paper silent on the count)
    # the share of the SFT pool's tasks that carry the rst_rounds steps (the rest are their seed tasks, drawn per slot):
    # the paper's SFT data are demonstrations, its RL pool the RST-synthesised T1-15k; 1.0 = the SFT pool is drawn like
    # the RL pool (paper silent on how much of its SFT data is RST-like). 0.25 left SFT solving no RST task and RL
    # never learned one in 48 steps (RESULTS.md 2026-12-03)
    sft_rst_share: float = 1.0
    # False: the training (RL) pool is written by the generator but not audited in sandboxes, like the SFT pool (the
    # held-out pool always is); for a large fresh RL pool on 2 cores (paper: every T1-15k task is audited)
    validate_train: bool = True
    # the free text of the SFT pool's expert replies: full (analysis / plan restate the task) | terse (fixed words on
    # every task) | restate (full, the first analysis opening on the instruction verbatim): families.expert_replies;
    # paper silent (its SFT transcripts come from a teacher model)
    expert_text: str = "full"
    # --- model
    arch: str = "qwen3_5_moe"  # embedded model: qwen3_5_moe (Qwen3.5 hybrid GDN + gated attention) | qwen3_moe
    vocab_size: int = 2048  # embedded tokenizer size (the cluster uses Qwen3.5's 248,320-token vocabulary)
    # --- rollout (paper: 1 trajectory per task; launch 560, keep the first 512 finished)
    n_launch: int = 560  # trials launched per RL step (paper: 560)
    n_keep: int = 512  # first finished trials kept per RL step (paper: 512)
    temperature: float = 1.0  # sampling temperature of training rollouts
    top_p: float = 1.0  # nucleus sampling of training rollouts
    max_turns: int = 300  # turn limit of one trial (paper: 300+ tool-call turns per task)
    max_new_tokens: int = 8192  # tokens per model reply (paper evaluation: 8,192 output tokens)
    max_total_tokens: int = 56000  # context budget of one trajectory (paper evaluation: 56k input)
    trial_timeout_s: float = gateway.EVAL["agent_timeout_s"]  # agent limit (paper silent; its eval's 3600 s)
    rollout_workers: int = 64  # concurrent trials
    trial_mem_bytes: int = 2 << 30  # memory cap of a whole trial: processes + files, a cgroup (0: per process only)
    trial_disk_bytes: int = 1 << 30  # bytes a trial may write (its tmpfs; task.toml storage_mb lowers it)
    trial_disk_inodes: int = 100_000  # files a trial may create (paper silent, as the two above: sandbox.Limits)
    trial_keep_bytes: int = 16 << 20  # run_dir/trials keeps a trial's files up to this, else its host logs only
    # --- evaluation (paper protocol, one source: gateway.EVAL; every trial counts, gateway.evaluate_trials)
    eval_temperature: float = gateway.EVAL["temperature"]  # evaluation temperature (paper: 0.1)
    eval_top_p: float = gateway.EVAL["top_p"]  # evaluation top-p (paper: 0.95)
    # attempts per held-out task (paper: 3); n_trials = tasks x attempts, a failed trial counts 0
    eval_attempts: int = gateway.EVAL["attempts"]
    eval_max_turns: int = gateway.EVAL["max_turns"]  # turn limit of an evaluation trial (paper: 60)
    # agent wall-clock limit of an evaluation trial, replacing the task's own (paper: 3600 s)
    eval_agent_timeout_s: float = gateway.EVAL["agent_timeout_s"]
    # verifier limit of an evaluation trial, replacing the task's own (paper: 900 s)
    eval_verifier_timeout_s: float = gateway.EVAL["verifier_timeout_s"]
    # also evaluate on this many training tasks (what RL optimises, beside held-out generalisation)
    eval_train_tasks: int = 0
    eval_every: int = 0  # held-out evaluation every this many RL steps (curves.png; paper silent); 0 = after RL only
    # validation tasks (drawn like the held-out ones, none sharing an instruction with any pool), scored beside the
    # held-out set every eval_every steps and after RL: the end-of-run table adds held-out at the RL step that did
    # best on them, a checkpoint chosen without reading the held-out curve (paper silent); 0 = none
    n_val_tasks: int = 0
    # --- reward
    # S in r = P / S, fixed for the whole run (paper: 20, about the 90th percentile of assertion counts)
    reward_scale: float = float(reward.SCALE)
    reward_scale_from_pool: bool = False  # S = the same rule on this run's training pool instead (data.pool_scale)
    # --- SFT warm start
    sft_epochs: int = 1  # epochs over the scripted reference trajectories
    sft_lr: float = 1e-5  # SFT learning rate
    sft_batch_size: int = 8  # trajectories per SFT step
    # recoveries in the SFT data: this fraction of the SFT tasks replayed a second time with one wrong turn
    # (invalid JSON, no plan, a misspelled program: rollout.with_faults), untrained, and trained only on the expert's
    # replies after it (paper silent: its teacher's transcripts have their own; the scripted expert's have none)
    sft_faults: float = 0.0
    # --- base phase (embedded only: the paper starts from pretrained Qwen3.5, so 0 = none, the paper's case)
    base_steps: int = 0  # steps of synthetic copy pretraining before SFT (train_t1.base_phase)
    base_lr: float = ppo.BASE_LR  # its learning rate (this project's)
    base_batch_size: int = ppo.BASE_BATCH  # copy samples per step (this project's)
    # while the copy gate (COPY_GATE) is not reached after base_steps, more steps in chunks of base_steps / 4 up to this
    # many in all (0: exactly base_steps; this project's): run s2 read .825 after 1,000 steps, .94 after 1,250
    base_max_steps: int = 0
    # --- critic (paper: full-size, warm-up one epoch, 30x actor lr, updated first, value clip 0.2)
    critic_warmup_epochs: int = 1  # critic-only epochs before RL (paper: Critic Warm-Up, one epoch)
    critic_warmup_trials: int = 512  # rollouts of the SFT policy that form the warm-up pool
    critic_lr: float = 1.5e-5  # critic learning rate (paper: 1.5e-5 = 30x the actor's)
    critic_head_init: str = "zero"  # value head: zero (predicts 0 until trained) | default (random; paper silent)
    clip_eps_v: float = 0.2  # value clip around V_old (paper: eps_v = 0.2)
    # --- PPO (paper: clip 0.2, gamma = lambda = 1, KL off, load balancing off, no schedule/entropy/shaping)
    rl_steps: int = 58  # RL steps (paper: 58 logged steps in the production run)
    actor_lr: float = 1.0e-6  # actor learning rate (paper: 1.0e-6, constant)
    clip_eps: float = 0.2  # PPO ratio clip (paper: 0.2)
    gamma: float = 1.0  # discount (paper: 1)
    lam: float = 1.0  # GAE lambda (paper: 1)
    # ablation arms of the paper's comparisons (issue 14); the defaults are the paper's method
    reward_mode: str = "dense"  # dense: r = P / S (paper) | binary: 1 if every test passed, else 0 (its first run)
    advantage: str = "gae"  # gae: GAE with the critic (paper) | grpo: (r - group mean) / group std, no critic
    samples_per_task: int = 1  # trajectories per task in a step (paper: 1); grpo's group size G (>= 2)
    # KL to the frozen SFT reference, k3 estimator on the m = 1 tokens, added to the actor loss (paper: both KL terms
    # off: the reference routes with its own experts); > 0 builds the reference copy (hf backend)
    kl_coef: float = 0.0
    # MoE load-balancing (Switch / Qwen-MoE aux) loss of the actor's routers, added to the actor loss (paper: 0,
    # balancing would move the routing R3 replays; hf backend)
    aux_loss_coef: float = 0.0
    # entropy bonus: the actor loss minus coef x the mean entropy of pi on the m = 1 tokens (paper: none; hf)
    entropy_coef: float = 0.0
    # PPO and value loss reduction: token (mean over every m = 1 token of a minibatch) | sample (mean within each
    # trajectory, then over trajectories: slime's default) (paper silent; token was the only one before this flag)
    loss_agg: str = "token"
    ppo_epochs: int = 1  # passes over each step's batch (not stated in the paper)
    minibatch_size: int = 64  # trajectories per optimizer step
    max_grad_norm: float = 1.0  # gradient clipping
    async_rollout: bool = True  # one-step async: sample step t+1 while training step t, staleness exactly 1 (paper)
    # trainer and engines share devices (paper silent: its devices are disjoint; cluster/launch.py's one-node 35B
    # preset): the engines release their memory (weights + KV cache) for each update and take it back for the publish,
    # the KV cache alone for the critic warm-up; synchronous (--async-rollout false: nothing samples while the trainer
    # works)
    colocate: bool = False
    sync_steps: int = 0  # run the first sync_steps RL steps sequentially (async vs sequential step time within one run)
    pin_cores: bool = False  # trainer and rollout side on disjoint halves of the cores (infra.core_split)
    r3_mode: str = "replay"  # routing in the trainer: replay (R3, paper) | off
    # --- engine, sandboxes, Ray
    engine_weight_dtype: str = "bf16"  # engine weights: bf16-rounded (production-like mismatch) or fp32
    n_engines: int = 1  # embedded engines started as Ray actors (ignored with engine_urls)
    # comma-separated SGLang-protocol servers already running (cluster/launch.py launch); empty: start n_engines
    engine_urls: str = ""
    rollout_actors: int = 8  # Ray rollout-worker actors; rollout_workers concurrent trials are spread over them
    sandbox: str = "bwrap"  # bwrap (local jail) | daytona (cluster; needs DAYTONA_API_KEY)
    ray_address: str = ""  # Ray cluster to join (or $RAY_ADDRESS); empty: start one on this machine for this run
    # CPU threads of the trainer and of each embedded engine; 0: half the cores each when async (the overlapped rollout
    # and update then do not fight over the same cores), all of them (max 2) otherwise
    torch_threads: int = 0
    # --- cluster (the flags `cluster/launch.py launch` passes)
    backend: str = "hf"  # trainer: hf (transformers, this machine) | megatron (cluster/mcore.py; CPU or GPU)
    # the Megatron trainer's parameter dtype: fp32 | bf16 (with fp32 master shards in the distributed optimizer);
    # paper silent; the cluster presets train in bf16 (Megatron's mixed precision, as slime runs it)
    param_dtype: str = "fp32"
    # start RL from this HF checkpoint (the paper's SFT model) instead of the embedded SFT warm start
    model_path: str = ""
    # trainer layout (JSON: tp, pp, cp, ep, etp, dp, as infra.py's planner prints it); megatron: tp / pp / cp / ep / etp
    # / dp run over tp * pp * cp * dp trainer ranks, on this CPU too (gloo); cp not with pp
    plan: str = ""
    # GPUs of each server in engine_urls (cluster: weights are broadcast over NCCL, cluster.WeightPublisher)
    engine_world_sizes: str = ""
    # data-parallel trainer ranks (Ray actors under one torch.distributed group; TrainerGroup) when no --plan
    trainer_ranks: int = 1


COPY_GATE = 0.9  # the base phase should reach this greedy copy accuracy (issue 13's gate; experiments/bench.py copy)

# Embedded presets: the paper's ratios kept where they mean something at this scale
# (critic lr = 30 x actor lr, eval protocol, clip values, S by the paper's 90th-percentile rule on this pool),
# sizes and lrs shrunk for 2 CPU cores. Each value sized for the tiny model says why (measured: RESULTS.md).
EMBEDDED = dataclasses.replace(
    Args(), arch="qwen3_moe", base_steps=1000,  # departures 7 and 8: a model that can copy (gate .98 at 1,000)
    base_max_steps=2000,  # ... for most seeds: seed 2 of r2's recipe read .825 at 1,000 (SFT held-out .333 vs .607)
    n_train_tasks=120, n_heldout_tasks=30, n_launch=36, n_keep=32, max_turns=8,
    max_new_tokens=192, max_total_tokens=3072, trial_timeout_s=120.0, rollout_workers=12,
    reward_scale_from_pool=True, eval_attempts=1, eval_train_tasks=30,
    # SFT on 600 fresh tasks (disjoint from RL and held-out) for 4 epochs at the tiny model's lr: held-out .59;
    # 30 epochs over the 120-task RL pool memorised it and solved no held-out task
    n_sft_tasks=600, sft_epochs=4, sft_lr=2e-3, sft_batch_size=8,
    # PPO for a ~2.5M-parameter model: actor lr 1e-4 (5e-5 barely moved it; the paper's 1e-6 is for 122B), critic
    # lr 30x (the paper's ratio), 2 epochs of minibatches of 8 over the 32 kept trials; rollouts at the paper's T = 1
    # without KL (--full: T = 0.7 and a KL to SFT); a warm-up of 64 trials fits the 25-minute budget but leaves the
    # critic at EV ~0.04 (--full warms on 512)
    critic_warmup_trials=64, rl_steps=8, actor_lr=1e-4, critic_lr=3e-3, minibatch_size=8, ppo_epochs=2,
    rollout_actors=2,
    # evaluation protocol overrides (paper: 3 attempts, 60 turns, 3600 s agent): one attempt, the training turn and
    # time limits, so that an evaluation takes minutes on 2 cores (the 3072-token context fills in ~8 turns anyway)
    eval_max_turns=8, eval_agent_timeout_s=120.0)
# bash run.sh --full: the issue-13 targets' sizes and the RL recipe measured best here (RESULTS.md, sessions 8-14): 150
# held-out tasks (95% interval ~ +-8 points; the paired test over the same tasks is the stronger one); every task
# extended by one RST step on its output (3-8 assertions, S = 6: partial credit for r = P / S to grade; RL's mean reward
# gain had p 0.001-0.07 at all 8 evaluations of three RL runs from two such SFT models; one-step tasks' SFT left less
# room: 0.59-0.77); RL on 1,152 fresh tasks, written but not sandbox-audited (0 rejects in 270 audited); Critic Warm-Up
# on 512 trials (64 or 256 left EV ~0.04); rollouts at T = 0.7 with a k3 KL of 0.05 to SFT (paper: T = 1, no KL: there
# the tiny model's replies were refused 37-57% of the time and its format drifted); 48 steps, the held-out curve every
# 16 (later steps plateaued or fell back); no validation set (--n-val-tasks adds one; at 150 tasks it moved as much as
# RL's gains); SFT for 8 epochs, not 4: SFT's loss flattens by epoch 6-8 and held-out read 0.000 / 0.013 / 0.327 /
# 0.520 / 0.560 after epochs 1 / 2 / 4 / 6 / 8 (seed 0, RESULTS.md 12-03; ~3 min more). 1-2 h on 2 cores.
FULL = dataclasses.replace(EMBEDDED, run_dir="runs/full", n_heldout_tasks=150, n_train_tasks=1152, rst_rounds=1,
                           validate_train=False, rl_steps=48, eval_every=16, critic_warmup_trials=512,
                           temperature=0.7, kl_coef=0.05, sft_epochs=8)
QUICK = dataclasses.replace(
    EMBEDDED, run_dir="runs/quick", n_train_tasks=24, n_heldout_tasks=6, n_launch=10, n_keep=8, n_sft_tasks=16,
    eval_train_tasks=6, base_steps=20, base_max_steps=0, sft_epochs=2, critic_warmup_trials=8, rl_steps=2, max_turns=5)
CLUSTER = dataclasses.replace(Args(), backend="megatron", param_dtype="bf16", sandbox="daytona",
                              n_engines=0)  # paper values
PRESETS = {"embedded": EMBEDDED, "full": FULL, "quick": QUICK, "paper": Args(),
           "qwen35-122b-a10b": dataclasses.replace(CLUSTER, run_dir="runs/qwen35-122b-a10b"),
           "qwen35-35b-a3b": dataclasses.replace(CLUSTER, run_dir="runs/qwen35-35b-a3b", colocate=True,
                                                 async_rollout=False)}


# The range of every numeric Args field (check_args refuses a value outside it, or a non-finite float, or a float
# where an int is expected, naming --flag-name and the value). A new numeric field must be added here
# (tests/test_check_args.py walks Args and fails on one that is missing).
RANGES = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
          "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1}
NUMERIC = {
    "seed": ">= 0", "n_train_tasks": ">= 1", "n_heldout_tasks": ">= 1", "n_sft_tasks": ">= 0", "rst_rounds": ">= 0",
    "vocab_size": ">= 1",
    "n_launch": ">= 1", "n_keep": ">= 1", "temperature": "> 0", "top_p": "in (0, 1]", "max_turns": ">= 1",
    "max_new_tokens": ">= 1", "max_total_tokens": ">= 1", "trial_timeout_s": "> 0", "rollout_workers": ">= 1",
    "trial_mem_bytes": ">= 0", "trial_disk_bytes": ">= 1", "trial_disk_inodes": ">= 1",
    "trial_keep_bytes": ">= 0",
    "eval_temperature": ">= 0", "eval_top_p": "in (0, 1]", "eval_attempts": ">= 0", "eval_train_tasks": ">= 0",
    "eval_every": ">= 0", "n_val_tasks": ">= 0", "reward_scale": "> 0", "sft_epochs": ">= 0", "sft_lr": ">= 0",
    "sft_batch_size": ">= 1",
    "sft_faults": "in [0, 1]", "sft_rst_share": "in [0, 1]", "base_steps": ">= 0", "base_max_steps": ">= 0",
    "base_lr": "> 0",
    "base_batch_size": ">= 1",
    "critic_warmup_epochs": ">= 0", "critic_warmup_trials": ">= 1", "critic_lr": ">= 0", "clip_eps_v": "> 0",
    "rl_steps": ">= 0", "samples_per_task": ">= 1", "actor_lr": ">= 0", "clip_eps": "> 0", "gamma": "in [0, 1]",
    "lam": "in [0, 1]",
    "kl_coef": ">= 0", "aux_loss_coef": ">= 0", "entropy_coef": ">= 0", "ppo_epochs": ">= 1", "minibatch_size": ">= 1",
    "max_grad_norm": "> 0", "sync_steps": ">= 0", "n_engines": ">= 0", "rollout_actors": ">= 1",
    "torch_threads": ">= 0", "trainer_ranks": ">= 1", "eval_max_turns": ">= 1", "eval_agent_timeout_s": "> 0",
    "eval_verifier_timeout_s": "> 0"}


def check_numbers(args: Args) -> None:
    """Every numeric field against NUMERIC: the type of its default (int, or a finite float) and its range."""
    for f in dataclasses.fields(Args):
        kind = type(f.default)
        if kind not in (int, float):
            continue
        v, flag = getattr(args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise ValueError(f"{flag}: expected {'an integer' if kind is int else 'a number'}, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{flag}: must be a finite number, got {v!r}")
        rule = NUMERIC.get(f.name)
        if rule is None:
            raise ValueError(f"{flag}: numeric field with no range in train_t1.NUMERIC (add one)")
        if not RANGES[rule](v):
            raise ValueError(f"{flag}: must be {rule}, got {v!r}")


def check_args(args: Args) -> None:
    """Bad flags fail before any work, naming the flag and what is wrong (and, for the cluster, what is missing)."""
    check_numbers(args)
    choices = {"backend": ("hf", "megatron"), "param_dtype": ("fp32", "bf16"), "sandbox": ("bwrap", "daytona"),
               "r3_mode": ("replay", "off"),
               "engine_weight_dtype": ("bf16", "fp32"), "arch": M.ARCHS, "reward_mode": ppo.REWARD_MODES,
               "advantage": ppo.ADVANTAGES, "critic_head_init": C.HEAD_INITS,
               "expert_text": families.EXPERT_TEXTS}
    for k, ok in choices.items():
        if getattr(args, k) not in ok:
            raise ValueError(f"--{k.replace('_', '-')}: expected one of {'|'.join(ok)}, got {getattr(args, k)!r}")
    if args.sft_rst_share < 1.0 and not (args.n_sft_tasks and args.rst_rounds):
        raise ValueError(f"--sft-rst-share {args.sft_rst_share}: shares out the SFT pool's RST steps, so it needs "
                         f"--n-sft-tasks and --rst-rounds (got {args.n_sft_tasks} and {args.rst_rounds})")
    if args.n_keep > args.n_launch or args.n_keep < 1:
        raise ValueError(f"--n-keep: must be in [1, n_launch = {args.n_launch}], got {args.n_keep}")
    if args.n_launch % args.samples_per_task:
        raise ValueError(f"--samples-per-task: {args.samples_per_task} must divide --n-launch {args.n_launch} "
                         "(every task of a step is launched that many times)")
    if args.param_dtype != "fp32" and args.backend == "hf":
        raise NotImplementedError(f"--param-dtype {args.param_dtype} with --backend hf: not wired (the hf trainer "
                                  "holds fp32 parameters and torch's Adam); use --backend megatron or fp32")
    if args.critic_head_init != "zero" and args.backend == "megatron":
        raise NotImplementedError("--critic-head-init default with --backend megatron: not wired (the head of "
                                  "mcore.MegatronCritic is always zero-initialised); use --backend hf or zero")
    if args.colocate and args.async_rollout:
        raise ValueError("--colocate: the engines give their memory to the trainer during each update, so nothing "
                         "can sample beside it; add --async-rollout false")
    if args.advantage == "grpo" and args.samples_per_task < 2:
        raise ValueError(f"--advantage grpo: needs --samples-per-task >= 2 (the group), got {args.samples_per_task}")
    urls = [u for u in args.engine_urls.split(",") if u]
    if not urls and args.n_engines < 1:
        raise ValueError("--engine-urls: empty and --n-engines 0: no engine to sample from")
    sizes = [s for s in args.engine_world_sizes.split(",") if s]
    if sizes and len(sizes) != len(urls):
        raise ValueError(f"--engine-world-sizes: {len(sizes)} entries for {len(urls)} --engine-urls")
    if args.model_path and not (Path(args.model_path) / "config.json").is_file():
        raise ValueError(f"--model-path: no config.json in {args.model_path!r}")
    if args.pin_cores:
        infra.core_split()  # names the cores when there are fewer than 2
    if args.sandbox == "daytona" and not os.environ.get("DAYTONA_API_KEY"):
        raise ValueError("--sandbox daytona: DAYTONA_API_KEY is not set")
    p = parallel_plan(args)
    if args.plan and args.trainer_ranks not in (1, p["world"]):
        raise ValueError(f"--trainer-ranks: {args.trainer_ranks}, but --plan lays out {p['world']} ranks "
                         "(tp * pp * cp * dp)")
    if args.backend == "hf" and max(p["tp"], p["pp"], p["cp"], p["ep"]) > 1:
        raise ValueError(f"--plan: {args.plan} asks for model parallel; the hf backend only runs full replicas "
                         "(dp); use --backend megatron")
    if args.backend == "megatron" and args.model_path:
        check_megatron_model_path(args.model_path, args.param_dtype)
    if args.backend == "megatron" and p["world"] > 1:
        if p["cp"] > 1 and p["pp"] > 1:  # _gpt_forward's CP chunks are not passed between pipeline stages
            raise NotImplementedError(f"--plan: cp = {p['cp']} with pp = {p['pp']}: context parallel with pipeline "
                                      "parallel is not written (cluster/mcore_parallel.py departure 2); "
                                      "use cp with tp / ep / dp")
        if p["ep"] > 1 and (p["tp"] * p["cp"] * p["dp"]) % (p["ep"] * p["etp"]):  # Megatron's expert layout
            raise ValueError(f"--plan: ep * etp = {p['ep'] * p['etp']} must divide tp * cp * dp = "
                             f"{p['tp'] * p['cp'] * p['dp']}")
    check_loss_args(args)


# host bytes per parameter of a CPU trainer rank's state, before sharding: actor + behaviour copy + critic in the
# parameter dtype, Adam's two fp32 moments of actor and critic, and with bf16 the fp32 masters of actor and critic
TRAINER_BYTES_PER_PARAM = {"fp32": 3 * 4 + 4 * 4, "bf16": 3 * 2 + 4 * 4 + 2 * 4}


def check_megatron_model_path(path: str, dtype: str = "fp32") -> None:
    """--model-path with --backend megatron: the trainer builds its Megatron models from that HF checkpoint
    (mcore.trainer_models, each rank reading its shards): on a CUDA node the cluster model (bf16 with --param-dtype
    bf16, Megatron's distributed optimizer, TE layers and DeepEP where they import; the planner, `cluster/launch.py
    check`, sizes the device memory), on the CPU local modules, which is what the CPU rehearsal of the cluster path
    runs. Refused by name: a layout the converter does not know; on the CPU a checkpoint whose trainer state
    (TRAINER_BYTES_PER_PARAM) exceeds this machine's memory. A GPU node without flash-linear-attention runs Megatron's
    torch gated delta rule (mcore.init_cpu), slower: said in the log, not refused."""
    import importlib.util
    cfg = json.loads((Path(path) / "config.json").read_text())
    kind = cfg.get("model_type", "")
    if kind not in ("qwen3_moe", "qwen3_5_moe_text", "qwen3_5_moe"):
        raise ValueError(f"--model-path: {path} holds a {kind!r} model; the Megatron backend converts the Qwen3-MoE "
                         "and Qwen3.5-MoE layouts")
    if torch.cuda.is_available():
        if kind != "qwen3_moe" and importlib.util.find_spec("fla") is None:
            print(f"[train_t1] --model-path {path}: no flash-linear-attention (`fla`) on this GPU node: Megatron's "
                  "GatedDeltaNet runs its torch reference kernel (slower, same numbers)", file=sys.stderr)
        return
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(cfg.get("torch_dtype", cfg.get("dtype"))), 2)
    need = weights / dtype_bytes * TRAINER_BYTES_PER_PARAM[dtype]
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ValueError(f"--model-path: {path} has {weights / 2**30:.1f} GiB of weights; a CPU trainer holds "
                         f"{TRAINER_BYTES_PER_PARAM[dtype]} bytes a parameter ({need / 2**30:.0f} GiB before "
                         f"sharding) and this machine has {have / 2**30:.0f} GiB; train it on GPU nodes")


def check_loss_args(args: Args) -> None:
    """The loss flags: --loss-agg a known reduction, the extra loss terms finite, >= 0, and on a backend that has
    them (the Megatron actor returns only the sampled token's logprob from vocab-parallel logits: no entropy, no
    router logits, and no reference copy is built; refused by name rather than silently ignored)."""
    if args.loss_agg not in C.AGGS:
        raise ValueError(f"--loss-agg: expected one of {'|'.join(C.AGGS)}, got {args.loss_agg!r}")
    for k in ("kl_coef", "entropy_coef", "aux_loss_coef"):
        v = getattr(args, k)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"--{k.replace('_', '-')}: must be a finite number >= 0, got {v!r}")
        if v and args.backend == "megatron":
            raise NotImplementedError(
                f"--{k.replace('_', '-')} {v} with --backend megatron: not wired (mcore.MegatronActor.token_logprobs "
                "gives only the sampled token's logprob: no entropy over the vocab-parallel logits, no router logits "
                "for the load-balancing loss (Megatron's own moe_aux_loss_coeff is 0 in cluster/mcore.py), no "
                "reference "
                "copy for KL); use --backend hf or 0 (the paper's value)")


# --- helpers ------------------------------------------------------------------------------------------

def run_rollouts(task_dirs, agent, args: Args, run_dir: Path, tokenizer, workers=None, urls=None, n_keep=None,
                 temperature=None, top_p=None, desc="rollout", limits=None, script_faults=0.0):
    """Trials on the Ray rollout workers (rollout.ray_run_trials), or in this process when workers is None
    (the SFT data, before any engine); returns (kept trials, dropped, tokens/s). limits: overrides of the
    training limits (the evaluation protocol's). Every trial is scored with S = --reward-scale. script_faults:
    the scripted agent's fault rate (--sft-faults)."""
    sampling = {"temperature": args.temperature if temperature is None else temperature,
                "top_p": args.top_p if top_p is None else top_p,
                "max_new_tokens": args.max_new_tokens,
                "stop_token_ids": [tokenizer.convert_tokens_to_ids(M.IM_END)]}
    limits = {"max_turns": args.max_turns, "max_total_tokens": args.max_total_tokens,
              "trial_timeout_s": args.trial_timeout_s, "trial_mem_bytes": args.trial_mem_bytes,
              "disk_bytes": args.trial_disk_bytes, "disk_inodes": args.trial_disk_inodes,
              "keep_bytes": args.trial_keep_bytes, **(limits or {})}
    kw = dict(sampling=sampling, limits=limits, work_root=str(run_dir / "trials"), sandbox=args.sandbox,
              reward_scale=args.reward_scale, **({"script_faults": script_faults, "seed": args.seed}
                                                 if script_faults else {}))
    t0 = time.time()
    if workers is None:
        kept, dropped = rollout.run_trials([str(d) for d in task_dirs], agent, n_keep=n_keep, tokenizer=tokenizer,
                                           max_workers=args.rollout_workers, desc=desc, **kw)
    else:
        kept, dropped = rollout.ray_run_trials(workers, task_dirs, agent, n_keep=n_keep, engine_urls=urls, desc=desc,
                                               **kw)
    for t in kept:  # one reward: every trial scored with this run's S
        if t.get("reward_scale", args.reward_scale) != args.reward_scale:
            raise ValueError(f"trial of task {t.get('task')!r}: scored with S = {t['reward_scale']}, "
                             f"--reward-scale is {args.reward_scale}")
    n_tok = sum(len(r["output_ids"]) for t in kept for r in t.get("records", []))
    return kept, dropped, n_tok / max(time.time() - t0, 1e-9)


def evaluate(task_dirs, args, run_dir, tokenizer, workers, urls, tag) -> dict:
    """Evaluation with the paper's protocol (gateway.EVAL, through Args.eval_*): temperature 0.1, top-p 0.95,
    eval_attempts per task, the eval turn and agent / verifier limits replacing the tasks' own. Every trial counts
    (gateway.evaluate_trials): n_trials = tasks x attempts, a trial that errored or was dropped scores 0 and is
    listed in `errors`. The native token-first harness stands in for Terminus-2 (rollout.py)."""
    if args.eval_attempts == 0:  # --eval-attempts 0 turns evaluation off: no trial, said so, never a 0 solve rate
        log(Path(run_dir), f"eval {tag}: skipped (--eval-attempts 0)")
        return {"solve_rate": float("nan"), "reward_mean": float("nan"), "turns_mean": float("nan"), "n_trials": 0,
                "n_errors": 0, "errors": [], "skipped": True}
    limits = {"max_turns": args.eval_max_turns, "trial_timeout_s": args.eval_agent_timeout_s,
              "agent_timeout_s": args.eval_agent_timeout_s, "verifier_timeout_s": args.eval_verifier_timeout_s}

    def run_attempt(dirs, k):
        kept, dropped, _ = run_rollouts(dirs, "model", args, run_dir, tokenizer, workers, urls,
                                        temperature=args.eval_temperature, top_p=args.eval_top_p,
                                        desc=f"eval {tag} #{k + 1}", limits=limits)
        return kept + [{"task": d["task"], "exit_reason": "error", "error": d["reason"]} for d in dropped]
    rep = gateway.evaluate_trials(task_dirs, run_attempt, args.eval_attempts)
    if rep["n_errors"]:
        log(Path(run_dir), f"eval {tag}: {rep['n_errors']} of {rep['n_trials']} trials failed and count 0: "
                           f"{rep['errors'][:5]}")
    return rep  # with its trials (task, attempt, reward, resolved): the paired tests of the end-of-run table


def eval_row(run: Run, ev: dict, step: int, val: dict | None = None) -> None:
    """A held-out evaluation (and the validation set's, --n-val-tasks) as a metrics row (phase "eval", at the RL
    step whose weights it scored; SFT: 0), and whole, per-trial rows included, in evals/step_NNNNNN.json (and
    evals/val_step_NNNNNN.json): any two compare paired (`experiments/bench.py compare A B`). A row of the same step
    already in metrics.jsonl (written before a kill that came ahead of the state's commit; resume keeps it, as the step
    is committed) is replaced, so each evaluation has one row."""
    row = {"heldout_solve_rate": ev["solve_rate"], "heldout_reward_mean": ev["reward_mean"],
           "heldout_n_trials": ev["n_trials"]}
    if val is not None:
        row.update(val_solve_rate=val["solve_rate"], val_reward_mean=val["reward_mean"], val_n_trials=val["n_trials"])
    (run.dir / "evals").mkdir(exist_ok=True)
    for name, e in (("step", ev), ("val_step", val)):  # the files first: the row is what a resume keeps or drops
        if e is not None:
            write_atomic(run.dir / "evals" / f"{name}_{step:06d}.json", json.dumps({**e, "after_step": step}))
    for note in rewrite_jsonl(run.dir / "metrics.jsonl", lambda r: (r.get("phase"), r.get("step")) != ("eval", step)):
        log(run.dir, f"eval row of step {step}: {note}")
    run.metrics.write(row, step, "eval")


def brief(ev: dict) -> dict:
    """An evaluation without its per-trial rows (for the log)."""
    return {k: v for k, v in ev.items() if k != "trials"}


# --- the run: one function per phase ------------------------------------------------------------------

class Run:
    """The run directory: args, state.json (the commit point), metrics.jsonl + TensorBoard, log.txt."""

    def __init__(self, args: Args):
        check_args(args)
        self.args = args = dataclasses.replace(args, trainer_ranks=parallel_plan(args)["world"])  # --plan: ranks
        self.dir = run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.state = load_state(run_dir)  # refuses a run dir with data but no state.json, names a corrupt one
        torch.manual_seed(args.seed)
        random.seed(args.seed)
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        (run_dir / "args.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        self.save_state()  # a fresh run dir has its state.json before any data
        self.sft_dir = Path(args.model_path) if args.model_path else run_dir / "ckpt" / "sft"
        for note in resume_run(run_dir, self.state, sft_done=(self.sft_dir / "config.json").exists()):
            log(run_dir, "resume: " + note)
        self.metrics = Metrics(run_dir)

    def save_state(self) -> None:  # the commit point (atomic): a kill at any moment leaves the old or the new state
        write_atomic(self.dir / "state.json", json.dumps(self.state, indent=1))

    def timed(self, name, fn):
        t0 = time.time()
        out = fn()
        self.state["phase_times"][name] = self.state["phase_times"].get(name, 0.0) + time.time() - t0
        self.save_state()
        return out


def run_scale(args: Args, state: dict, train_pool: list) -> float:
    """S of r = P / S, fixed for the whole run (paper): --reward-scale, or the training pool's ~90th percentile of
    assertion counts (--reward-scale-from-pool); recorded in state.json, and a resume with another S is refused."""
    s = float(data.pool_scale(train_pool) if args.reward_scale_from_pool else args.reward_scale)
    if state.setdefault("reward_scale", s) != s:
        raise ValueError(f"--reward-scale: this run's S is {state['reward_scale']} (state.json), got {s}: S is fixed "
                         "for the whole run")
    return s


def make_tasks(run: Run) -> tuple[list, list]:
    """Tasks: synthesize, audit by oracle, split train / held-out (once per run directory). The audit runs
    rollout_workers sandboxes at once, as the rollouts do: it waits on jails and shells more than it computes (11
    tasks here: 52-59 s with 2 at once, 30-44 s with 6 or 12, on a loaded machine)."""
    args, state = run.args, run.state
    if "tasks" not in state:
        train_dirs, heldout_dirs = run.timed("tasks", lambda: data.generate_tasks(
            run.dir / "tasks", args.n_train_tasks, args.n_heldout_tasks, args.seed, rst_rounds=args.rst_rounds,
            validate_train=args.validate_train, expert_text=args.expert_text, workers=args.rollout_workers))
        state["tasks"] = {"train": [str(d) for d in train_dirs], "heldout": [str(d) for d in heldout_dirs]}
        run.save_state()
    if args.n_val_tasks and "val" not in state["tasks"]:  # drawn after the pools (their tasks stay as they were)
        sft = run.dir / "tasks" / "sft" / "train"  # an SFT pool drawn before (a validation set added on resume)
        taken = [task_io.load_task(d).instruction for d in state["tasks"]["train"] + state["tasks"]["heldout"]
                 + (data.task_dirs_under([sft]) if sft.is_dir() and any(sft.iterdir()) else [])]
        _, val = run.timed("tasks", lambda: data.generate_tasks(
            run.dir / "tasks" / "val", 0, args.n_val_tasks, args.seed, rst_rounds=args.rst_rounds,
            expert_text=args.expert_text, workers=args.rollout_workers, heldout_split="val", avoid=taken))
        state["tasks"]["val"] = [str(d) for d in val]
        run.save_state()
    train_pool = data.ordered_pool(state["tasks"]["train"])  # quality-ordered (paper)
    heldout = state["tasks"]["heldout"]
    run.args = dataclasses.replace(args, reward_scale=run_scale(args, state, train_pool))
    (run.dir / "args.json").write_text(json.dumps(dataclasses.asdict(run.args), indent=1))  # with the run's S
    run.save_state()
    n_val = f", {len(state['tasks']['val'])} validation" if state["tasks"].get("val") else ""
    log(run.dir, f"tasks: {len(train_pool)} train, {len(heldout)} held-out{n_val}; S = {run.args.reward_scale:g}")
    return train_pool, heldout


def base_phase(run: Run, actor, tokenizer, texts: list) -> dict:
    """The base phase (embedded only; the paper starts from pretrained Qwen3.5): base_steps of synthetic copy
    pretraining (data.copy_samples over the SFT corpus's pieces), then the copy gate: greedy copy accuracy on 64
    fresh samples, logged and recorded in state.json. Below the gate, --base-max-steps allows more: chunks of
    base_steps / 4 until a second 64-sample probe (not the reported one) reads >= COPY_GATE or the cap is reached;
    a base still below the gate is logged as a WARNING (its SFT will generalise less: RESULTS.md, run s2)."""
    args = run.args
    items = data.copy_items(texts)

    def train(n, seed):
        samples = data.copy_samples(tokenizer, items, n * args.base_batch_size, seed)
        ppo.sft(actor, samples, args, run.metrics, phase="base", epochs=1, lr=args.base_lr,
                batch_size=args.base_batch_size)
    train(args.base_steps, args.seed)
    steps, chunk = args.base_steps, max(1, args.base_steps // 4)
    probe = data.copy_samples(tokenizer, items, 64, -1001 - args.seed)  # decides; the gate below reports
    decided = None  # the deciding probe's last reading (None: not read, --base-max-steps 0)
    while steps + chunk <= args.base_max_steps and (decided := ppo.copy_accuracy(actor, probe)) < COPY_GATE:
        train(chunk, 10_000 + args.seed * 1000 + steps)
        steps += chunk
    gate = {"copy_accuracy": round(ppo.copy_accuracy(actor, data.copy_samples(tokenizer, items, 64, -1 - args.seed)),
                                   4), "steps": steps, "items": len(items)}
    low = ("" if gate["copy_accuracy"] >= COPY_GATE else  # the two 64-sample probes differ by a few points
           " WARNING: below the gate (--base-max-steps allows more)" if decided is None or decided < COPY_GATE else
           f" (below the gate on this probe; the probe that decided read {decided:.3f})")
    log(run.dir, f"base: {steps} copy steps over {len(items)} items; copy accuracy {gate['copy_accuracy']:.3f} "
                 f"(gate {COPY_GATE})" + low)
    return gate


def warm_start(run: Run, train_pool: list, heldout: list) -> None:
    """Base phase (--base-steps) and SFT warm start into ckpt/base and ckpt/sft (the reference trajectories run in
    this process: no engine needed). With --n-sft-tasks the SFT pool is those fresh tasks alone, none sharing an
    instruction with the RL pool or the held-out pool (RL then trains on tasks SFT never saw)."""
    args, run_dir, sft_dir = run.args, run.dir, run.sft_dir
    sft_pool = list(train_pool)
    if args.n_sft_tasks:
        extra, _ = data.generate_tasks(run_dir / "tasks" / "sft", args.n_sft_tasks, 0, args.seed + 1,
                                       validate_tasks=False, rst_rounds=args.rst_rounds, expert_text=args.expert_text,
                                       rst_share=args.sft_rst_share)
        taken = {task_io.load_task(d).instruction for d in list(heldout) + list(train_pool)
                 + run.state["tasks"].get("val", [])}
        sft_pool = [d for d in extra if task_io.load_task(d).instruction not in taken]
    texts = data.corpus(sft_pool)
    log(run_dir, f"held-out vs the SFT pool: {data.overlap(sft_pool, heldout)}; vs the RL pool: "
                 f"{data.overlap(train_pool, heldout)}")
    tokenizer = M.train_tokenizer(texts, vocab_size=args.vocab_size)
    tp = parallel_plan(args)["tp"] if args.backend == "megatron" else 1  # vocab-parallel rows split evenly
    actor = M.build_actor(M.tiny_config(M.padded_vocab(len(tokenizer), tp), args.arch), seed=args.seed)
    if args.base_steps:
        run.state["base"] = run.timed("base", lambda: base_phase(run, actor, tokenizer, texts))
        save_dir(actor, tokenizer, run_dir / "ckpt" / "base")
    trials, _, _ = run_rollouts(sft_pool, "scripted", args, run_dir, tokenizer, desc="sft data")

    def resolved(trials):  # in task order, not the order the concurrent trials finished in, so that --seed fixes
        # SFT's minibatch order (in finishing order two runs of one seed reached held-out 0.593 and 0.773); two runs of
        # one seed still reached 0.507 and 0.593 (cause not found: RESULTS.md 12-03; the digest below tells)
        return sorted((t for t in trials if t["resolved"]), key=lambda t: t["task"])
    samples = rollout.to_samples(resolved(trials), run_dir, "sft")  # the verifier audits them
    log(run_dir, f"sft: {len(samples)} reference trajectories of {len(sft_pool)} tasks, "
                 f"{sum(int(s['loss_mask'].sum()) for s in samples)} loss tokens")
    if args.sft_faults:  # recoveries: a share of the tasks again, one fault turn in each, trained after it only
        again = random.Random(args.seed).sample(sft_pool, round(args.sft_faults * len(sft_pool)))
        faulted, _, _ = run_rollouts(again, "scripted", args, run_dir, tokenizer, desc="sft faults", script_faults=1.0)
        extra = rollout.after_faults(rollout.to_samples(resolved(faulted), run_dir, "sft"))
        log(run_dir, f"sft faults: {len(extra)} of {len(again)} tasks replayed with a fault turn resolved, "
                     f"{sum(int(s['loss_mask'].sum()) for s in extra)} loss tokens after their faults")
        samples += extra
    path = run_dir / "samples" / "sft.jsonl"  # what SFT trains on, in its order; the digest compares two runs
    tito.save_samples(path, samples)
    log(run_dir, f"sft samples: {path} sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}")
    ppo.sft(actor, samples, args, run.metrics)
    save_dir(actor, tokenizer, sft_dir)


def save_dir(actor, tokenizer, path: Path) -> None:
    """A checkpoint renamed into place: the directory exists only complete."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_checkpoint(actor, tokenizer, tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def start_actors(run: Run, ax: SimpleNamespace) -> None:
    """Ray actors: the trainer (actor + critic), the engines, the rollout workers; filled into ax as they start
    (train() stops whatever started)."""
    args, ray, place, sft_dir = run.args, ax.ray, ax.place, str(run.sft_dir)
    cores = infra.core_split()[1] if args.pin_cores else None  # the rollout side's half (--pin-cores)
    ax.engines = [ray.remote(server.EngineActor).options(**place["engines"][i]).remote(
        sft_dir, args.engine_weight_dtype, actor_threads(args), cores=cores) for i in range(ax.n_eng)]
    ax.trainer = ppo.TrainerGroup(ray, args, sft_dir, run.state["step"], place["trainers"])
    ax.workers = rollout.ray_rollout_workers(args.rollout_actors, math.ceil(args.rollout_workers / args.rollout_actors),
                                             sft_dir, place["workers"], cores)
    infos = ray.get([e.info.remote() for e in ax.engines])
    ax.urls = ax.ext_urls or [i["url"] for i in infos]
    ranks = ray.get([t.pid.remote() for t in ax.trainer.ranks])
    log(run.dir, f"ray actors: trainer pid {ranks[0]}, other trainer ranks pids {ranks[1:]}, "
                 f"engines {infos or ax.urls}, rollout workers pids {ray.get([w.pid.remote() for w in ax.workers])}")
    sizes = [int(x) for x in args.engine_world_sizes.split(",") if x]  # cluster: weights over one process group
    ray.get(ax.trainer.connect_engines.remote(ax.urls, sizes))  # else the engines load ckpt/latest from disk
    log(run.dir, f"publish: {'over one process group to engine ranks ' + str(sizes) if sizes else 'from disk'}")


def engines_memory(run: Run, ax: SimpleNamespace, action: str, tags=None) -> None:
    """--colocate: every engine releases ("release") or takes back ("resume") its device memory, SGLang's tags
    ("weights", "kv_cache"; None: both)."""
    for u in ax.urls:
        client = rollout.EngineClient(u)
        out = client.release_memory(tags) if action == "release" else client.resume_memory(tags)
        if not out.get("success"):
            raise RuntimeError(f"engine {u}: {action} memory {tags or 'all'}: {out}")
    log(run.dir, f"engines {action} memory: {', '.join(tags or engine.MEMORY_TAGS)}")


def publish(run: Run, ax: SimpleNamespace, version: int) -> None:
    """Publish barrier: pause generation, the engines get weights `version`, resume; the trainer keeps a copy."""
    ax.ray.get(ax.trainer.publish.remote(version))


def evaluate_checkpoint(run: Run, ax: SimpleNamespace, tokenizer, train_pool: list, heldout: list, ck: str) -> None:
    """Held-out evaluation (and on the first training tasks) of ck: "base" (held-out only) and "sft" once, "rl" after
    the last RL step (again when a resume added steps); the engines serve its weights."""
    args, state = run.args, run.state

    def ev(dirs, tag):
        return evaluate(dirs, args, run.dir, tokenizer, ax.workers, ax.urls, tag)
    base = run.dir / "ckpt" / "base"
    if ck == "base" and "eval_base" not in state and state["step"] == 0 and (base / "config.json").exists():
        rollout.publish_from_disk(ax.urls, base, 0)  # the base model's weights for its evaluation, then SFT's again
        state["eval_base"] = run.timed("eval_base", lambda: ev(heldout, "base"))
        rollout.publish_from_disk(ax.urls, run.sft_dir, 0)
        run.save_state()
        log(run.dir, f"eval of the base model: {brief(state['eval_base'])}")
    if ck == "sft" and "eval_sft" not in state:
        state["eval_sft"] = run.timed("eval_sft", lambda: ev(heldout, "sft"))
        eval_row(run, state["eval_sft"], 0)
        state["eval_sft_train"] = run.timed("eval_sft", lambda: ev(train_pool[:args.eval_train_tasks], "sft train"))
        run.save_state()
    if ck == "rl" and state["step"] == 0 and "eval_rl" not in state:  # no RL step: the SFT weights, evaluated
        state["eval_rl"] = {**state["eval_sft"], "after_step": 0}
        state["eval_rl_train"] = state["eval_sft_train"]
        run.save_state()
    if ck == "rl" and state.get("eval_rl", {}).get("after_step") != state["step"]:
        # the step's evaluations first, then the state (run.timed saves it): a kill among them redoes them all
        held = run.timed("eval_rl", lambda: ev(heldout, "rl"))
        val = state["tasks"].get("val")
        val_ev = run.timed("eval_rl", lambda: ev(val, "rl val")) if val else None
        train_ev = run.timed("eval_rl", lambda: ev(train_pool[:args.eval_train_tasks], "rl train"))
        state["eval_rl"], state["eval_rl_train"] = {**held, "after_step": state["step"]}, train_ev
        eval_row(run, state["eval_rl"], state["step"], val_ev)
        run.save_state()
        log(run.dir, f"eval after RL: {brief(state['eval_rl'])}")


def warm_up_critic(run: Run, ax: SimpleNamespace, tokenizer, train_pool: list) -> None:
    """Critic Warm-Up on SFT-policy rollouts (step 0), or on resume the engines get the last step's weights."""
    args, state = run.args, run.state
    if args.colocate:  # a run killed during an update may have left the engines released (a no-op otherwise),
        engines_memory(run, ax, "resume")  # their weights storage back but not its contents: reloaded below (the
        if state["step"] == 0:  # publish of the last step), here the SFT weights from disk
            for u in ax.urls:
                rollout.EngineClient(u).update_weights_from_disk(run.sft_dir, weight_version=0)
    if state["step"] > 0:
        publish(run, ax, state["step"])  # the engines serve the weights of the last finished step
        log(run.dir, f"resumed at RL step {state['step']}")
    else:
        ax.ray.get(ax.trainer.mark_published.remote(0))  # the engines serve the SFT weights
        if "critic_warmup" not in state:
            def do_warmup():
                if args.critic_warmup_epochs == 0 or args.advantage == "grpo":  # cold start (the paper's ablation:
                    return []  # EV from -33.6), or no critic at all (GRPO)
                pool = [train_pool[i % len(train_pool)] for i in range(args.critic_warmup_trials)]
                trials, _, _ = run_rollouts(pool, "model", args, run.dir, tokenizer, ax.workers, ax.urls,
                                            desc="warm-up pool")
                if args.colocate:  # the engines keep the SFT weights (nothing to publish before step 1)
                    engines_memory(run, ax, "release", ["kv_cache"])
                recs = ax.ray.get(ax.trainer.warmup.remote(rollout.to_samples(trials, run.dir, "warmup")))
                if args.colocate:
                    engines_memory(run, ax, "resume", ["kv_cache"])
                for i, r in enumerate(recs):
                    run.metrics.write(r, i + 1, "critic_warmup")
                return [r["explained_variance"] for r in recs]
            state["critic_warmup"] = {"explained_variance": run.timed("critic_warmup", do_warmup)}
            run.save_state()
    log(run.dir, f"critic warm-up EV per update: {state.get('critic_warmup', {}).get('explained_variance')}")


def step_samples(run: Run, ro: dict, step: int, want_staleness: int) -> tuple[list, dict, int]:
    """4. TITO assembly of a step's trials -> samples on disk (audited), the oversampling's cut tasks recorded;
    checks that every sample comes from one weight version, want_staleness behind the trainer."""
    samples = rollout.to_samples(ro["trials"], run.dir, f"step{step}", replay=run.args.r3_mode == "replay")
    with open(run.dir / "dropped.jsonl", "a") as f:  # oversampling: which tasks were cut, after how long
        for d in ro["dropped"]:
            f.write(json.dumps({"step": step, **d}) + "\n")
    tito.save_samples(run.dir / "samples" / f"step_{step:06d}.jsonl", samples)
    audit = rollout.audit_samples(samples, step)  # after the save, so that a failing audit can be read back
    versions = sorted({int(s["weight_version"]) for s in samples if s["weight_version"] is not None})
    staleness = (step - 1) - versions[0] if versions else 0  # trainer version minus sample version
    assert not versions or (len(versions) == 1 and staleness == want_staleness), \
        f"step {step}: samples of weight versions {versions}, staleness {staleness}, expected {want_staleness}"
    if not samples:
        log(run.dir, f"step {step}: no trainable trajectory; recorded, no update")
    return samples, audit, staleness


def engine_errors_500(urls) -> int | None:
    """HTTP 500s the engines have answered since they started (the embedded engine's /get_server_info counts them and
    logs each with its traceback); None where an engine does not count them (SGLang: its own log) or cannot answer."""
    total = 0
    for url in urls or ():
        try:
            n = rollout.EngineClient(url).server_info().get("errors_500")
        except (OSError, RuntimeError, ValueError):
            return None
        if not isinstance(n, int):
            return None
        total += n
    return total


def prefix_cache_frac(trials: list) -> float:
    """Prompt tokens the engines took from their prefix cache / prompt tokens sent, over the trials' turns (NaN when
    no engine reported cached_tokens)."""
    recs = [r for t in trials for r in t.get("records", []) if r.get("cached_tokens") is not None]
    sent = sum(len(r["prompt_ids"]) for r in recs)
    return sum(r["cached_tokens"] for r in recs) / sent if sent else float("nan")


# a step where this share of the replies broke the format is logged as a WARNING: at T = 1 the embedded SFT model's
# replies are refused 37-57% of the time (run r6, per 8 steps), in r6's collapse 80-87% (RESULTS.md)
INVALID_ALARM = 0.75


def invalid_reply_frac(trials: list) -> float:
    """Share of the step's agent replies the harness refused as not one JSON object of the format; its rise is how a
    format collapse shows (run r6 continued: 0.45-0.55 before, 0.61 / 0.70 / 0.80 at steps 120-122, reward 0 after).
    Trials whose harness did not count (an agent behind the gateway parses its own replies) are left out; NaN when
    no trial counted, 0 when the counted trials took no turn."""
    counted = [t for t in trials if "invalid_replies" in t]
    if not counted:
        return float("nan")
    turns = sum(t["turns"] for t in counted)
    return sum(t["invalid_replies"] for t in counted) / turns if turns else 0.0


def step_record(ro: dict, samples: list, stats: dict, audit: dict, **timing) -> dict:
    """The metrics.jsonl row of an RL step (names in the README)."""
    trials = ro["trials"]
    return {"reward_mean": 0.0,  # no sample: nothing trained on; else train_step's (the rewards it trained on)
            "solve_rate": float(np.mean([t["resolved"] for t in trials])) if trials else 0.0,
            # r = P / S whatever the arm trains on (--reward-mode binary's reward_mean is its 0 / 1 reward)
            "reward_dense_mean": float(np.mean([s["reward"] for s in samples])) if samples else 0.0,
            **stats, **audit, "n_launched": ro["n_launched"], "n_kept": len(trials), "n_dropped": len(ro["dropped"]),
            "turns_mean": float(np.mean([s["turns"] for s in samples])) if samples else 0.0,
            "tokens_mean": float(np.mean([len(s["tokens"]) for s in samples])) if samples else 0.0,
            "invalid_reply_frac": invalid_reply_frac(trials),
            "rollout_tokens_per_s": ro["tok_s"], "prefix_cache_frac": prefix_cache_frac(trials),
            "time_rollout": ro["t_rollout"], **timing}


def rl_loop(run: Run, ax: SimpleNamespace, tokenizer, train_pool: list, heldout: list) -> None:
    """RL: PPO steps, the paper's step list. One-step async: the rollout of step t+1 runs beside the update of
    step t, with weights t-1 (staleness exactly 1); the first step of a process is sampled synchronously.
    --eval-every K: held-out evaluation (and the validation set's) after every K-th publish (nothing else is in
    flight then: the next step's rollout finished beside the update), a metrics row of phase "eval" (curves.png)."""
    args, state = run.args, run.state
    first_step, val = state["step"] + 1, state["tasks"].get("val")

    def ev(dirs, tag):  # an evaluation (held-out, validation) of the weights the engines serve
        return evaluate(dirs, args, run.dir, tokenizer, ax.workers, ax.urls, tag)

    def rollout_step(step):  # 1-3. tasks of this step, trials with oversampling (keep the first n_keep)
        launch = data.launch_tasks(train_pool, step, args.n_launch // args.samples_per_task, args.seed,
                                   args.samples_per_task)  # every task once per epoch, G times in its step
        t0 = time.time()
        trials, dropped, tok_s = run_rollouts(launch, "model", args, run.dir, tokenizer, ax.workers, ax.urls,
                                              n_keep=args.n_keep, desc=f"rollout step {step}")  # r = P / S per trial
        return {"trials": trials, "dropped": dropped, "tok_s": tok_s, "n_launched": len(launch),
                "t_rollout": time.time() - t0}

    def overlapped(t):  # was step t sampled beside the update of step t-1? (then staleness is exactly 1)
        return args.async_rollout and t > first_step and t > args.sync_steps

    ro = None
    while state["step"] < args.rl_steps:
        step = state["step"] + 1
        t_step = time.time()
        # ALGO LOGIC: 1-3. rollout of step t (its reward r = P / S per trial), unless it ran beside the last update
        if ro is None:  # sequential: sample with the weights of the last update
            ro = rollout_step(step)
        t_wait = time.time() - t_step
        # ALGO LOGIC: 4. TITO samples (audited, on disk)
        samples, audit, staleness = step_samples(run, ro, step, 1 if overlapped(step) else 0)
        # ALGO LOGIC: 5-6. on the trainer actor: V_old -> GAE -> critic update -> old logprobs -> actor (R3 replay)
        # One-step async (paper): the trainer actor updates on step t (5-6, checkpoint included) while the
        # rollout workers sample step t+1 with weights t-1 (staleness 1); at the barrier (both done) weights t
        # are published, so step t+2 samples with weights t.
        if args.colocate:  # the device to the trainer: the engines free their weights and KV cache
            engines_memory(run, ax, "release")
        update = ax.trainer.train_step.remote(samples, step)
        ro_next = rollout_step(step + 1) if step < args.rl_steps and overlapped(step + 1) else None
        stats = ax.ray.get(update)
        # ALGO LOGIC: 7. publish weights t to the engines (the barrier)
        t0 = time.time()
        if args.colocate:  # as slime: weights memory back, the new weights in, then the KV cache
            engines_memory(run, ax, "resume", ["weights"])
        publish(run, ax, step)
        if args.colocate:
            engines_memory(run, ax, "resume", ["kv_cache"])
        t_publish = time.time() - t0
        # plumbing: the step's row, then the commit point
        rec = {"weight_version": step, "staleness": staleness, "sampled_beside_update": overlapped(step),
               "rollout_beside_update": ro_next is not None,
               **step_record(ro, samples, stats, audit, time_rollout_wait=t_wait, time_publish=t_publish,
                             time_step=time.time() - t_step)}
        rec["engine_errors_500"] = engine_errors_500(ax.urls)  # since the engines started; each one a lost trial
        if rec["engine_errors_500"]:
            log(run.dir, f"WARNING step {step}: the engines have answered {rec['engine_errors_500']} HTTP 500s since "
                         "they started (each lost a trial; tracebacks in the engines' stderr)")
        run.metrics.write(rec, step, "rl")
        if args.eval_every and step % args.eval_every == 0 and step < args.rl_steps:  # the last: evaluate_checkpoint
            eval_row(run, ev(heldout, f"step {step}"), step, ev(val, f"val step {step}") if val else None)
        state["step"] = step
        state["phase_times"]["rl"] = state["phase_times"].get("rl", 0.0) + rec["time_step"]
        run.save_state()  # commits step k: its checkpoint, metrics row and samples (resume_run)
        prune_previous(run.dir)
        log(run.dir, f"step {step}: reward {rec['reward_mean']:.3f} solve {rec['solve_rate']:.2f} "
                     f"EV {rec.get('explained_variance', float('nan')):.3f} "
                     f"|dlogp| {rec.get('dlogp', float('nan')):.4f} "
                     f"(R3 off {rec.get('dlogp_r3_off', float('nan')):.4f}) staleness {staleness} "
                     f"{rec['time_step']:.0f}s")
        if rec["invalid_reply_frac"] >= INVALID_ALARM:
            log(run.dir, f"WARNING step {step}: {rec['invalid_reply_frac']:.0%} of the agent's replies broke the "
                         "reply format (invalid_reply_frac): how a format collapse starts (RESULTS.md, run r6 "
                         "continued); --kl-coef adds a KL penalty to the SFT policy")
        ro = ro_next


def train(args: Args) -> dict:
    """The whole run: tasks -> SFT -> actors -> eval SFT -> critic warm-up -> RL -> eval RL; resumable."""
    run = Run(args)
    args, state = run.args, run.state
    train_pool, heldout = make_tasks(run)
    args = run.args  # with the run's S
    if not (run.sft_dir / "config.json").exists():
        run.timed("sft", lambda: warm_start(run, train_pool, heldout))
    tokenizer = AutoTokenizer.from_pretrained(str(run.sft_dir))

    ext_urls = [u for u in args.engine_urls.split(",") if u]
    n_eng = 0 if ext_urls else args.n_engines
    ray = infra.ray_start(args.trainer_ranks + n_eng + args.rollout_actors, args.ray_address, actor_threads(args))
    pgs, place = infra.ray_layout(n_eng, args.rollout_actors, n_trainers=args.trainer_ranks)
    ax = SimpleNamespace(ray=ray, place=place, ext_urls=ext_urls, n_eng=n_eng, engines=[], trainer=None)
    try:
        start_actors(run, ax)
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "base")  # with a base phase
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "sft")
        log(run.dir, f"eval after SFT: {brief(state['eval_sft'])}")
        warm_up_critic(run, ax, tokenizer, train_pool)
        rl_loop(run, ax, tokenizer, train_pool, heldout)
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "rl")  # the engines serve the final weights
    finally:
        for h in ax.engines + ([ax.trainer] if ax.trainer is not None else []):
            try:
                ray.get((h.close if h is ax.trainer else h.stop).remote(), timeout=30)
            except Exception:
                pass
        infra.ray_stop(pgs)
        run.metrics.tb.close()

    summary = {"eval_base": state.get("eval_base"), "copy_gate": state.get("base"), "eval_sft": state["eval_sft"],
               "eval_rl": state["eval_rl"], "eval_sft_train": state["eval_sft_train"],
               "eval_rl_train": state["eval_rl_train"], "phase_times": state["phase_times"],
               "eval_rl_best_val": bench.best_val(run.dir),
               "rl_steps": state["step"], "async_vs_sequential": bench.async_vs_sequential(run.dir)}
    write_atomic(run.dir / "summary.json", json.dumps(summary, indent=1))  # experiments.paper reads it: an arm's end
    bench.plot(run.dir)
    bench.print_table(summary)
    return summary


def parse_args(argv=None) -> Args:
    """Every Args field is a flag (--field-name); --preset / --quick / --full pick the base values."""
    p = argparse.ArgumentParser(description="T1 PPO training (embedded by default)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="embedded")
    p.add_argument("--quick", action="store_true", help="the quick preset (smoke run)")
    p.add_argument("--full", action="store_true", help="the full preset (150 held-out tasks, 48 RL steps; ~1-2 h)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir (the default when it exists)")
    def boolean(v: str) -> bool:
        if v.lower() not in ("true", "false", "1", "0"):
            raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")
        return v.lower() in ("true", "1")

    for f in dataclasses.fields(Args):
        kind = boolean if isinstance(f.default, bool) else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None)
    ns = p.parse_args(argv)
    if ns.quick and ns.full:
        p.error("--quick and --full: pick one preset")
    base = PRESETS["quick" if ns.quick else "full" if ns.full else ns.preset]
    args = dataclasses.replace(base, **{f.name: getattr(ns, f.name) for f in dataclasses.fields(Args)
                                        if getattr(ns, f.name) is not None})
    if ns.reward_scale is not None and ns.reward_scale_from_pool is None:  # an S given by hand is the run's S
        args = dataclasses.replace(args, reward_scale_from_pool=False)
    try:
        check_numbers(args)  # a bad number is a usage error (exit 2, no traceback); train() runs check_args whole
    except ValueError as e:
        p.error(str(e))
    return args


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "plot":
        print(bench.plot(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "paper":  # the paper's comparisons: experiments/paper.py run
        paper.main(["run", *sys.argv[2:]])
    elif len(sys.argv) > 1 and sys.argv[1] == "trainer-bench":  # bench.trainer_bench with this file's Args
        tb = argparse.ArgumentParser(prog="train_t1.py trainer-bench")
        tb.add_argument("--shape", default="t1-tiny")
        tb.add_argument("--tokens", type=int, default=256)
        tb.add_argument("--samples", type=int, default=4)
        tb.add_argument("--steps", type=int, default=2)
        ns, rest = tb.parse_known_args(sys.argv[2:])
        print(json.dumps(bench.trainer_bench(parse_args(rest), ns.shape, ns.tokens, ns.samples, ns.steps)))
    else:
        train(parse_args())
