"""T1: PPO with a full-size critic that turns a Qwen3.5-MoE model into a terminal agent.

Paper: "T1: Terminal Agent Reinforcement Learning for Long-Horizon Tasks" (arXiv 2609.11042), the optimisation
section. One RL step (rl_loop), read top to bottom:

    1-3. rollout (Terminus-2 in a sandbox, oversampled), reward r = P / S -> 4. TITO samples -> 5. V_old ->
    GAE (gamma = lambda = 1) -> critic update (first, lr 1.5e-5) -> 6. old logprobs and PPO actor update, both with
    R3 replay, checkpoint -> 7. publish (one-step async: the rollout of step t+1 overlaps the update of step t)

preceded by an SFT warm start on reference trajectories and one epoch of Critic Warm-Up, followed by the evaluation
on the test splits (runstate.SPLITS). Steps 5-6 run on the trainer actor (trainer.py: ppo.train_step); the Ray actors
start in cluster/actors.py; the run's bookkeeping (run dir, flag checks, evaluations, step rows) is runstate.py.

Run:
    bash run.sh                                   # embedded preset, this machine (CPU)
    bash run.sh --quick                           # smoke-test preset, a few minutes (--deterministic: to the digit)
    bash run.sh --full                            # RST tasks, 48 RL steps on 1,152, three test splits (~1-2 h)
    python train_t1.py --run-dir runs/x --rl-steps 5 --actor-lr 2e-5   # any Args field as a flag (--help: all)

A run directory holds tasks/, ckpt/, samples/ (TITO records), evals/, metrics.jsonl, tb/, curves.png, summary.json,
log.txt and state.json, the commit point: the same --run-dir resumes, no step applied twice (rundir.resume_run).

Departures from the paper (numbered; what and why; the update's own are in ppo.py, the trainer's in trainer.py):
  1. Scale: the embedded preset trains a tiny random-init MoE on synthesized shell tasks, sized for 2 CPU cores
     (EMBEDDED); the paper's values are Args' defaults, used by the cluster presets. S = the pool's 90th
     percentile of assertion counts (the paper's rule, which gives 20 on T1-15k).
  2. One-step async on Ray actors (cluster/actors.py, infra.py); 2 shared cores cannot give the paper's speed-up. A
     process samples its first step synchronously (staleness 0), --sync-steps N the first N.
  3. SFT data: scripted reference trajectories (the paper's are not public) of --n-sft-tasks fresh tasks disjoint
     from every other pool (0: the RL pool's); --sft-faults adds recoveries after one untrained wrong turn.
  4. --backend megatron: Megatron-Core models (cluster.mcore.trainer_models), on the CPU through cluster/mcore_cpu.py's
     shims with cluster.mcore_parallel.ShardedAdam, on CUDA with TE and DeepEP (run once on one H200, 2026-12-04).
  5. Task draw: n_launch consecutive tasks of a stream of per-epoch shuffles: no step is short (data.launch_tasks).
  6. Evaluation: the paper's protocol (rollout.EVAL) through the native token-first harness, not Terminus-2 via
     Harbor (`python -m engine.gateway eval`); the embedded preset runs 1 attempt, 8 turns, 120 s (EMBEDDED).
  7. The embedded model is Qwen3-MoE (--arch qwen3_moe), not Qwen3.5's hybrid: at this size the hybrid does not
     learn to copy (results/LOG.md); --arch qwen3_5_moe stays tested; the cluster model stays Qwen3.5.
  8. A base phase (--base-steps, embedded only): synthetic copy pretraining of corpus pieces before SFT, standing in
     for the pretrained model the paper starts from (`python -m experiments.bench copy`); random names among them
     (--base-name-share) are off: half of them cost SFT ~30 points in-template, and unseen names stayed at 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import io
import json
import math
import random
import time
import tokenize
from dataclasses import dataclass

import reward  # standard library only: S of r = P / S


@dataclass
class Args:
    """Defaults are the paper's values (cluster scale), the presets below shrink them; a comment is its flag's help."""
    run_dir: str = "runs/embedded"  # checkpoints, samples and metrics go here; the same dir resumes (paper silent)
    seed: int = 1  # seed of task synthesis, init, sampling and data order (paper silent)
    deterministic: bool = False  # trials one at a time in launch order: a seed reruns to the digit, slower (ours)
    # --- data (paper: T1-15k, quality-ordered, reshuffled per epoch)
    n_train_tasks: int = 15000  # training pool size (paper: T1-15k)
    n_heldout_tasks: int = 89  # in-template test split: unseen instances (paper: Terminal-Bench 2.1, 89 tasks)
    n_deep_tasks: int = 0  # out-of-template test split: RST depth 2-3 where training's is <= 1 (ours; paper: TB 2.1)
    n_names_tasks: int = 0  # test split of in-template tasks with names and values unseen in training (ours)
    n_sft_tasks: int = 0  # fresh tasks synthesized for the SFT warm start alone; 0: the training pool (paper silent)
    rst_rounds: int = 0  # RST steps added to every synthesized task (families.rst_extend; paper silent on the count)
    sft_rst_share: float = 1.0  # share of the SFT pool's tasks that carry the rst_rounds steps (paper silent)
    sft_names_share: float = 0.0  # share of the SFT pool's tasks with made-up names (tasks/copying.random_vocab) (ours)
    validate_train: bool = True  # audit the training pool in sandboxes too (held-out: always) (paper: every task)
    expert_text: str = "full"  # the SFT expert replies' free text: full | terse | restate (paper silent)
    # --- model
    arch: str = "qwen3_5_moe"  # embedded model: qwen3_5_moe (hybrid GDN + gated attention) | qwen3_moe (paper: hybrid)
    vocab_size: int = 2048  # embedded tokenizer size (paper: Qwen3.5's 248,320-token vocabulary)
    # --- rollout (paper: 1 trajectory per task; launch 560, keep the first 512 finished)
    n_launch: int = 560  # trials launched per RL step (paper: 560)
    n_keep: int = 512  # first finished trials kept per RL step (paper: 512)
    temperature: float = 1.0  # sampling temperature of training rollouts (paper: 1)
    top_p: float = 1.0  # nucleus sampling of training rollouts (paper silent)
    max_turns: int = 300  # turn limit of one trial (paper: 300+ tool-call turns per task)
    max_new_tokens: int = 8192  # tokens per model reply (paper's evaluation: 8,192 output tokens)
    max_total_tokens: int = 56000  # context budget of one trajectory (paper's evaluation: 56k input)
    trial_timeout_s: float = 3600.0  # agent limit of a training trial (paper silent; its evaluation's 3600 s)
    rollout_workers: int = 64  # concurrent trials (paper silent)
    trial_mem_bytes: int = 2 << 30  # memory cap of a trial's processes + files, a cgroup; 0: per process (paper silent)
    trial_disk_bytes: int = 1 << 30  # bytes a trial may write, its tmpfs; task.toml storage_mb lowers it (paper silent)
    trial_disk_inodes: int = 100_000  # files a trial may create (paper silent)
    trial_keep_bytes: int = 16 << 20  # run_dir/trials keeps a trial's files up to this, else its logs (paper silent)
    # --- evaluation (the paper's protocol, rollout.EVAL; every trial counts: rollout.evaluate_trials)
    eval_temperature: float = 0.1  # evaluation temperature (paper: 0.1)
    eval_top_p: float = 0.95  # evaluation top-p (paper: 0.95)
    eval_attempts: int = 3  # attempts per held-out task, a failed trial counts 0; 0: no evaluation (paper: 3)
    eval_max_turns: int = 60  # turn limit of an evaluation trial (paper: 60)
    eval_agent_timeout_s: float = 3600.0  # agent limit of an evaluation trial, replacing the task's (paper: 3600 s)
    eval_verifier_timeout_s: float = 900.0  # verifier limit of an evaluation trial, replacing the task's (paper: 900 s)
    eval_train_tasks: int = 0  # also evaluate on this many training tasks (paper silent)
    eval_every: int = 0  # validation-split evaluation every this many RL steps; 0: after RL only (paper silent)
    n_val_tasks: int = 0  # validation split: every choice of recipe is made on it, not on a test split (paper silent)
    # --- reward
    reward_scale: float = float(reward.SCALE)  # S in r = P / S, fixed for the whole run (paper: 20)
    reward_scale_from_pool: bool = False  # S = the 90th percentile of this pool's assertion counts (paper's rule)
    # --- SFT warm start
    sft_epochs: int = 1  # epochs over the reference trajectories (paper silent)
    sft_lr: float = 1e-5  # SFT learning rate (paper silent)
    sft_batch_size: int = 8  # trajectories per SFT step (paper silent)
    sft_faults: float = 0.0  # share of SFT tasks replayed with an untrained wrong turn, trained after it (paper silent)
    # --- base phase (embedded only: the paper starts from pretrained Qwen3.5; 0 = none, the paper's case)
    base_steps: int = 0  # steps of synthetic copy pretraining before SFT (paper: none)
    base_lr: float = 2e-3  # the base phase's learning rate (paper: none; ppo.BASE_LR)
    base_batch_size: int = 16  # copy samples per base step (paper: none; ppo.BASE_BATCH)
    base_name_share: float = 0.0  # share of random name-shaped strings among the copied items (ours; departure 8)
    base_max_steps: int = 0  # below the copy gate, more base steps up to this many; 0: base_steps only (paper: none)
    # --- critic (paper: full-size, Critic Warm-Up one epoch, lr 1.5e-5, updated first, value clip 0.2)
    critic_warmup_epochs: int = 1  # critic-only epochs before RL (paper: Critic Warm-Up, one epoch)
    critic_warmup_trials: int = 512  # rollouts of the SFT policy that form the warm-up pool (paper silent)
    critic_lr: float = 1.5e-5  # critic learning rate (paper: 1.5e-5; its "30x the actor's" would be 3e-5)
    critic_head_init: str = "zero"  # value head: zero (predicts 0 until trained) | default (random) (paper silent)
    clip_eps_v: float = 0.2  # value clip around V_old (paper: eps_v = 0.2)
    # --- PPO (paper: clip 0.2, gamma = lambda = 1, KL off, load balancing off, no schedule / entropy / shaping)
    rl_steps: int = 58  # RL steps (paper: 58 logged steps in the production run)
    stop_after: str = ""  # sft: end once the SFT checkpoint is written (an SFT-only run, --model-path input) (ours)
    actor_lr: float = 1.0e-6  # actor learning rate (paper: 1.0e-6, constant)
    clip_eps: float = 0.2  # PPO ratio clip (paper: 0.2)
    gamma: float = 1.0  # discount (paper: 1)
    lam: float = 1.0  # GAE lambda (paper: 1)
    # ablation arms of the paper's comparisons (experiments/paper.py); the defaults are the paper's method
    reward_mode: str = "dense"  # dense: r = P / S | binary: 1 if every test passed, else 0 (paper: dense)
    advantage: str = "gae"  # gae: GAE with the critic | grpo: (r - group mean) / group std, no critic (paper: gae)
    samples_per_task: int = 1  # trajectories per task in a step; grpo's group size G >= 2 (paper: 1)
    kl_coef: float = 0.0  # k3 KL to the frozen SFT policy on the m = 1 tokens, in the actor loss; hf only (paper: off)
    aux_loss_coef: float = 0.0  # MoE load-balancing loss of the actor's routers; hf only (paper: off)
    entropy_coef: float = 0.0  # entropy bonus on the m = 1 tokens, minus in the actor loss; hf only (paper silent)
    loss_agg: str = "token"  # loss reduction: token (mean over a minibatch's m = 1 tokens) | sample (paper silent)
    ppo_epochs: int = 1  # the actor's passes over each step's batch (paper silent)
    critic_epochs: int = 1  # the critic's passes over each step's minibatches, before the actor's (paper silent)
    minibatch_size: int = 64  # trajectories per optimizer step (paper silent)
    max_grad_norm: float = 1.0  # gradient clipping (paper silent)
    async_rollout: bool = True  # one-step async: sample step t+1 while training step t, staleness 1 (paper: on)
    colocate: bool = False  # trainer and engines share devices; needs --async-rollout false (paper: disjoint devices)
    sync_steps: int = 0  # the first sync_steps RL steps run sequentially (async vs sequential, one run; paper silent)
    pin_cores: bool = False  # trainer and rollout side on disjoint halves of the cores (paper: disjoint devices)
    r3_mode: str = "replay"  # routing in the trainer: replay (R3) | off (paper: replay)
    r3_off_every: int = 1  # the R3-off diagnostic forward (dlogp_r3_off, mismatch) every K RL steps; 0: never (ours)
    # --- engines, sandboxes, Ray
    engine_weight_dtype: str = "bf16"  # engine weights: bf16 (rounded: production-like mismatch) | fp32 (paper silent)
    n_engines: int = 1  # embedded engines started as Ray actors, ignored with engine_urls (paper silent)
    engine_urls: str = ""  # comma-separated SGLang-protocol servers already running; empty: start n_engines
    rollout_actors: int = 8  # Ray rollout-worker actors; rollout_workers trials are spread over them (paper silent)
    sandbox: str = "bwrap"  # bwrap (local jail) | daytona (cluster; needs DAYTONA_API_KEY) (paper: Daytona)
    ray_address: str = ""  # Ray cluster to join (or $RAY_ADDRESS); empty: start one on this machine for this run
    torch_threads: int = 0  # CPU threads of the trainer and of each embedded engine; 0: half the cores each if async
    # --- cluster (the flags `python -m cluster.launch launch` passes)
    backend: str = "hf"  # trainer: hf (transformers, this machine) | megatron (cluster/mcore.py; CPU or GPU)
    param_dtype: str = "fp32"  # the Megatron trainer's parameters: fp32 | bf16 with fp32 master shards (paper silent)
    model_path: str = ""  # start RL from this HF checkpoint (the paper's SFT model), not the embedded warm start
    plan: str = ""  # trainer layout: JSON of tp, pp, cp, ep, etp, dp, as `python infra.py plan` prints it
    engine_world_sizes: str = ""  # GPUs of each server in engine_urls (weights broadcast over NCCL)
    trainer_ranks: int = 1  # data-parallel trainer ranks (Ray actors, one torch.distributed group) when no --plan


COPY_GATE = 0.9  # the base phase should reach this greedy copy accuracy (`python -m experiments.bench copy`)

# Embedded presets: the paper's ratios kept where they mean something (critic lr = 30 x actor lr, clips, S by the
# 90th-percentile rule), sizes and lrs shrunk for 2 CPU cores, each saying why (measured: results/LOG.md).
EMBEDDED = dataclasses.replace(
    Args(), arch="qwen3_moe", base_steps=1000,  # departures 7 and 8: a model that can copy (gate .98 at 1,000)
    base_max_steps=2000,  # ... for most seeds: one seed read .825 at 1,000 (its SFT held-out .333 vs .607)
    n_train_tasks=120, n_heldout_tasks=30, n_launch=36, n_keep=32, max_turns=8,
    max_new_tokens=192, max_total_tokens=3072, trial_timeout_s=120.0, rollout_workers=12, rollout_actors=2,
    reward_scale_from_pool=True, eval_attempts=1, eval_train_tasks=30,
    # SFT on 600 fresh tasks, disjoint from RL and test (30 epochs over the RL pool memorised it)
    n_sft_tasks=600, sft_epochs=4, sft_lr=2e-3, sft_batch_size=8,
    # PPO for a ~2.5M-parameter model: actor lr 1e-4 (the paper's 1e-6 is for 122B), critic lr 30x (the paper's
    # ratio), 2 epochs of minibatches of 8; a 64-trial warm-up fits the 25-minute budget (--full warms on 512)
    critic_warmup_trials=64, rl_steps=8, actor_lr=1e-4, critic_lr=3e-3, minibatch_size=8, ppo_epochs=2,
    # evaluation (paper: 3 attempts, 60 turns, 3600 s): 1 attempt at the training limits (3,072 tokens fill ~8 turns)
    eval_max_turns=8, eval_agent_timeout_s=120.0)
# bash run.sh --full (each choice's figures: results/LOG.md): every task one RST step longer (S = 6: partial credit);
# RL on 1,152 fresh tasks, not sandbox-audited (no reject among hundreds audited); warm-up on 512 trials (fewer left
# EV ~0); T = 0.7 with a k3 KL of 0.05 to SFT (at the paper's T = 1 without KL the tiny model's format drifted); 48
# steps; SFT 8 epochs. Evaluation: the paper's 3 attempts on the three test splits (100 / 50 / 50), read after SFT
# and the last step only; the curve every 16 steps on the validation split (50), where such choices are now made.
FULL = dataclasses.replace(EMBEDDED, run_dir="runs/full", n_heldout_tasks=100, n_train_tasks=1152, rst_rounds=1,
                           validate_train=False, rl_steps=48, eval_every=16, critic_warmup_trials=512,
                           temperature=0.7, kl_coef=0.05, sft_epochs=8, n_val_tasks=50, n_deep_tasks=50,
                           n_names_tasks=50, eval_attempts=3, eval_train_tasks=0)
QUICK = dataclasses.replace(EMBEDDED, run_dir="runs/quick", n_train_tasks=24, n_heldout_tasks=6, n_launch=10, n_keep=8,
                            n_sft_tasks=16, eval_train_tasks=6, base_steps=20, base_max_steps=0, sft_epochs=2,
                            critic_warmup_trials=8, rl_steps=2, max_turns=5)
CLUSTER = dataclasses.replace(Args(), backend="megatron", param_dtype="bf16", sandbox="daytona", n_engines=0)
PRESETS = {"embedded": EMBEDDED, "full": FULL, "quick": QUICK, "paper": Args(),
           "qwen35-122b-a10b": dataclasses.replace(CLUSTER, run_dir="runs/qwen35-122b-a10b"),
           "qwen35-35b-a3b": dataclasses.replace(CLUSTER, run_dir="runs/qwen35-35b-a3b", colocate=True,
                                                 async_rollout=False)}


# The range of every numeric Args field: check_numbers refuses a value outside it, a non-finite float or a float for an
# int, naming the --flag and the value; a new numeric field goes here (tests/test_check_args.py fails without it).
RANGES = {">= 0": lambda v: v >= 0, ">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0,
          "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1}
NUMERIC = {
    "seed": ">= 0", "n_train_tasks": ">= 1", "n_heldout_tasks": ">= 1", "n_sft_tasks": ">= 0", "rst_rounds": ">= 0",
    "vocab_size": ">= 1", "n_launch": ">= 1", "n_keep": ">= 1", "temperature": "> 0", "top_p": "in (0, 1]",
    "max_turns": ">= 1", "max_new_tokens": ">= 1", "max_total_tokens": ">= 1", "trial_timeout_s": "> 0",
    "rollout_workers": ">= 1", "trial_mem_bytes": ">= 0", "trial_disk_bytes": ">= 1", "trial_disk_inodes": ">= 1",
    "trial_keep_bytes": ">= 0", "eval_temperature": ">= 0", "eval_top_p": "in (0, 1]", "eval_attempts": ">= 0",
    "eval_train_tasks": ">= 0", "eval_every": ">= 0", "n_val_tasks": ">= 0", "n_deep_tasks": ">= 0",
    "n_names_tasks": ">= 0", "reward_scale": "> 0", "sft_epochs": ">= 0", "sft_lr": ">= 0", "sft_batch_size": ">= 1",
    "sft_faults": "in [0, 1]", "sft_rst_share": "in [0, 1]", "sft_names_share": "in [0, 1]", "base_steps": ">= 0",
    "base_max_steps": ">= 0", "base_lr": "> 0", "base_name_share": "in [0, 1]", "base_batch_size": ">= 1",
    "critic_warmup_epochs": ">= 0", "critic_warmup_trials": ">= 1", "critic_lr": ">= 0", "clip_eps_v": "> 0",
    "rl_steps": ">= 0", "samples_per_task": ">= 1", "actor_lr": ">= 0", "clip_eps": "> 0", "gamma": "in [0, 1]",
    "lam": "in [0, 1]", "kl_coef": ">= 0", "aux_loss_coef": ">= 0", "entropy_coef": ">= 0", "ppo_epochs": ">= 1",
    "critic_epochs": ">= 1", "minibatch_size": ">= 1", "max_grad_norm": "> 0", "sync_steps": ">= 0",
    "r3_off_every": ">= 0", "n_engines": ">= 0", "rollout_actors": ">= 1", "torch_threads": ">= 0",
    "trainer_ranks": ">= 1", "eval_max_turns": ">= 1", "eval_agent_timeout_s": "> 0", "eval_verifier_timeout_s": "> 0"}


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


def field_help() -> dict:
    """Each Args field's comment (its line in the class above) -> {field: the flag's help line}."""
    src = inspect.getsource(Args)
    return {tok.line.split(":")[0].strip(): tok.string.lstrip("# ").strip()
            for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type == tokenize.COMMENT and tok.line[:tok.start[1]].strip() and ":" in tok.line}


def boolean(v: str) -> bool:
    if v.lower() not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")
    return v.lower() in ("true", "1")


def build_parser() -> argparse.ArgumentParser:
    """Every Args field is a flag (--field-name, its comment the help line); --preset / --quick / --full pick the
    base values (standard library only: --help answers before torch loads)."""
    p = argparse.ArgumentParser(description="T1 PPO training. Every Args field is a flag; the defaults shown are the "
                                "embedded preset's (--preset, --quick, --full pick another), the paper's values are "
                                "in each help line.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="embedded", help="base values (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="the quick preset: a smoke run (default: off)")
    p.add_argument("--full", action="store_true", help="the full preset: 150 held-out, 48 RL steps (default: off)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir (done anyway when it exists; default: off)")
    helps = field_help()
    for f in dataclasses.fields(Args):
        kind = boolean if isinstance(f.default, bool) else type(f.default)
        text = f"{helps[f.name]} (default: {getattr(EMBEDDED, f.name)!r})".replace("%", "%%")
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, help=text,
                       metavar=kind.__name__.upper())
    return p


def parse_args(argv=None) -> Args:
    """The command line -> Args: the preset's values, then every flag given."""
    p = build_parser()
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
    ARGV = parse_args()  # --help and bad flags answer here, before torch loads

