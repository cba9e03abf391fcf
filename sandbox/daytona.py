"""Daytona sandboxes: the cluster-scale member of the sandbox interface (paper: rollout, infrastructure).

T1 runs every trial in a cloud sandbox (Daytona; about 600 instances a minute at scale). DaytonaSandbox has the
interface of sandbox.jail.Sandbox (start/close, context manager, exec, send_keys, read, run_verifier, host_dir) on a
Daytona sandbox, through the `daytona` Python SDK (imported only when a sandbox is made: requirements-cluster.txt).

Run: `python rollout.py --task DIR --agent oracle --sandbox daytona` (DAYTONA_API_KEY), or rollout.run_trial(...,
sandbox="daytona"). Tests (a fake client): tests/test_cluster.py.

Departures from the local Sandbox (sandbox/jail.py):
1. exec runs as the image's user (no per-trial uid / rlimits: Daytona's container is the boundary; as_root is
   ignored); a running exec cannot be interrupted by stop_event (checked before each call).
2. The terminal is tmux in the sandbox (Terminus-2's own mechanism); read() waits the full wait_s (no prompt
   detection on a captured pane).
3. The verifier runs in the agent's sandbox, as the image's user, after the agent's tmux server is killed:
   processes the agent detached with setsid live on and may rewrite /logs/verifier (no separate verifier jail).
"""
import atexit
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time

import reward
from sandbox.host_fs import copy_task_tree, write_host_file
from sandbox.limits import make_limits
from sandbox.terminal import KEYS, Capped


# === Daytona sandboxes (cluster scale) =============================================================
# Same interface as Sandbox (start/close, context manager, exec, send_keys, read, run_verifier) on a
# Daytona sandbox, through the `daytona` Python SDK (API followed: daytona 0.226.1 on PyPI; the paper
# pins v0.168.0, whose calls used here -- Daytona(DaytonaConfig(api_key)), create(params, timeout),
# CreateSandboxFromImageParams / CreateSandboxFromSnapshotParams, Image.from_dockerfile, Resources,
# sandbox.process.exec, sandbox.fs.upload_files / download_file, sandbox.delete -- have the same names).
# Created from the task's [environment] docker_image, else a Daytona snapshot (`snapshot=` or the
# task's [environment] daytona_snapshot), else environment/Dockerfile built by Daytona. The terminal
# is a tmux session inside the sandbox (Terminus-2's own mechanism): send_keys = `tmux send-keys`,
# read = the new part of `tmux capture-pane` since the last read. Cleanup: close() deletes the
# sandbox and runs on every exit path (context manager, run_trial's finally, a failed start, and an
# atexit hook for sandboxes still open); the sandbox is also created ephemeral with a TTL, so Daytona
# deletes it even if this process is killed. Departures from the local Sandbox: module docstring.
# Task dirs are uploaded from a host_fs.copy_task_tree copy (no links followed).
_DAYTONA_OPEN = set()  # sandboxes not yet closed, deleted at interpreter exit


@atexit.register
def _close_open_daytona():
    for box in list(_DAYTONA_OPEN):
        box.close()


def _task_resources(env_cfg):
    """[environment] cpus / memory_mb (or memory "4G") / storage_mb -> daytona Resources kwargs (GiB)."""
    res = {}
    if env_cfg.get("cpus"):
        res["cpu"] = int(math.ceil(float(env_cfg["cpus"])))
    mem = env_cfg.get("memory_mb")
    if mem is None and isinstance(env_cfg.get("memory"), str) and env_cfg["memory"][-1:].upper() in "GM":
        v = float(env_cfg["memory"][:-1])
        mem = v * 1024 if env_cfg["memory"][-1:].upper() == "G" else v
    if mem:
        res["memory"] = max(1, int(math.ceil(float(mem) / 1024)))
    if env_cfg.get("storage_mb"):
        res["disk"] = max(1, int(math.ceil(float(env_cfg["storage_mb"]) / 1024)))
    return res


