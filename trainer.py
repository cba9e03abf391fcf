"""The trainer process: actor + critic co-resident (paper) on Ray actors, their checkpoints, rank sharing of rows.

Machinery for steps 5-6 and the checkpoint (DESIGN.md section 3): `Trainer` holds the actor, the behaviour copy,
the critic, both optimizers and the published weight versions, and runs the step functions it is given
(`Trainer.steps`: ppo.Trainer binds ppo's critic_warmup and train_step, which use this file's row sharing, so this
file imports neither ppo nor the loop); `TrainerGroup` fans the loop's calls out to N trainer ranks. The checkpoint
of an RL step and the run directory's commit point (state.json) live here too: save_trainer writes it, resume_run
brings a run directory back to what state.json committed.

Run: not by itself; `python train_t1.py` starts it (tests/test_trainer_group.py, tests/test_resume.py).

Departures (numbered; what and why):
  1. hf backend over N ranks: full replicas (pure DP, no optimizer sharding) in their own process group (gloo;
     nccl for CUDA weights). Sample i lives on rank i mod N; losses divide by the minibatch's global token count
     and gradients are summed before the clip, so a step equals the one-rank step.
  2. Rank 0 saves and publishes, every rank keeps the published copies; losses, clip fractions, EV and |dlogp|
     are over all ranks, expert_set_mismatch over rank 0's samples.
  3. megatron backend over tp * pp * cp * dp ranks (join_group): parallel_state carves the group per --plan; each
     rank builds its shards, read from the checkpoint's safetensors by slices (no rank holds the whole model).
  4. megatron gradients: Megatron DDP + the distributed optimizer: Megatron's own on CUDA (mcore_parallel.MegatronAdam),
     mcore_parallel.ShardedAdam on the CPU (Megatron's refuses CPU tensors); bf16 parameters with --param-dtype bf16
     (fp32 master shards). Rows are shared over the DP ranks only, padded to equal shares with dummy rows of mask 0
     (a forward is a collective over the expert-parallel ranks).
  5. megatron checkpoint: the HF checkpoint (and a publish's weights) gathered tensor by tensor to global rank 0
     alone, which writes it; each rank writes its shard file trainer_rank{r}.pt (its fp32 masters and moments; the
     plan and --param-dtype are checked on resume), not Megatron's dist_checkpointing: resumable on the same plan
     only (Megatron's would reshard), one torch.save per rank and no extra dependency.
  6. An expert no token reached gets a zero gradient (Adam still moves it by its momentum) where the one-rank
     torch Adam skips a grad of None: Megatron's behaviour.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from cluster import launch
import critic as C
import infra
from cluster import mcore
from cluster import mcore_parallel
from cluster import mcore_weights
import model as M
import rollout


def optimizer_lr(opt) -> float:
    """The lr an optimizer steps at: torch's (one lr for every param group here), ShardedAdam's, MegatronAdam's."""
    return opt.lr if hasattr(opt, "set_lr") else opt.param_groups[0]["lr"]


def set_optimizer_lr(opt, lr: float) -> None:
    """The flags' lr over a loaded optimizer state: load_state_dict restores the lr the checkpoint was saved with
    (torch's param_groups, ShardedAdam's and Megatron's alike), so a resume or a warmed critic with another --actor-lr /
    --critic-lr kept the old one without a word; the trainer sets the flags' lr and logs the change."""
    if hasattr(opt, "set_lr"):
        opt.set_lr(lr)
    else:
        for group in opt.param_groups:
            group["lr"] = lr


# --- the run directory's log.txt and metrics.jsonl ---------------------------------------------------

def log(run_dir: Path, msg: str) -> None:
    """A timestamped line on stdout and in the run directory's log.txt."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    with open(run_dir / "log.txt", "a") as f:
        f.write(line + "\n")


class Metrics:
    """metrics.jsonl (one object per record) + TensorBoard; names are listed in the README."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter
        self.path = run_dir / "metrics.jsonl"
        self.tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, rec: dict, step: int, phase: str) -> None:
        rec = {"phase": phase, "step": step, **rec}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for k, v in rec.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and k != "step":
                self.tb.add_scalar(f"{phase}/{k}", v, step)
        self.tb.flush()