from transformers import AutoTokenizer  # noqa: E402

import data  # noqa: E402
import model as M  # noqa: E402
import ppo  # noqa: E402
import report  # noqa: E402
import rollout  # noqa: E402
import tito  # noqa: E402
from cluster import actors  # noqa: E402
from engine.client import EngineClient  # noqa: E402
from tasks import copying  # noqa: E402
from rundir import log, prune_previous, write_atomic  # noqa: E402
from runstate import (Run, brief, check_flags, eval_row, evaluate, evaluate_checkpoint, log_step,  # noqa: E402
                      run_scale, save_dir, split_dirs, step_record)
from trainer import parallel_plan  # noqa: E402


def check_args(args: Args) -> None:
    """Bad flags fail before any work, naming the flag and what is wrong: the numbers (check_numbers), then the
    choices and combinations (runstate.check_flags: for the cluster, what is missing)."""
    check_numbers(args)
    check_flags(args)


# --- the run: one function per phase ------------------------------------------------------------------
def make_tasks(run: Run) -> tuple[list, list]:
    """Tasks: synthesize, audit by oracle (rollout_workers sandboxes at once), split train / in-template test (the
    "heldout" pool; once per run directory); then the out-of-template and unseen-names test splits (--n-deep-tasks,
    --n-names-tasks: data.eval_splits) and the validation split (--n-val-tasks), none sharing an instruction with
    any pool drawn before it (runstate.SPLITS: what each split is for)."""
    args, state = run.args, run.state
    kw = dict(rst_rounds=args.rst_rounds, expert_text=args.expert_text, workers=args.rollout_workers)
    if "tasks" not in state:
        train_dirs, heldout_dirs = run.timed("tasks", lambda: data.generate_tasks(
            run.dir / "tasks", args.n_train_tasks, args.n_heldout_tasks, args.seed,
            validate_train=args.validate_train, **kw))
        state["tasks"] = {"train": [str(d) for d in train_dirs], "heldout": [str(d) for d in heldout_dirs]}
        run.save_state()
    if (args.n_deep_tasks or args.n_names_tasks) and "test_deep" not in state["tasks"]:  # after the pools, as val
        ev = run.timed("tasks", lambda: data.eval_splits(
            run.dir / "tasks" / "eval", args.seed, 0, 0, args.n_deep_tasks, args.n_names_tasks,
            avoid=state["tasks"]["train"] + state["tasks"]["heldout"] + state["tasks"].get("val", []), **kw))
        state["tasks"].update({k: [str(d) for d in ev[k]] for k in ("test_deep", "test_names")})
        run.save_state()
    if args.n_val_tasks and "val" not in state["tasks"]:  # drawn after the pools (their tasks stay as they were)
        state["tasks"]["val"] = [str(d) for d in run.timed("tasks", lambda: data.validation_pool(
            run.dir / "tasks" / "val", args.n_val_tasks, args.seed,
            [d for k in ("train", "heldout", "test_deep", "test_names") for d in state["tasks"].get(k, [])],
            sft_dir=run.dir / "tasks" / "sft", **kw))]
        run.save_state()
    train_pool = data.ordered_pool(state["tasks"]["train"])  # quality-ordered (paper)
    heldout = state["tasks"]["heldout"]
    run.args = dataclasses.replace(args, reward_scale=run_scale(args, state, train_pool))
    (run.dir / "args.json").write_text(json.dumps(dataclasses.asdict(run.args), indent=1))  # with the run's S
    run.save_state()
    n_val = "".join(f", {len(state['tasks'][k])} {k}" for k in ("test_deep", "test_names", "val")
                    if state["tasks"].get(k))
    log(run.dir, f"tasks: {len(train_pool)} train, {len(heldout)} test (in-template){n_val}; "
                 f"S = {run.args.reward_scale:g}")
    return train_pool, heldout


