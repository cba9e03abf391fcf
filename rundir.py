"""The run directory: what a run leaves on disk, and how a killed run comes back to its last commit point.

A run directory holds args.json, state.json, log.txt, metrics.jsonl + tb/ (TensorBoard), samples/step_*.jsonl,
dropped.jsonl, failed_trials.jsonl, evals/ and ckpt/ (sft, critic_warm*.pt, latest, previous). state.json is the
single commit point of the run: it says which phases are done and which RL step is committed, and it is written
whole or not at all (write_atomic: a temp file renamed over it). Everything else a phase or step writes goes down
before its commit: RL step k saves ckpt/latest (save_trainer: the step's checkpoint, marked by step.json, with the
one it replaces kept as ckpt/previous), its metrics row and its samples, then commits k in state.json, then drops
ckpt/previous (prune_previous). A kill at any moment therefore leaves at most one step of uncommitted work, and
resume_run brings the directory back to what state.json committed: the newer checkpoint and rows are discarded
and the step is redone once, never adopted; work further ahead than one step cannot come from a kill and is
refused, never deleted.

Run: not by itself; train_t1.py writes the run directory, trainer.py saves the checkpoints (tests/test_resume.py).
Standard library and torch only (safetensors to check a checkpoint's weights, TensorBoard for Metrics).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch


# --- log.txt and metrics.jsonl ---------------------------------------------------------------------------

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


# --- checkpoints -----------------------------------------------------------------------------------------

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


# --- state.json and the JSONL files a kill may cut ------------------------------------------------------

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


# --- resume: back to the last commit point -----------------------------------------------------------

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