# --- the trainer's layout ---------------------------------------------------------------------------

def parallel_plan(args) -> dict:
    """The trainer's layout: --plan (infra.py's planner JSON: tp, pp, cp, ep, etp, dp) or --trainer-ranks N
    full replicas (dp = N); world = tp * pp * cp * dp trainer ranks."""
    try:
        plan = json.loads(args.plan) if args.plan else {"dp": args.trainer_ranks}
        p = {k: int(plan.get(k, 1)) for k in ("tp", "pp", "cp", "ep", "dp")}
        p["etp"] = int(plan.get("etp", p["tp"]))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--plan: expected JSON like '{{\"tp\": 2, \"ep\": 1, \"dp\": 1}}', got {args.plan!r} ({e})")
    if min(p.values()) < 1:
        raise ValueError(f"--plan: every size must be >= 1, got {p}")
    p["world"] = p["tp"] * p["pp"] * p["cp"] * p["dp"]
    return p


def plan_recompute(args) -> bool:
    """--plan's "recompute" (the planner's full activation recompute, which its memory figures assume); not part of
    parallel_plan, as it does not change a rank's shards (checkpoints of either resume in the other)."""
    plan = json.loads(args.plan) if args.plan else {}
    r = plan.get("recompute", False) if isinstance(plan, dict) else False
    if not isinstance(r, bool):
        raise ValueError(f"--plan: recompute must be true or false, got {r!r}")
    return r


# --- checkpoints and the run directory's commit point (state.json) -------------------------------------