def base_phase(run: Run, actor, tokenizer, texts: list) -> dict:
    """The base phase (embedded only; the paper starts from pretrained Qwen3.5): base_steps of synthetic copy
    pretraining (data.copy_samples over the SFT corpus's pieces and a share --base-name-share of random names:
    tasks/copying.py), then the copy gate: greedy copy accuracy on 64 fresh samples of corpus pieces and of names
    never trained on (gating only when names are trained on), logged and recorded in state.json. Below the gate,
    --base-max-steps allows more: chunks of base_steps / 4 until a second probe (not the reported one) reads
    >= COPY_GATE or the cap is reached; below it, a WARNING."""
    args = run.args
    items = data.copy_items(texts)
    names = copying.random_names(copying.N_NAMES, args.seed, avoid=items) if args.base_name_share else []
    fresh = copying.random_names(512, f"probe/{args.seed}", avoid=set(items) | set(names))  # never trained on

    def train(n, seed):
        samples = data.copy_samples(tokenizer, items, n * args.base_batch_size, seed, names, args.base_name_share)
        ppo.sft(actor, samples, args, run.metrics, phase="base", epochs=1, lr=args.base_lr,
                batch_size=args.base_batch_size)

    def reading(seed):  # ([corpus pieces, names never trained on], the gated one: names only if trained on)
        accs = [ppo.copy_accuracy(actor, data.copy_samples(tokenizer, x, 64, seed)) for x in (items, fresh)]
        return accs, min(accs if names else accs[:1])
    train(args.base_steps, args.seed)
    steps, chunk, decided = args.base_steps, max(1, args.base_steps // 4), None  # decided: the deciding probe's
    while steps + chunk <= args.base_max_steps and (decided := reading(-1001 - args.seed)[1]) < COPY_GATE:
        train(chunk, 10_000 + args.seed * 1000 + steps)
        steps += chunk
    (acc, acc_names), gated = reading(-1 - args.seed)
    gate = {"copy_accuracy": round(acc, 4), "copy_accuracy_names": round(acc_names, 4), "steps": steps,
            "items": len(items), "names": len(names)}
    low = ("" if gated >= COPY_GATE else  # the two 64-sample probes differ by a few points
           " WARNING: below the gate (--base-max-steps allows more)" if decided is None or decided < COPY_GATE else
           f" (below the gate on this probe; the probe that decided read {decided:.3f})")
    log(run.dir, f"base: {steps} copy steps over {len(items)} items + {len(names)} random names; copy accuracy "
                 f"{acc:.3f}, on names never trained on {acc_names:.3f}{'' if names else ' (not gated)'} "
                 f"(gate {COPY_GATE})" + low)
    return gate


def warm_start(run: Run, train_pool: list, heldout: list) -> None:
    """Base phase and SFT warm start into ckpt/base and ckpt/sft (reference trajectories run here, no engine); with
    --n-sft-tasks on that many fresh tasks, none sharing an instruction with another pool (RL's are new to SFT)."""
    args, run_dir, sft_dir = run.args, run.dir, run.sft_dir
    sft_pool = list(train_pool)
    if args.n_sft_tasks:
        evals = [d for k in ("val", "test_deep", "test_names") for d in run.state["tasks"].get(k, [])]
        sft_pool = data.sft_pool(run_dir / "tasks" / "sft", args.n_sft_tasks, args.seed + 1,
                                 list(heldout) + list(train_pool) + evals,
                                 rst_rounds=args.rst_rounds, expert_text=args.expert_text,
                                 rst_share=args.sft_rst_share, random_share=args.sft_names_share)
    texts = data.corpus(sft_pool)
    for name, dirs in split_dirs(run.state).items():  # how new each evaluation split is to the training pools
        log(run_dir, f"{name} vs the SFT pool: {data.overlap(sft_pool, dirs)}; vs the RL pool: "
                     f"{data.overlap(train_pool, dirs)}")
    tokenizer = M.train_tokenizer(texts, vocab_size=args.vocab_size)
    tp = parallel_plan(args)["tp"] if args.backend == "megatron" else 1  # vocab-parallel rows split evenly
    actor = M.build_actor(M.tiny_config(M.padded_vocab(len(tokenizer), tp), args.arch), seed=args.seed)
    if args.base_steps:
        run.state["base"] = run.timed("base", lambda: base_phase(run, actor, tokenizer, texts))
        save_dir(actor, tokenizer, run_dir / "ckpt" / "base")
    trials, _, _ = actors.run_rollouts(sft_pool, "scripted", args, run_dir, tokenizer, desc="sft data")

    def resolved(trials):  # in task order, not the order the concurrent trials finished in, so that --seed fixes
        return sorted((t for t in trials if t["resolved"]), key=lambda t: t["task"])  # SFT's minibatch order
    samples = rollout.to_samples(resolved(trials), run_dir, "sft")  # the verifier audits them
    log(run_dir, f"sft: {len(samples)} reference trajectories of {len(sft_pool)} tasks, "
                 f"{sum(int(s['loss_mask'].sum()) for s in samples)} loss tokens")
    if args.sft_faults:  # recoveries: a share of the tasks again, one fault turn in each, trained after it only
        again = random.Random(args.seed).sample(sft_pool, round(args.sft_faults * len(sft_pool)))
        faulted, _, _ = actors.run_rollouts(again, "scripted", args, run_dir, tokenizer, desc="sft faults",
                                            script_faults=1.0)
        extra = rollout.after_faults(rollout.to_samples(resolved(faulted), run_dir, "sft"))
        log(run_dir, f"sft faults: {len(extra)} of {len(again)} tasks replayed with a fault turn resolved, "
                     f"{sum(int(s['loss_mask'].sum()) for s in extra)} loss tokens after their faults")
        samples += extra
    path = run_dir / "samples" / "sft.jsonl"  # what SFT trains on, in its order; the digest compares two runs
    tito.save_samples(path, samples)
    log(run_dir, f"sft samples: {path} sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:16]}")
    ppo.sft(actor, samples, args, run.metrics)
    save_dir(actor, tokenizer, sft_dir)


def warm_up_critic(run: Run, ax: actors.Actors, tokenizer, train_pool: list) -> None:
    """Critic Warm-Up on SFT-policy rollouts (step 0), or on resume the engines get the last step's weights."""
    args, state = run.args, run.state
    if args.colocate:  # a run killed during an update may have left the engines released (a no-op otherwise),
        ax.engines_memory("resume")  # their weights storage back but not its contents: reloaded below (the
        if state["step"] == 0:  # publish of the last step), here the SFT weights from disk
            for u in ax.urls:
                EngineClient(u).update_weights_from_disk(run.sft_dir, weight_version=0)
    if state["step"] > 0:
        ax.publish(state["step"])  # the engines serve the weights of the last finished step
        log(run.dir, f"resumed at RL step {state['step']}")
    else:
        ax.ray.get(ax.trainer.mark_published.remote(0))  # the engines serve the SFT weights
        if "critic_warmup" not in state:
            def do_warmup():
                if args.critic_warmup_epochs == 0 or args.advantage == "grpo":  # cold start (the paper's ablation:
                    return []  # EV from -33.6), or no critic at all (GRPO)
                pool = [train_pool[i % len(train_pool)] for i in range(args.critic_warmup_trials)]
                trials, _, _ = actors.run_rollouts(pool, "model", args, run.dir, tokenizer, ax.workers, ax.urls,
                                                   desc="warm-up pool")
                if args.colocate:  # the engines keep the SFT weights (nothing to publish before step 1)
                    ax.engines_memory("release", ["kv_cache"])
                recs = ax.ray.get(ax.trainer.warmup.remote(rollout.to_samples(trials, run.dir, "warmup")))
                if args.colocate:
                    ax.engines_memory("resume", ["kv_cache"])
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


def rl_loop(run: Run, ax: actors.Actors, tokenizer, train_pool: list, heldout: list) -> None:
    """RL: PPO steps, the paper's step list. One-step async: the rollout of step t+1 runs beside the update of
    step t, with weights t-1 (staleness exactly 1); the first step of a process is sampled synchronously.
    --eval-every K: the validation split's evaluation after every K-th publish (nothing else is in flight then: the
    next step's rollout finished beside the update), a metrics row of phase "eval" (curves.png)."""
    args, state = run.args, run.state
    first_step, val = state["step"] + 1, state["tasks"].get("val")

    def ev(dirs, tag):  # an evaluation of the weights the engines serve
        return evaluate(dirs, args, run.dir, tokenizer, ax.workers, ax.urls, tag)

    def rollout_step(step):  # 1-3. tasks of this step, trials with oversampling (keep the first n_keep)
        launch = data.launch_tasks(train_pool, step, args.n_launch // args.samples_per_task, args.seed,
                                   args.samples_per_task)  # every task once per epoch, G times in its step
        t0 = time.time()
        trials, dropped, tok_s = actors.run_rollouts(launch, "model", args, run.dir, tokenizer, ax.workers, ax.urls,
                                                     n_keep=args.n_keep, desc=f"rollout step {step}")  # r = P / S
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
            ax.engines_memory("release")
        update = ax.trainer.train_step.remote(samples, step)
        ro_next = rollout_step(step + 1) if step < args.rl_steps and overlapped(step + 1) else None
        stats = ax.ray.get(update)
        # ALGO LOGIC: 7. publish weights t to the engines (the barrier)
        t0 = time.time()
        if args.colocate:  # as slime: weights memory back, the new weights in, then the KV cache
            ax.engines_memory("resume", ["weights"])
        ax.publish(step)
        if args.colocate:
            ax.engines_memory("resume", ["kv_cache"])
        t_publish = time.time() - t0
        # plumbing: the step's row, then the commit point
        rec = {"weight_version": step, "staleness": staleness, "sampled_beside_update": overlapped(step),
               "rollout_beside_update": ro_next is not None,
               **step_record(ro, samples, stats, audit, time_rollout_wait=t_wait, time_publish=t_publish,
                             time_step=time.time() - t_step)}
        rec["engine_errors_500"] = actors.engine_errors_500(ax.urls)  # since the engines started; each a lost trial
        if rec["engine_errors_500"]:
            log(run.dir, f"WARNING step {step}: the engines have answered {rec['engine_errors_500']} HTTP 500s since "
                         "they started (each lost a trial; tracebacks in the engines' stderr)")
        run.metrics.write(rec, step, "rl")
        if args.eval_every and step % args.eval_every == 0 and step < args.rl_steps:  # the last: evaluate_checkpoint
            eval_row(run, {"val": ev(val, f"val step {step}")}, step)  # the test splits: at the end only
        state["step"] = step
        state["phase_times"]["rl"] = state["phase_times"].get("rl", 0.0) + rec["time_step"]
        run.save_state()  # commits step k: its checkpoint, metrics row and samples (rundir.resume_run)
        prune_previous(run.dir)
        log_step(run, rec, step)
        ro = ro_next


def train(args: Args) -> dict:
    """The whole run: tasks -> SFT -> actors -> eval SFT -> critic warm-up -> RL -> eval RL; resumable. --stop-after
    sft ends it at the SFT checkpoint -> {sft_dir, phase_times} (no summary.json)."""
    check_args(args)
    run = Run(args)
    args, state = run.args, run.state
    train_pool, heldout = make_tasks(run)
    args = run.args  # with the run's S
    if not (run.sft_dir / "config.json").exists():
        run.timed("sft", lambda: warm_start(run, train_pool, heldout))
    if args.stop_after == "sft":  # an SFT-only run (another run's --model-path): no Ray, engine, evaluation or RL
        log(run.dir, f"stop after sft: the SFT checkpoint is {run.sft_dir}; no engine, evaluation, warm-up or RL")
        run.metrics.tb.close()
        return {"sft_dir": str(run.sft_dir), "phase_times": state["phase_times"]}
    tokenizer = AutoTokenizer.from_pretrained(str(run.sft_dir))
    ax = actors.Actors(args, run.dir)  # Ray and the placement groups; the actors start below
    try:
        ax.start(run.sft_dir, state["step"])
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "base")  # with a base phase
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "sft")
        log(run.dir, f"eval after SFT: {brief(state['eval_sft'])}")
        warm_up_critic(run, ax, tokenizer, train_pool)
        rl_loop(run, ax, tokenizer, train_pool, heldout)
        evaluate_checkpoint(run, ax, tokenizer, train_pool, heldout, "rl")  # the engines serve the final weights
    finally:
        ax.stop()
        run.metrics.tb.close()

    summary = {"eval_base": state.get("eval_base"), "copy_gate": state.get("base"), "eval_sft": state["eval_sft"],
               "eval_rl": state["eval_rl"], "eval_sft_train": state["eval_sft_train"],
               "eval_sft_splits": state.get("eval_sft_splits", {}), "eval_rl_splits": state.get("eval_rl_splits", {}),
               "eval_rl_train": state["eval_rl_train"], "phase_times": state["phase_times"],
               "eval_rl_best_val": report.best_val(run.dir), "rl_steps": state["step"],
               "async_vs_sequential": report.async_vs_sequential(run.dir)}
    write_atomic(run.dir / "summary.json", json.dumps(summary, indent=1))  # experiments.paper reads it: an arm's end
    report.plot(run.dir)
    report.print_table(summary)
    return summary


if __name__ == "__main__":
    train(ARGV)
