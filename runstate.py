"""The bookkeeping of one training run (train_t1.train drives it; not the paper's pipeline, which train_t1.py
reads as): the Run object over rundir.py (args, state.json as the commit point, phase times), the checks of the flags'
choices and combinations, S fixed for the run, checkpoints renamed into place, the evaluation protocol applied to a
run's checkpoints with its metrics rows and files, and an RL step's metrics row and log line (names in the README).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import critic as C
import data
import infra
import model as M
import ppo
import report
import rollout
from cluster import actors
from engine.client import publish_from_disk
from rundir import Metrics, load_state, log, resume_run, rewrite_jsonl, write_atomic
from tasks import families
from trainer import parallel_plan


# --- the flags ---------------------------------------------------------------------------------------

def check_flags(args) -> None:
    """The flags' choices and combinations (train_t1.check_args checks the numbers first): a bad one fails before any
    work, naming the flag and what is wrong (and, for the cluster, what is missing)."""
    choices = {"backend": ("hf", "megatron"), "param_dtype": ("fp32", "bf16"), "sandbox": ("bwrap", "daytona"),
               "r3_mode": ("replay", "off"), "engine_weight_dtype": ("bf16", "fp32"), "arch": M.ARCHS,
               "reward_mode": ppo.REWARD_MODES, "advantage": ppo.ADVANTAGES, "critic_head_init": C.HEAD_INITS,
               "expert_text": families.EXPERT_TEXTS, "stop_after": ("", "sft")}  # "": the whole run
    for k, ok in choices.items():
        if getattr(args, k) not in ok:
            raise ValueError(f"--{k.replace('_', '-')}: expected one of {'|'.join(ok)}, got {getattr(args, k)!r}")
    if args.stop_after == "sft" and args.model_path:
        raise ValueError("--stop-after sft: a --model-path run has no SFT of its own to stop after")
    if args.sft_rst_share < 1.0 and not (args.n_sft_tasks and args.rst_rounds):
        raise ValueError(f"--sft-rst-share {args.sft_rst_share}: shares out the SFT pool's RST steps, so it needs "
                         f"--n-sft-tasks and --rst-rounds (got {args.n_sft_tasks} and {args.rst_rounds})")
    if args.eval_every and not args.n_val_tasks:
        raise ValueError(f"--eval-every {args.eval_every}: the curve during RL is the validation split's (the test "
                         "splits are evaluated at the SFT and the final checkpoints only); add --n-val-tasks")
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
    infra.check_plan(parallel_plan(args), args.backend, args.trainer_ranks, args.plan)
    if args.backend == "megatron" and args.model_path:
        infra.check_megatron_model_path(args.model_path, args.param_dtype)
    check_loss_args(args)


def check_loss_args(args) -> None:
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
                "reference copy for KL); use --backend hf or 0 (the paper's value)")


# --- the run directory -------------------------------------------------------------------------------

class Run:
    """The run directory: args, state.json (the commit point), metrics.jsonl + TensorBoard, log.txt."""

    def __init__(self, args):
        """A run directory for args (checked by train_t1.check_args), created or resumed (rundir.resume_run)."""
        self.args = args = dataclasses.replace(args, trainer_ranks=parallel_plan(args)["world"])  # --plan: ranks
        self.dir = run_dir = Path(args.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.state = load_state(run_dir)  # refuses a run dir with data but no state.json, names a corrupt one
        self.state.setdefault("commit", source_commit())  # what made the run (experiments.seeds collect files it)
        self.state.setdefault("argv", sys.argv)
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


def source_commit() -> str | None:
    """The git commit of the code running ("+dirty" when tracked files differ from it), None outside a git clone."""
    root = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_scale(args, state: dict, train_pool: list) -> float:
    """S of r = P / S, fixed for the whole run (paper): --reward-scale, or the training pool's ~90th percentile of
    assertion counts (--reward-scale-from-pool); recorded in state.json, and a resume with another S is refused."""
    s = float(data.pool_scale(train_pool) if args.reward_scale_from_pool else args.reward_scale)
    if state.setdefault("reward_scale", s) != s:
        raise ValueError(f"--reward-scale: this run's S is {state['reward_scale']} (state.json), got {s}: S is fixed "
                         "for the whole run")
    return s


def save_dir(actor, tokenizer, path: Path) -> None:
    """A checkpoint renamed into place: the directory exists only complete."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    M.save_checkpoint(actor, tokenizer, tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


# --- evaluations of a run's checkpoints -----------------------------------------------------------------