def save_trainer(path: Path, save_actor, state: dict, name: str = "trainer.pt", rank: int = 0,
                 barrier=lambda: None) -> None:
    """Checkpoint: the actor in HF layout (save_actor(dir)) and `state` (critic, both optimizers, step, RNG) as
    `name`, then step.json ({"step": k}, written last: a directory without it is incomplete); swapped in with
    renames. The checkpoint it replaces stays as `previous` until state.json commits step k (prune_previous):
    a kill before the commit resumes from it (resume_run). Sharded trainer ranks (Megatron model parallel) all
    call it: the actor save is their gather (rank 0 writes), each rank writes its own shard file, rank 0 swaps
    once every rank is done."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    save_actor(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp / name)
    barrier()
    if rank > 0:
        return
    write_atomic(tmp / "step.json", json.dumps({"step": int(state["step"])}))  # the marker is whole or absent
    prev = path.with_name("previous")
    shutil.rmtree(prev, ignore_errors=True)  # state.json is at the step of `path` (the loop commits before saving)
    if path.exists():
        path.rename(prev)
    tmp.rename(path)


def prune_previous(run_dir: Path) -> None:
    """After state.json committed the step of ckpt/latest: the checkpoint before it is no longer needed."""
    shutil.rmtree(run_dir / "ckpt" / "previous", ignore_errors=True)


def checkpoint_step(d: Path) -> int | None:
    """The RL step a checkpoint directory holds (its step.json); None when absent or incomplete (no step.json)."""
    f = d / "step.json"
    if not f.is_file():
        return None
    try:
        step = json.loads(f.read_text())["step"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{f}: corrupt checkpoint marker ({e}); expected {{\"step\": N}}") from e
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{f}: corrupt checkpoint marker: step {step!r} is not a positive integer")
    return step


def load_trainer_file(path: Path) -> dict:
    """A trainer checkpoint file (critic, optimizers, step, RNG); one that cannot be read is named in the error."""
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # a truncated zip, a pickle error, a missing file: all the same to the user
        raise ValueError(f"{path}: corrupt or unreadable trainer checkpoint ({type(e).__name__}: {e})") from e


def check_weights(d: Path) -> None:
    """Every *.safetensors of a checkpoint directory has a readable header and the bytes it announces (a cheap
    check: the header only); a bad one is named."""
    from safetensors import safe_open
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d}: checkpoint without any *.safetensors weights file")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except Exception as e:
            raise ValueError(f"{f}: corrupt weights file ({type(e).__name__}: {e})") from e


def load_state(run_dir: Path) -> dict:
    """state.json of a run directory: the commit point of the run (phases done, RL step committed).

    A fresh directory gets one at once; a directory with checkpoints or metrics but no state.json is refused
    (its data would be trained over); a state.json that does not parse is named in the error."""
    path = run_dir / "state.json"
    if not path.exists():
        leftovers = [p.name for p in (run_dir / "ckpt", run_dir / "metrics.jsonl", run_dir / "samples") if p.exists()
                     and (p.is_file() or any(p.iterdir()))]
        if leftovers:
            raise ValueError(f"--run-dir {run_dir}: holds {', '.join(leftovers)} but no state.json, so which phase and "
                             "step they belong to is unknown; refusing to start over them (pick a new --run-dir, or "
                             "remove that directory)")
        return {"phase_times": {}, "step": 0}
    try:
        state = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: corrupt ({e}); the run cannot be resumed from it") from e
    if (not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool)
            or state["step"] < 0 or not isinstance(state.get("phase_times"), dict)):
        raise ValueError(f"{path}: corrupt: expected an object with an integer 'step' >= 0 and 'phase_times', got "
                         f"{json.dumps(state)[:200]}")
    return state


def write_atomic(path: Path, text: str) -> None:
    """path holds text whole or keeps what it held: a temp file beside it, renamed over it (a kill mid-write leaves
    no torn file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_jsonl(path: Path) -> tuple[list[dict], str]:
    """Rows of a JSONL file a kill may have cut: a torn last line is dropped (the note says so); a bad line
    before it is corruption, named with its line number."""
    lines = path.read_text().splitlines() if path.exists() else []
    rows, note = [], ""
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({e}); only the last line may be torn") from e
            note = f"{path.name}: dropped a torn last line ({len(line)} chars: a kill mid-write)"
            continue
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {i + 1} is not a JSON object: {line[:80]}")
        rows.append(row)
    return rows, note


def rewrite_jsonl(path: Path, keep) -> list[str]:
    """Keep the rows of path for which keep(row) holds (atomic: tmp + os.replace); notes on what was dropped."""
    if not path.exists():
        return []
    rows, note = read_jsonl(path)
    kept = [r for r in rows if keep(r)]
    if note or len(kept) < len(rows) or not path.read_text().endswith("\n"):  # unended: joins the next row
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return ([note] if note else []) + ([f"{path.name}: dropped {len(rows) - len(kept)} row(s) of uncommitted work"]
                                       if len(kept) < len(rows) else [])


def _refuse_rolled_back(run_dir: Path, want: int, ckpt_steps: dict) -> None:
    """ValueError when the run directory holds work of a step later than want + 1. A crash leaves at most one step
    uncommitted (the loop saves step k's checkpoint, metrics row and samples, then commits k in state.json), so
    anything further ahead means state.json was rolled back or replaced: resuming would delete committed work."""
    ahead = [f"ckpt/{n} (step {st})" for n, st in ckpt_steps.items() if st is not None and st > want + 1]
    ahead += [f"samples/{f.name}" for f in sorted((run_dir / "samples").glob("step_*.jsonl"))
              if f.stem[5:].isdigit() and int(f.stem[5:]) > want + 1]
    rows, _ = read_jsonl(run_dir / "metrics.jsonl")
    late = sorted({r["step"] for r in rows if r.get("phase") in ("rl", "eval") and isinstance(r.get("step"), int)
                   and not isinstance(r["step"], bool) and r["step"] > want + 1})
    ahead += [f"metrics.jsonl (RL rows of step {', '.join(map(str, late))})"] if late else []
    if ahead:
        raise ValueError(f"{run_dir / 'state.json'}: commits RL step {want}, but the run directory holds work of later "
                         f"steps: {'; '.join(ahead)}. A crash leaves at most one step (step {want + 1}) uncommitted, "
                         "so this state.json was rolled back or replaced; refusing to resume over (and delete) that "
                         "work: restore the run's own state.json, or start a new --run-dir")


def resume_run(run_dir: Path, state: dict, sft_done: bool) -> list[str]:
    """Bring a run directory back to what state.json committed; returns notes for the log.

    The commit point of each phase is one atomic write: base phase + SFT -> ckpt/sft renamed into place; critic
    warm-up -> state.json with "critic_warmup"; RL step k -> state.json with step k (after ckpt/latest of step k, its
    metrics row and samples). Work after the last commit point is discarded and redone, never adopted: a
    checkpoint newer than state.json (a kill between the trainer's save and the commit) is deleted and
    ckpt/previous, the committed step's checkpoint, is put back; rows of metrics.jsonl / dropped.jsonl /
    failed_trials.jsonl of uncommitted work are dropped (so the redo writes them once). Work more than one step
    ahead of state.json cannot come from a crash and is refused, never deleted (_refuse_rolled_back)."""
    ckpt, want, notes = run_dir / "ckpt", state["step"], []
    dirs = {n: ckpt / n for n in ("latest", "previous", "latest.tmp", "latest.old") if (ckpt / n).is_dir()}
    steps = {n: checkpoint_step(d) for n, d in dirs.items()}
    if "latest" in dirs and steps["latest"] is None:  # a checkpoint saved before step.json existed (complete)
        f = next(iter(sorted(dirs["latest"].glob("trainer*.pt"))), None)
        steps["latest"] = None if f is None else int(load_trainer_file(f)["step"])
    _refuse_rolled_back(run_dir, want, steps)
    for n, st in steps.items():
        if st is not None and st > want:
            notes.append(f"ckpt/{n}: discarded the checkpoint of step {st}, never committed in state.json "
                         f"(step {want}): that step is redone")
    keep = next((n for n, st in steps.items() if want > 0 and st == want), None)
    if want > 0 and keep is None:
        raise ValueError(f"{run_dir / 'state.json'}: committed RL step {want}, but no checkpoint of that step in "
                         f"{ckpt} (holds: {steps or 'none'}); the run cannot be resumed consistently")
    for n, d in dirs.items():
        if n != keep:
            shutil.rmtree(d)
    if keep is not None and keep != "latest":
        dirs[keep].rename(ckpt / "latest")
        notes.append(f"ckpt/latest: the checkpoint of committed step {want} put back from ckpt/{keep}")
    if keep is not None:
        check_weights(ckpt / "latest")
    for f in sorted((run_dir / "samples").glob("step_*.jsonl")):  # an uncommitted step's samples: redone
        if f.stem[5:].isdigit() and int(f.stem[5:]) > want:
            f.unlink()
            notes.append(f"samples/{f.name}: removed, step {f.stem[5:].lstrip('0')} was never committed")
    warm = "critic_warmup" in state
    if not warm:
        for f in ckpt.glob("critic_warm*.pt"):  # would be loaded and warmed up a second time
            f.unlink()
            notes.append(f"ckpt/{f.name}: removed, the critic warm-up was never committed")
    if not sft_done:  # the base phase belongs to the warm start: redone with it
        for n in ("sft.tmp", "base.tmp", "base"):
            shutil.rmtree(ckpt / n, ignore_errors=True)

    def committed(tag, step, name) -> bool:  # tag: a phase of metrics.jsonl or a tag of failed_trials ("step3")
        tag = str(tag)
        if tag.startswith("step") and tag[4:].isdigit():
            return int(tag[4:]) <= want
        if tag in ("rl", "eval"):  # an "eval" row belongs to the RL step it scored (0: the SFT checkpoint)
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"{run_dir / name}: an RL row without an integer step ({step!r})")
            return step <= want
        return {"base": sft_done, "sft": sft_done, "critic_warmup": warm, "warmup": warm}.get(tag, True)

    notes += rewrite_jsonl(run_dir / "metrics.jsonl",
                           lambda r: committed(r.get("phase"), r.get("step"), "metrics.jsonl"))
    notes += rewrite_jsonl(run_dir / "dropped.jsonl", lambda r: committed("rl", r.get("step"), "dropped.jsonl"))
    notes += rewrite_jsonl(run_dir / "failed_trials.jsonl", lambda r: committed(r.get("tag"), None, ""))
    return notes


