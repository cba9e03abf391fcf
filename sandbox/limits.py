"""What one trial may use: Limits (turns, tokens, wall time, output, processes, memory, disk) and make_limits.

Read by the sandboxes (sandbox/jail.py, sandbox/daytona.py, sandbox/harbor_env.py) and the agent loop
(rollout.py). Sizes the paper leaves open say "paper silent"; a task's Harbor [environment] memory_mb / storage_mb
lower them (sandbox/trial_caps.capped_limits). Standard library only.
"""
import dataclasses


@dataclasses.dataclass
class Limits:
    max_turns: int = 50
    """model calls per trial (parse-error and confirmation turns count)"""
    max_total_tokens: int = 8192
    """prompt + output tokens of the whole trajectory (the tiny model's context)"""
    trial_timeout_s: float = 900.0
    """wall time of the agent phase (capped further by the task's [agent] timeout_sec)"""
    agent_timeout_s: float = 0.0
    """> 0: replaces the task's [agent] timeout_sec (the evaluation protocol's override, 3600 s in the paper)"""
    verifier_timeout_s: float = 0.0
    """> 0: replaces the task's [verifier] timeout_sec (the evaluation protocol's override, 900 s in the paper)"""
    max_duration_s: float = 60.0
    """cap on one keystroke's `duration` (Terminus-2 caps waits at 60 s)"""
    cmd_timeout_s: float = 600.0
    """default timeout of one Sandbox.exec command (oracle, verifier use the task's timeouts)"""
    output_bytes: int = 10_000
    """output cap of one exec / one observation (Terminus-2 keeps the first and last parts of 10 KB)"""
    max_procs: int = 256
    """RLIMIT_NPROC of the trial's uid"""
    file_bytes: int = 256 << 20
    """RLIMIT_FSIZE: largest file a command may write"""
    mem_bytes: int = 4 << 30
    """RLIMIT_AS per process"""
    tmp_bytes: int = 256 << 20
    """size of the /tmp tmpfs (the agent's and, a fresh one, the verifier's)"""
    task_bytes: int = 1 << 30
    """cap on the file bytes of one copied task tree (environment/app, tests, solution); paper silent"""
    task_files: int = 100_000
    """cap on the entries of one copied task tree; paper silent"""
    disk_bytes: int = 1 << 30
    """bytes the trial may write on top of its staged task files: the agent's /app and /logs share one tmpfs, the
    verifier's /logs/verifier has another this size (RAM, charged to trial_mem_bytes); a task.toml's Harbor
    [environment] storage_mb lowers it; paper silent (Harbor's default: 10 GiB of disk)"""
    disk_inodes: int = 100_000
    """files, directories and hard links the trial may create there (the tmpfs's nr_inodes); paper silent"""
    trial_mem_bytes: int = 2 << 30
    """memory cgroup cap of the whole trial (both phases, every process, its tmpfs files and /tmp); a task.toml's
    [environment] memory_mb lowers it; 0: no cgroup, per-process RLIMIT_AS only; paper silent (Harbor: 2048 MB)"""
    trial_procs: int = 1024
    """pids cap of the trial's cgroup (processes and threads of both phases, root's included); paper silent"""
    keep_bytes: int = 1 << 30
    """a kept trial dir (keep_files) gets its files back on the host disk only while they take at most this many
    bytes; above it only host/ (the host's own logs, the transcript) and a note host/not_kept.txt (a run that keeps
    every trial, train_t1, sets it low so that agents cannot fill the host disk trial by trial); paper silent"""


def make_limits(limits):
    """Limits from None, a Limits, or a dict of field overrides (unknown keys raise)."""
    if limits is None or isinstance(limits, Limits):
        return limits or Limits()
    if not isinstance(limits, dict):
        raise ValueError(f"limits: expected Limits or dict, got {type(limits).__name__}")
    names = {f.name for f in dataclasses.fields(Limits)}
    bad = sorted(set(limits) - names)
    if bad:
        raise ValueError(f"limits: unknown keys {bad}; known: {sorted(names)}")
    return Limits(**limits)