def evaluate(task_dirs, args, run_dir, tokenizer, workers, urls, tag) -> dict:
    """Evaluation with the paper's protocol (rollout.EVAL, through Args.eval_*): temperature 0.1, top-p 0.95,
    eval_attempts per task, the eval turn and agent / verifier limits replacing the tasks' own. Every trial counts
    (rollout.evaluate_trials): n_trials = tasks x attempts, a trial that errored or was dropped scores 0 and is
    listed in `errors`. The native token-first harness stands in for Terminus-2 (rollout.py)."""
    if args.eval_attempts == 0:  # --eval-attempts 0 turns evaluation off: no trial, said so, never a 0 solve rate
        log(Path(run_dir), f"eval {tag}: skipped (--eval-attempts 0)")
        return {"solve_rate": float("nan"), "reward_mean": float("nan"), "turns_mean": float("nan"), "n_trials": 0,
                "n_errors": 0, "errors": [], "skipped": True}
    limits = {"max_turns": args.eval_max_turns, "trial_timeout_s": args.eval_agent_timeout_s,
              "agent_timeout_s": args.eval_agent_timeout_s, "verifier_timeout_s": args.eval_verifier_timeout_s}

    def run_attempt(dirs, k):
        kept, dropped, _ = actors.run_rollouts(dirs, "model", args, run_dir, tokenizer, workers, urls,
                                               temperature=args.eval_temperature, top_p=args.eval_top_p,
                                               desc=f"eval {tag} #{k + 1}", limits=limits)
        return kept + [{"task": d["task"], "exit_reason": "error", "error": d["reason"]} for d in dropped]
    rep = rollout.evaluate_trials(task_dirs, run_attempt, args.eval_attempts)
    if rep["n_errors"]:
        log(Path(run_dir), f"eval {tag}: {rep['n_errors']} of {rep['n_trials']} trials failed and count 0: "
                           f"{rep['errors'][:5]}")
    return rep  # with its trials (task, attempt, reward, resolved): the paired tests of the end-of-run table


# The splits a run is evaluated on (data.py draws them), by the name every report gives them: (state["tasks"] key,
# evals/ file prefix, metrics-row prefix). "test" is the in-template test split, the held-out pool of earlier runs
# (its keys and files keep that name); the test splits are evaluated at the SFT and the final checkpoints only,
# the validation split (every choice of recipe is made on it) also every --eval-every steps.
SPLITS = {"test": ("heldout", "step", "heldout"), "test_deep": ("test_deep", "test_deep_step", "test_deep"),
          "test_names": ("test_names", "test_names_step", "test_names"), "val": ("val", "val_step", "val")}


def split_dirs(state: dict, names=tuple(SPLITS)) -> dict:
    """{split name: its task dirs} of the splits among `names` this run drew (state["tasks"])."""
    tasks = state.get("tasks", {})
    return {n: tasks[SPLITS[n][0]] for n in names if tasks.get(SPLITS[n][0])}


def eval_row(run, evs: dict, step: int) -> None:
    """Evaluations of one checkpoint ({split name: evaluation}) as one metrics row (phase "eval", at the RL step
    whose weights they scored; SFT: 0: <prefix>_solve_rate, _reward_mean, _n_trials of each split), and whole,
    per-trial rows and the split's name included, in evals/<file prefix>_NNNNNN.json (SPLITS): any two compare
    paired (`python -m experiments.bench compare A B`). A row of the same step already in metrics.jsonl (written
    before a kill that came ahead of the state's commit) is replaced."""
    unknown = set(evs) - set(SPLITS)
    if unknown:
        raise ValueError(f"eval_row: unknown split(s) {sorted(unknown)}; expected some of {sorted(SPLITS)}")
    row = {}
    for name, e in evs.items():
        prefix = SPLITS[name][2]
        row.update({f"{prefix}_solve_rate": e["solve_rate"], f"{prefix}_reward_mean": e["reward_mean"],
                    f"{prefix}_n_trials": e["n_trials"]})
    (run.dir / "evals").mkdir(exist_ok=True)
    for name, e in evs.items():  # the files first: the row is what a resume keeps or drops
        write_atomic(run.dir / "evals" / f"{SPLITS[name][1]}_{step:06d}.json",
                     json.dumps({**e, "after_step": step, "split": name}))
    for note in rewrite_jsonl(run.dir / "metrics.jsonl", lambda r: (r.get("phase"), r.get("step")) != ("eval", step)):
        log(run.dir, f"eval row of step {step}: {note}")
    run.metrics.write(row, step, "eval")


def brief(ev: dict) -> dict:
    """An evaluation without its per-trial rows (for the log)."""
    return {k: v for k, v in ev.items() if k != "trials"}