# --- rank sharing of rows ------------------------------------------------------------------------------

def rank_world(group) -> tuple[int, int]:
    """(rank, world size) of this trainer rank; (0, 1) without a group."""
    return (0, 1) if group is None else (group.rank(), group.size())


def share(mb: list[int], group, even: bool = False) -> list[int]:
    """This rank's rows of minibatch mb: sample i lives on rank i % N, at row i // N of its local batch.
    even (Megatron ranks: every forward is a collective over the expert-parallel ranks, with equal token counts):
    padded to the largest rank's share with the local batch's last row, a dummy whose loss mask is 0."""
    rank, world = rank_world(group)
    rows = [i // world for i in mb if i % world == rank]
    most = max(sum(1 for i in mb if i % world == r) for r in range(world))
    return rows + [-1] * (most - len(rows)) if even else rows


def even(args, group) -> bool:
    """Megatron ranks (a forward is a collective over the expert-parallel ranks) take equal shares, padded."""
    return args.backend == "megatron" and group is not None


def local_rows(batch: dict, group, even: bool = False) -> dict:
    """The rows of this rank's samples (i = rank mod N); the whole batch on one rank. even: every rank gets
    ceil(B / N) + 1 rows, the extra ones dummies (copies of row 0 with every mask 0: they train nothing)."""
    rank, world = rank_world(group)
    out = {k: (v[rank::world] if torch.is_tensor(v) else v) for k, v in batch.items()}
    if even and world > 1:
        n_pad = -(-len(batch["mask"]) // world) + 1 - len(out["mask"])
        dummy = {k: v[:1].expand(n_pad, *v.shape[1:]) for k, v in batch.items() if torch.is_tensor(v)}
        dummy["mask"] = torch.zeros_like(dummy["mask"])  # m = 0: no loss, no statistic, no advantage
        out.update({k: torch.cat([out[k], dummy[k]]) for k in dummy})
    return out


# --- the trainer actor -------------------------------------------------------------------------------

def actor_threads(args) -> int:
    """torch threads of the trainer and of each engine (Args.torch_threads)."""
    cores = os.cpu_count() or 1
    return args.torch_threads or (max(1, cores // 2) if args.async_rollout else min(2, cores))


class Trainer:
    """Actor + critic co-resident (paper), both optimizers, RNG, the behaviour copy of the actor, and the weights of
    the last two versions the engines served (the behaviour policy of a batch; in host memory). Runs as a Ray actor;
    its methods are steps 5-7.
    Rank r of a TrainerGroup of `world` ranks: with the hf backend full replicas (pure data parallel; rank 0
    saves and publishes); with the megatron backend Megatron's parallel layout of --plan (parallel_state: TP,
    EP and DP over the ranks; DDP + the distributed optimizer; every rank takes part in the gather that saves
    and publishes, rank 0 writes). A multi-rank trainer builds its models once the group is joined.
    It runs the step functions of `steps` (a subclass sets them: ppo.Trainer), so that this file imports
    neither ppo nor the loop: critic_warmup(critic, opt, samples, args, group) and train_step(actor, behaviour, critic,
    actor_opt, critic_opt, samples, args, rng, run_dir, step, group, ref)."""

    steps = None  # SimpleNamespace(critic_warmup=..., train_step=...): ppo's step functions

    def __init__(self, args, sft_dir: str, step: int, rank: int = 0, world: int = 1):
        if args.pin_cores:  # the trainer's half of the cores, the rollout side has the other (infra.core_split)
            infra.pin(infra.core_split()[0])
        torch.set_num_threads(actor_threads(args))
        torch.manual_seed(args.seed)
        self.args, self.run_dir, self.sft_dir, self.step0 = args, Path(args.run_dir), sft_dir, step
        self.latest = self.run_dir / "ckpt" / "latest"
        self.rank, self.world, self.group = rank, world, None
        self.sharded = args.backend == "megatron" and world > 1  # each rank holds shards (Megatron's layout)
        self.ckpt_name = f"trainer_rank{rank}.pt" if self.sharded else "trainer.pt"
        self.published = {}  # weight version -> the actor's state dict the engines were given
        self.ref = None  # the frozen SFT actor (kl_coef > 0, hf backend)
        self.publisher, self.push_weights = None, False
        if not self.sharded:
            self._build()

    def _build(self) -> None:
        """Actor, behaviour copy, critic and their optimizers from the SFT (or latest) checkpoint; on resume the
        critic, optimizers and RNG of this rank's checkpoint file."""
        args, step = self.args, self.step0
        src = self.latest if step > 0 else self.sft_dir
        if args.backend == "megatron":  # Megatron-Core GPTModels converted from the HF checkpoint (cluster/mcore.py)
            cfg, self.tokenizer = M.load_config(src)  # no HF weights in memory: each rank reads its shards
            self.hf_config = cfg
            self.actor, self.behaviour, self.critic = mcore.trainer_models(  # this rank's shards
                cfg, src, args.param_dtype, plan_recompute(args))
            self.save_actor = lambda path: mcore_weights.save_hf(self.actor, cfg, self.tokenizer, path)  # a gather
            def hub_weights():  # a collective gathered to global rank 0; the other ranks get {}
                hf = mcore_weights.to_hf(self.actor, cfg, to_rank0=True)
                return {} if hf is None else M.hub_state_dict(hf)
            self.hub_weights = hub_weights
        else:
            hf_actor, self.tokenizer = M.load_actor(src)
            self.hf_config = hf_actor.config
            self.actor, self.behaviour = hf_actor, copy.deepcopy(hf_actor)  # behaviour: weights that sampled a batch
            self.critic = C.Critic.from_actor(self.actor, args.critic_head_init)  # full-size, the actor's backbone
            if args.kl_coef > 0:  # the frozen SFT actor: the KL reference, built only when it is used
                self.ref = M.load_actor(self.sft_dir)[0].eval().requires_grad_(False)
            self.save_actor = lambda path: M.save_checkpoint(self.actor, self.tokenizer, path)
            self.hub_weights = lambda: M.hub_state_dict(self.actor)
        if args.backend == "megatron" and (self.sharded or args.param_dtype == "bf16" or torch.cuda.is_available()):
            # Megatron DDP (grads reduce-scattered over DP, fp32) + the distributed optimizer (fp32 master shards of
            # bf16 parameters): Megatron's own on CUDA, mcore_parallel's ZeRO-1 of the same buckets on the CPU
            opt = mcore_parallel.MegatronAdam if torch.cuda.is_available() else mcore_parallel.ShardedAdam
            self.actor_opt = opt(mcore_parallel.wrap_ddp(self.actor), lr=args.actor_lr)
            self.critic_opt = opt(mcore_parallel.wrap_ddp(self.critic), lr=args.critic_lr)
        else:
            self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=args.actor_lr)
            self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=args.critic_lr)
        self.rng = random.Random(args.seed + 2)  # minibatch order; saved with every checkpoint
        warm = self.run_dir / "ckpt" / self.ckpt_name.replace("trainer", "critic_warm")
        if step > 0:
            ck = self._load(self.latest / self.ckpt_name, step)
            self.critic.load_state_dict(ck["critic"])
            self.actor_opt.load_state_dict(ck["actor_opt"])
            self.critic_opt.load_state_dict(ck["critic_opt"])
            self.rng.setstate(ck["rng"])
            torch.set_rng_state(ck["torch_rng"])
        elif warm.exists():
            ck = self._load(warm)
            self.critic.load_state_dict(ck["critic"])
            self.critic_opt.load_state_dict(ck["critic_opt"])
        for flag, o, lr in (("--actor-lr", self.actor_opt, args.actor_lr), ("--critic-lr", self.critic_opt,
                                                                              args.critic_lr)):
            old = optimizer_lr(o)
            if old != lr:  # the optimizer's load_state_dict brought back the lr it was saved with
                set_optimizer_lr(o, lr)
                if self.rank == 0:
                    log(self.run_dir, f"{flag} {lr}: the loaded optimizer ran at {old}, from here it runs at {lr}")

    def _load(self, path: Path, step: int | None = None) -> dict:
        ck = load_trainer_file(path)
        if step is not None and ck.get("step") != step:  # resume_run keeps ckpt/latest at the committed step
            raise ValueError(f"{path}: holds RL step {ck.get('step')}, state.json committed step {step}")
        plan = parallel_plan(self.args)
        if self.sharded and ck.get("plan") != plan:  # the shards of another layout do not fit this one
            raise ValueError(f"--plan: {path} holds shards of the layout {ck.get('plan')}, this run asks for {plan}")
        if ck.get("param_dtype", "fp32") != self.args.param_dtype:  # bf16's fp32 masters would be lost, or missing
            raise ValueError(f"--param-dtype: {path} was trained with {ck.get('param_dtype', 'fp32')}, this run asks "
                             f"for {self.args.param_dtype}")
        return ck

    def _state(self, step: int) -> dict:
        """What this rank checkpoints besides the actor (HF layout): critic, optimizers, step, RNG (and the plan)."""
        return {"critic": self.critic.state_dict(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict(), "step": step, "rng": self.rng.getstate(),
                "torch_rng": torch.get_rng_state(), "plan": parallel_plan(self.args) if self.sharded else None,
                "param_dtype": self.args.param_dtype}

    def _barrier(self) -> None:
        if self.sharded:
            import torch.distributed as dist
            dist.barrier()

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where the trainer ranks meet: this (rank 0's) node and a free port on it."""
        import ray
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), infra.free_port()

    def join_group(self, address: str, port: int) -> None:
        """The trainer ranks' own process group (gloo on CPU, nccl for CUDA weights). hf: apart from any other, for
        the replicas' gradient sums. megatron: the default group of this process, carved by parallel_state into
        Megatron's TP / EP / DP groups per --plan; the models are built on it (this rank's shards)."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not self.sharded:
            self.group = launch.init_update_group(address, port, self.rank, self.world, "t1_trainer_dp", backend)
            return
        import datetime
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=datetime.timedelta(minutes=30))
        p = parallel_plan(self.args)
        ps.initialize_model_parallel(tensor_model_parallel_size=p["tp"], pipeline_model_parallel_size=p["pp"],
                                     context_parallel_size=p["cp"], expert_model_parallel_size=p["ep"],
                                     expert_tensor_parallel_size=p["etp"])
        self.group = ps.get_data_parallel_group()  # rows of a batch are shared out over the DP ranks only
        self._build()

    def state_dicts(self, to_rank0: bool = False) -> dict:
        """Actor and critic weights of this rank (tests compare ranks); megatron: the whole TP = EP = 1 GPTModel
        state dicts, gathered over the ranks when sharded (a collective: every rank calls it); to_rank0: gathered to
        global rank 0 alone, as save and publish do (the other ranks get None per part)."""
        if self.args.backend == "megatron":
            return {part: mcore_weights.gather_full_state(m.gpt, self.hf_config, to_rank0)
                    for part, m in (("actor", self.actor), ("critic", self.critic))}
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict()}

    def optimizer_state_numel(self) -> dict:
        """Adam elements per moment this rank holds for the actor ({"dense", "expert"}; sharded trainers only)."""
        return self.actor_opt.state_numel()

    def mark_published(self, version: int) -> None:
        """Keep the weights of `version` (the behaviour policy of the next batches) in host memory, pinned when the
        actor is on a GPU, as slime's TensorBackuper keeps its actor / ref snapshots: the device holds only the
        actor and the behaviour copy (infra.device_memory counts both; the published versions are its `host`)."""
        def host_copy(v):
            if not torch.is_tensor(v):
                return v
            return torch.empty_like(v, device="cpu", pin_memory=v.is_cuda).copy_(v.detach())
        self.published[version] = {k: host_copy(v) for k, v in self.actor.state_dict().items()}
        for old in [v for v in self.published if v < version - 1]:
            del self.published[old]

    def connect_engines(self, urls: list, world_sizes: list, master_address: str = "") -> None:
        """The publisher of this run (every rank learns which; rank 0 alone speaks to the engines): with
        world_sizes (cluster) rank 0 of one group with every engine rank (cluster.WeightPublisher, NCCL; gloo on
        CPU), else the embedded engines load ckpt/latest from disk (rollout.DiskPublisher)."""
        self.push_weights = bool(world_sizes)
        if self.rank > 0:
            return
        if not world_sizes:
            self.publisher = rollout.DiskPublisher(urls, self.latest)
            return
        if not master_address:
            import ray
            master_address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.publisher = launch.WeightPublisher(
            [launch.SGLangClient(u) for u in urls], world_sizes, master_address,
            backend="nccl" if torch.cuda.is_available() else "gloo").connect()

    def publish(self, version: int) -> int:
        """Publish barrier (step 7): pause every engine, weights of `version` to them (broadcast under Hub names, or
        from the step's checkpoint on disk), resume; every rank keeps the published copy (mark_published)."""
        if self.rank == 0 and self.publisher is None:
            raise RuntimeError("Trainer.publish: no publisher; connect_engines(urls, world_sizes) comes first")
        gather = self.push_weights and (self.rank == 0 or self.sharded)  # sharded: every rank takes part
        weights = list(self.hub_weights().items()) if gather else None
        n = self.publisher.publish(weights, version) if self.rank == 0 else 0
        self.mark_published(version)
        return n

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.group is not None:
            import torch.distributed as dist
            if self.sharded:
                from megatron.core import parallel_state as ps
                ps.destroy_model_parallel()
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(self.group)
            self.group = None

    def warmup(self, samples: list[dict]) -> list[dict]:
        recs = self.steps.critic_warmup(self.critic, self.critic_opt, samples, self.args, self.group) if samples else []
        if self.rank == 0 or self.sharded:  # replicas: one file; shards: one per rank
            out = self.run_dir / "ckpt" / self.ckpt_name.replace("trainer", "critic_warm")
            out.parent.mkdir(parents=True, exist_ok=True)  # a --model-path run has no ckpt/sft to have made it
            torch.save({"critic": self.critic.state_dict(), "critic_opt": self.critic_opt.state_dict(),
                        "plan": parallel_plan(self.args) if self.sharded else None,
                        "param_dtype": self.args.param_dtype}, out.with_suffix(".tmp"))
            os.replace(out.with_suffix(".tmp"), out)  # whole or absent: a kill mid-save leaves no torn file
        return recs

    def train_step(self, samples: list[dict], step: int) -> dict:
        """Steps 5-7 on this step's samples, then the checkpoint (actor, critic, optimizers, step, RNG)."""
        t0 = time.time()
        versions = sorted({int(s["weight_version"]) for s in samples if s["weight_version"] is not None})
        if versions:
            self.behaviour.load_state_dict(self.published[versions[0]])  # the policy that sampled this batch
        stats = (self.steps.train_step(self.actor, self.behaviour, self.critic, self.actor_opt, self.critic_opt,
                                       samples, self.args, self.rng, self.run_dir, step, self.group, self.ref)
                 if samples else {})
        if self.rank == 0 or self.sharded:  # replicas are identical: one checkpoint; shards: every rank
            save_trainer(self.latest, self.save_actor, self._state(step), self.ckpt_name, self.rank, self._barrier)
        return {**stats, "time_train": time.time() - t0}


class TrainerGroup:
    """The trainer ranks behind the one handle the loop talks to: `group.method.remote(*a)` runs the method
    on every rank (in the same order on each) and returns rank 0's ObjectRef. The ranks move in lockstep
    through their collectives; an error of another rank surfaces at the next call (or hangs rank 0 in a
    collective until the group's timeout, 30 min, if that rank stays alive). `trainer`: the class of a rank
    (a subclass sets it: ppo.TrainerGroup runs ppo.Trainer, with ppo's step functions)."""

    trainer = Trainer

    def __init__(self, ray, args, sft_dir: str, step: int, options: list[dict]):
        self.ray, world = ray, len(options)
        self.ranks = [ray.remote(self.trainer).options(**o).remote(args, sft_dir, step, r, world)
                      for r, o in enumerate(options)]
        self.others = []  # the other ranks' refs of the last call
        if world > 1:
            address, port = ray.get(self.ranks[0].address.remote())
            ray.get([t.join_group.remote(address, port) for t in self.ranks])

    def __getattr__(self, name: str):
        if name.startswith("_"):  # pickle / copy probes: not a Trainer method
            raise AttributeError(name)

        def remote(*a, **kw):
            done, _ = self.ray.wait(self.others, num_returns=len(self.others), timeout=0) if self.others else ([], [])
            self.ray.get(done)  # raises the error of another rank in the last call
            refs = [getattr(t, name).remote(*a, **kw) for t in self.ranks]
            self.others = refs[1:]
            return refs[0]
        return SimpleNamespace(remote=remote)