class DaytonaSandbox:
    """A Daytona sandbox for one trial; context manager. API key from $DAYTONA_API_KEY (never an argument
    that could end up in a log); `client` = an existing daytona.Daytona (tests pass a fake one)."""

    SESSION = "t1"

    def __init__(self, task, root_dir, limits=None, stop_event=None, solution=False, client=None, snapshot=None,
                 ttl_minutes=None):
        self.task, self.root, self.limits = task, os.path.abspath(root_dir), make_limits(limits)
        self.stop_event, self.solution, self.client = stop_event or threading.Event(), solution, client
        self.snapshot, self.sandbox, self._seen = snapshot, None, ""
        self.host_dir = os.path.join(self.root, "host")  # host-written logs (oracle.txt, verifier_output.txt)
        agent_s = float(task.config.get("agent", {}).get("timeout_sec", self.limits.trial_timeout_s))
        verify_s = float(task.config.get("verifier", {}).get("timeout_sec", 600))
        self.ttl_minutes = ttl_minutes or int(math.ceil((agent_s + verify_s) / 60)) + 30  # backstop only

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def _client(self):
        if self.client is None:
            key = os.environ.get("DAYTONA_API_KEY")
            if not key:
                raise RuntimeError("DaytonaSandbox: DAYTONA_API_KEY is not set")
            try:
                from daytona import Daytona, DaytonaConfig
            except ImportError:
                raise RuntimeError("DaytonaSandbox: the `daytona` package is not installed "
                                   "(pip install -r requirements-cluster.txt)") from None
            self.client = Daytona(DaytonaConfig(api_key=key, api_url=os.environ.get("DAYTONA_API_URL") or None))
        return self.client

    def create_params(self):
        """The SDK's create params for this task (image, snapshot or Dockerfile; resources; network; TTL)."""
        from daytona import CreateSandboxFromImageParams, CreateSandboxFromSnapshotParams, Image, Resources
        env_cfg = self.task.config.get("environment", {}) or {}
        common = dict(labels={"t1-task": self.task.name}, ephemeral=True, ttl_minutes=self.ttl_minutes,
                      network_block_all=not bool(env_cfg.get("allow_internet", True)))
        snapshot = self.snapshot or env_cfg.get("daytona_snapshot")
        if snapshot and not env_cfg.get("docker_image"):
            return CreateSandboxFromSnapshotParams(snapshot=snapshot, **common)
        res = _task_resources(env_cfg)
        image = env_cfg.get("docker_image")
        if not image:
            dockerfile = os.path.join(self.task.env_dir, "Dockerfile")
            if not os.path.isfile(dockerfile):
                raise RuntimeError(f"DaytonaSandbox: task {self.task.name}: no docker_image, snapshot or {dockerfile}")
            image = Image.from_dockerfile(dockerfile)
        return CreateSandboxFromImageParams(image=image, resources=Resources(**res) if res else None, **common)

    def start(self):
        for d in ("logs/agent", "logs/verifier"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        os.makedirs(self.host_dir, mode=0o700, exist_ok=True)
        try:
            params = self.create_params()
            build_s = float((self.task.config.get("environment", {}) or {}).get("build_timeout_sec", 600))
            self.sandbox = self._client().create(params, timeout=build_s)
            _DAYTONA_OPEN.add(self)
            self._run("mkdir -p /app /logs/agent /logs/verifier /tests", 60)
            if self.solution and self.task.solution_dir:
                self._upload_dir(self.task.solution_dir, "/solution")
            rc, out = self._run("command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux) "
                                ">/dev/null 2>&1; command -v tmux >/dev/null && tmux new-session -d -s "
                                f"{self.SESSION} -x 160 -y 50 -c /app", 300)
            if rc != 0:
                raise RuntimeError("DaytonaSandbox: no tmux in the sandbox and it could not be installed: "
                                   f"{out[-300:]}")
        except BaseException:
            self.close()
            raise
        return self

    def _run(self, cmd, timeout, env=None):
        """bash -c cmd in the sandbox -> (exit code, output); 124 when the SDK reports a timeout."""
        try:
            r = self.sandbox.process.exec(f"bash -c {shlex.quote(cmd)}", cwd="/app", env=env,
                                          timeout=max(int(math.ceil(timeout)), 1))
        except Exception as e:  # the SDK raises DaytonaTimeoutError (or a transport error) on a timeout
            if "timeout" in type(e).__name__.lower() or "timed out" in str(e).lower():
                return 124, f"\n[command timed out after {timeout:g} s]"
            raise
        return int(r.exit_code if r.exit_code is not None else -1), r.result or ""

    def _upload_dir(self, local_dir, remote_dir):
        """Upload a task's dir (untrusted): first checked and copied by host_fs.copy_task_tree (no link followed
        or kept, no devices / FIFOs, size caps), then uploaded from that copy."""
        from daytona import FileUpload
        stage = tempfile.mkdtemp(prefix="upload-", dir=self.root)
        try:
            local = os.path.join(stage, "t")
            copy_task_tree(local_dir, local, self.limits.task_bytes, self.limits.task_files, links=False)
            files = []
            for d, _, names in os.walk(local):
                for n in names:
                    src = os.path.join(d, n)
                    dest = os.path.join(remote_dir, os.path.relpath(src, local))
                    files.append(FileUpload(source=src, destination=dest))
            if files:
                self.sandbox.fs.upload_files(files)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        self._run(f"chmod -R a+rX {shlex.quote(remote_dir)} 2>/dev/null; true", 60)

    def exec(self, cmd, timeout=None, env=None, as_root=False):
        """Run `bash -c cmd` in the sandbox -> (returncode, output capped); 124 on timeout."""
        if self.sandbox is None:
            raise RuntimeError("sandbox: exec before start()")
        if self.stop_event.is_set():
            return 130, "\n[cancelled]"
        rc, text = self._run(cmd, self.limits.cmd_timeout_s if timeout is None else timeout, env)
        out = Capped(self.limits.output_bytes)
        out.add(text.encode())
        return rc, out.text()

    # -- terminal (tmux in the sandbox) --
    def send_keys(self, keystrokes: str, deadline=None) -> int:
        """Type keystrokes (a tmux key name like C-c or Enter, or literal text; \\n presses Enter) -> 0.

        The remote `tmux send-keys` call is bounded by 30 s and by deadline (time.time() seconds)."""
        k, t = keystrokes.strip(), shlex.quote(self.SESSION)
        if re.fullmatch(r"C-[a-z]", k) or k in KEYS:
            cmd = f"tmux send-keys -t {t} {k}"
        else:
            parts = keystrokes.split("\n")
            cmd = "; ".join([f"tmux send-keys -t {t} -l {shlex.quote(p)}" if p else ":" for p in parts[:1]] +
                            [f"tmux send-keys -t {t} Enter"
                             + (f"; tmux send-keys -t {t} -l {shlex.quote(p)}" if p else "")
                             for p in parts[1:]])
        self._run(cmd, max(min(30.0, deadline - time.time()) if deadline is not None else 30.0, 1.0))
        return 0

    def read(self, wait_s=0.5) -> str:
        """Output since the last read (the new tail of the pane's history) after waiting wait_s, capped."""
        if self.stop_event.wait(max(wait_s, 0)):
            return ""
        _, pane = self._run(f"tmux capture-pane -p -J -S - -t {shlex.quote(self.SESSION)}", 30)
        pane = pane.rstrip("\n")
        new = pane[len(self._seen):] if pane.startswith(self._seen) else pane  # cleared screen: all of it
        self._seen = pane
        out = Capped(self.limits.output_bytes)
        out.add(new.lstrip("\n").encode())
        return out.text()

    # -- verifier --
    def run_verifier(self, scale=None) -> dict:
        """Copy the task's tests to /tests (only now), run `bash /tests/test.sh`, download the report, score with
        S = scale (None -> reward.SCALE). The agent's terminal (its tmux server and what runs in it) is killed
        first; processes it detached (setsid) live on: the container is the boundary here (module comment)."""
        scale = reward.SCALE if scale is None else scale
        vdir = os.path.join(self.root, "verifier")  # a fresh host dir, written only by this method
        os.mkdir(vdir, 0o700)
        self._run("tmux kill-server 2>/dev/null; rm -rf /logs/verifier && mkdir -p /logs/verifier /tests", 60)
        self._upload_dir(self.task.tests_dir, "/tests")
        timeout = self.limits.verifier_timeout_s or float(self.task.config.get("verifier", {}).get("timeout_sec", 600))
        rc, out = self.exec("bash /tests/test.sh", timeout=timeout, env={"PYTEST_ADDOPTS": "-p no:cacheprovider"})
        write_host_file(os.path.join(self.host_dir, "verifier_output.txt"), f"[exit {rc}]\n{out}")
        for name in ("ctrf.json", "reward.txt"):
            try:
                data = self.sandbox.fs.download_file(f"/logs/verifier/{name}")
            except Exception:  # absent: reward.compute falls back (binary, then none)
                continue
            if data is not None:
                data = data if isinstance(data, bytes) else str(data).encode()
                fd = os.open(os.path.join(vdir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
        return reward.compute(vdir, scale, n_assertions=self.task.n_assertions,
                              owner_uid=os.geteuid())  # the host wrote these copies

    def close(self):
        """Delete the sandbox (idempotent; errors are printed, never raised: close runs in finally blocks)."""
        box, self.sandbox = self.sandbox, None
        _DAYTONA_OPEN.discard(self)
        if box is None:
            return
        try:
            box.delete()
        except Exception as e:  # the TTL set at creation still deletes it
            print(f"[DaytonaSandbox] delete of {getattr(box, 'id', '?')} failed: {type(e).__name__}: {e}",
                  file=sys.stderr)