def evaluate_checkpoint(run: Run, ax: actors.Actors, tokenizer, train_pool: list, heldout: list, ck: str) -> None:
    """Evaluation of ck on every split the run drew (SPLITS: the test splits, validation) and on the first training
    tasks: "base" (the in-template test split only) and "sft" once, "rl" after the last RL step (again when a resume
    added steps); the engines serve its weights. state["eval_<ck>"] is the in-template test split's evaluation,
    state["eval_<ck>_splits"] the others' by name."""
    args, state = run.args, run.state

    def ev(dirs, tag):
        return evaluate(dirs, args, run.dir, tokenizer, ax.workers, ax.urls, tag)

    def every_split(tag):  # -> {split name: evaluation}, the in-template test split first
        return {n: ev(d, tag if n == "test" else f"{tag} {n}") for n, d in split_dirs(state).items()}
    base = run.dir / "ckpt" / "base"
    if ck == "base" and "eval_base" not in state and state["step"] == 0 and (base / "config.json").exists():
        publish_from_disk(ax.urls, base, 0)  # the base model's weights for its evaluation, then SFT's again
        state["eval_base"] = run.timed("eval_base", lambda: ev(heldout, "base"))
        publish_from_disk(ax.urls, run.sft_dir, 0)
        run.save_state()
        log(run.dir, f"eval of the base model: {brief(state['eval_base'])}")
    if ck == "sft" and "eval_sft" not in state:
        evs = run.timed("eval_sft", lambda: every_split("sft"))
        eval_row(run, evs, 0)
        state["eval_sft_train"] = run.timed("eval_sft", lambda: ev(train_pool[:args.eval_train_tasks], "sft train"))
        state["eval_sft_splits"] = {n: e for n, e in evs.items() if n != "test"}
        state["eval_sft"] = evs["test"]  # last: its presence says the SFT evaluations are done
        run.save_state()
    if ck == "rl" and state["step"] == 0 and "eval_rl" not in state:  # no RL step: the SFT weights, evaluated
        state["eval_rl"] = {**state["eval_sft"], "after_step": 0}
        state["eval_rl_train"] = state["eval_sft_train"]
        state["eval_rl_splits"] = state.get("eval_sft_splits", {})
        run.save_state()
    if ck == "rl" and state.get("eval_rl", {}).get("after_step") != state["step"]:
        # the step's evaluations first, then the state (run.timed saves it): a kill among them redoes them all
        evs = run.timed("eval_rl", lambda: every_split("rl"))
        train_ev = run.timed("eval_rl", lambda: ev(train_pool[:args.eval_train_tasks], "rl train"))
        eval_row(run, evs, state["step"])
        state["eval_rl_splits"] = {n: {**e, "after_step": state["step"]} for n, e in evs.items() if n != "test"}
        state["eval_rl"], state["eval_rl_train"] = {**evs["test"], "after_step": state["step"]}, train_ev
        run.save_state()
        log(run.dir, f"eval after RL: {brief(state['eval_rl'])}")
        for n, e in state["eval_rl_splits"].items():
            log(run.dir, f"eval after RL, {report.TITLES[n]}: {brief(e)}")


# --- an RL step's metrics row and log line ---------------------------------------------------------------

# a step where this share of the replies broke the format is logged as a WARNING: at T = 1 the embedded SFT model's
# replies are refused 37-57% of the time (per 8 steps), in a format collapse 80-87% (results/LOG.md)
INVALID_ALARM = 0.75


def invalid_reply_frac(trials: list) -> float:
    """Share of the step's agent replies the harness refused as not one JSON object of the format; its rise is how a
    format collapse shows (0.45-0.55 before one, then 0.61 / 0.70 / 0.80 over three steps and reward 0 after).
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
    recs = [r for t in trials for r in t.get("records", []) if r.get("cached_tokens") is not None]
    sent = sum(len(r["prompt_ids"]) for r in recs)  # prompt tokens; the engines' prefix cache gave cached_tokens
    return {"reward_mean": 0.0,  # no sample: nothing trained on; else train_step's (the rewards it trained on)
            "solve_rate": float(np.mean([t["resolved"] for t in trials])) if trials else 0.0,
            # r = P / S whatever the arm trains on (--reward-mode binary's reward_mean is its 0 / 1 reward)
            "reward_dense_mean": float(np.mean([s["reward"] for s in samples])) if samples else 0.0,
            **stats, **audit, "n_launched": ro["n_launched"], "n_kept": len(trials), "n_dropped": len(ro["dropped"]),
            "turns_mean": float(np.mean([s["turns"] for s in samples])) if samples else 0.0,
            "tokens_mean": float(np.mean([len(s["tokens"]) for s in samples])) if samples else 0.0,
            "invalid_reply_frac": invalid_reply_frac(trials), "rollout_tokens_per_s": ro["tok_s"],
            "prefix_cache_frac": sum(r["cached_tokens"] for r in recs) / sent if sent else float("nan"),
            "time_rollout": ro["t_rollout"], **timing}


def log_step(run, rec: dict, step: int) -> None:
    """The step's line in log.txt, and a WARNING when the reply format collapses."""
    off = rec.get("dlogp_r3_off", float("nan"))  # NaN on a step without the diagnostic (--r3-off-every K)
    off = f"{off:.4f}" if math.isfinite(off) else "-"
    log(run.dir, f"step {step}: reward {rec['reward_mean']:.3f} solve {rec['solve_rate']:.2f} "
                 f"EV {rec.get('explained_variance', float('nan')):.3f} |dlogp| {rec.get('dlogp', float('nan')):.4f} "
                 f"(R3 off {off}) staleness {rec['staleness']} "
                 f"{rec['time_step']:.0f}s")
    if rec["invalid_reply_frac"] >= INVALID_ALARM:
        log(run.dir, f"WARNING step {step}: {rec['invalid_reply_frac']:.0%} of the agent's replies broke the "
                     "reply format (invalid_reply_frac): how a format collapse starts; --kl-coef adds a KL penalty "
                     "to the SFT policy")
