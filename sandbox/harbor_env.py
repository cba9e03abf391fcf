"""Harbor's environment over the local bubblewrap jail: BwrapEnvironment (Harbor imports it from its own venv,
import_path "sandbox.harbor_env:BwrapEnvironment", PYTHONPATH=repo) and ToolsSandbox, the sandbox.jail.Sandbox it
drives.

Machinery of the Harbor path (sandbox/harbor_run.py runs Harbor through engine/gateway.py; paper section "TITO";
the jail's rules: below and sandbox/jail.py). Run: `python -m engine.gateway harbor-trial ...` writes the Harbor
config that names this class. Imports only the standard library and sandbox/jail.py, sandbox/host_fs.py,
sandbox/limits.py (and what they import: reward.py, standard library only): Harbor's venv has no torch.

Departures (sandbox/harbor_run.py departure 1: Harbor's agent in the bubblewrap jail of sandbox/jail.py, not Docker):
1. The task's Dockerfile is ignored, environment/app/ is copied to /app, the host's /usr provides the tools (tmux
   included), and the main venv is mounted read-only and put on PATH for `pytest --ctrf`.
2. Commands run as the trial's unprivileged uid, `user="root"` as the jail's root with chown / dac_override /
   fowner only; all under sandbox/jail.py's seccomp filter and rlimits.
3. The first root exec (Harbor's reward-file cleanup) or tests upload after agent commands ends the agent phase:
   every process of the agent's uid is SIGKILLed (checked gone) and /logs/verifier is replaced by a fresh dir.
4. Task dirs Harbor uploads go through host_fs.copy_task_tree; files the jail wrote are read and written by the
   host without following links (host_fs.read_beneath / write_beneath).
5. Weaker than rollout.py's native path, because Harbor drives the verifier through the same environment: the
   verifier runs in the agent's jail (same /tmp, which the agent may have filled; same mount namespace), as
   Harbor's default user (the agent's uid, so its files in /logs/verifier are the agent uid's) or, for
   `user="root"` execs, as the jail's root, which is not under RLIMIT_NPROC and may read and write every file
   the jail can see (not the host's: no dac_read_search, no handle syscalls); the phase ends only if Harbor's
   verifier starts with a root exec or a tests upload (Harbor >= 0.25 does both), and a root exec in mid-run
   (not Terminus-2's) would kill the agent's processes. The report channel of rollout.py's verifier (a socket only
   its pytest holds) is not used here: Harbor reads the files its verifier leaves in /logs/verifier, so agent code
   that the verifier runs (a test's subprocess, an imported module) can write the report that pays. Use rollout.py
   for rewards that train; this path measures Harbor's own harness.
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from sandbox import host_fs
from sandbox import jail
from sandbox.limits import Limits

# --- Harbor: environment class (imported by Harbor from its own venv) ---------------------------------
try:  # only inside Harbor's venv (Python >= 3.12); the main venv never imports harbor
    from harbor.environments.base import BaseEnvironment, ExecResult
    from harbor.environments.capabilities import EnvironmentCapabilities
except ImportError:
    BaseEnvironment = None

if BaseEnvironment is not None:
    import asyncio
    import base64

    class BwrapEnvironment(BaseEnvironment):
        """Harbor environment = sandbox.jail.Sandbox (bubblewrap jail, no network). kwargs: tools_prefix (a venv
        mounted read-only and first on PATH, e.g. the main .venv for `pytest --ctrf`), max_procs."""

        def __init__(self, *args, tools_prefix=None, max_procs=256, **kwargs):
            self.tools_prefix = os.path.abspath(tools_prefix) if tools_prefix else None
            self.max_procs = int(max_procs)
            self.box = self.root = None
            super().__init__(*args, **kwargs)

        @staticmethod
        def type() -> str:
            return "bwrap"

        @property
        def capabilities(self) -> EnvironmentCapabilities:
            return EnvironmentCapabilities(disable_internet=True)

        def _validate_definition(self):
            if not Path(self.environment_dir).is_dir():
                raise FileNotFoundError(f"{self.environment_dir}: no environment dir")

        async def start(self, force_build: bool) -> None:
            import types
            task = types.SimpleNamespace(env_dir=str(self.environment_dir), solution_dir=None, config={},
                                         tests_dir=None, name=self.environment_name)
            self.root = tempfile.mkdtemp(prefix=f"harbor-{self.environment_name}-")
            limits = Limits(output_bytes=4 << 20, max_procs=self.max_procs, cmd_timeout_s=3600)
            self.box = _ToolsSandbox(task, self.root, limits, tools_prefix=self.tools_prefix).start()
            os.makedirs(f"{self.root}/logs/artifacts", exist_ok=True)

        async def stop(self, delete: bool):
            if self.box is not None:
                self.box.close()
            if delete and self.root:
                err = host_fs.remove_tree(self.root)
                if err:
                    print(f"[BwrapEnvironment] {err}", file=sys.stderr)

        def _host(self, path: str) -> str | None:
            """Host path behind a jail path (/app, /logs, /tests are host dirs), None elsewhere."""
            p = os.path.normpath("/" + str(path).lstrip("/"))
            for top in ("/app", "/logs", "/tests"):
                if p == top or p.startswith(top + "/"):
                    return (os.path.join(self.root, top[1:], os.path.relpath(p, top)) if p != top
                            else os.path.join(self.root, top[1:]))
            return None

        async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None) -> ExecResult:
            user = self._resolve_user(user)
            cmd = f"cd {cwd} && {command}" if cwd else command
            rc, out = await asyncio.to_thread(self.box.exec, cmd, timeout_sec or None, self._merge_env(env),
                                              user in ("root", 0, "0"))  # a root exec ends the agent phase
            return ExecResult(stdout=out, stderr="", return_code=rc)

        async def _internal_exec(self, cmd):
            """A file transfer through the jail (paths outside /app, /logs, /tests), as the jail's root: not a root
            exec of Harbor's, so it does not end the agent phase (Terminus-2 uploads its pastes this way)."""
            rc, out = await asyncio.to_thread(self.box.exec, cmd, None, None, True, True)
            return ExecResult(stdout=out, stderr="", return_code=rc)

        def _host_rel(self, path):
            """(host dir behind a jail top dir, path relative to it) or None outside /app, /logs, /tests."""
            host = self._host(path)
            if host is None:
                return None
            top = next(t for t in ("app", "logs", "tests") if host == os.path.join(self.root, t) or
                       host.startswith(os.path.join(self.root, t) + "/"))
            return os.path.join(self.root, top), os.path.relpath(host, os.path.join(self.root, top)), top

        async def upload_file(self, source_path, target_path):
            hr = self._host_rel(target_path)
            if hr is not None:  # the jail can write these dirs: no link of theirs is followed (write_beneath)
                base, rel, top = hr
                if top == "tests":  # the tests come in only for the verifier: the agent phase ends
                    await asyncio.to_thread(self.box.end_agent_phase)
                with open(source_path, "rb") as f:  # a host file Harbor chose (upload_dir passes a checked copy)
                    data = f.read()
                host_fs.write_beneath(base, rel, data, 0o755 if os.access(source_path, os.X_OK) else 0o644,
                                      uid=self.box.uid if top == "app" else None)
                return
            data = base64.b64encode(Path(source_path).read_bytes()).decode()  # elsewhere: through the shell
            await self._internal_exec(f"mkdir -p $(dirname '{target_path}') && : > '{target_path}'")
            for i in range(0, len(data), 64 << 10):
                await self._internal_exec(f"echo '{data[i:i + (64 << 10)]}' | base64 -d >> '{target_path}'")

        async def upload_dir(self, source_dir, target_dir):
            stage = tempfile.mkdtemp(prefix="upload-", dir=self.root)
            try:  # the source is a task's dir (untrusted): checked and copied without following links first
                host_fs.copy_task_tree(source_dir, os.path.join(stage, "t"), self.box.limits.task_bytes,
                                       self.box.limits.task_files, links=False)
                for d, _, files in os.walk(os.path.join(stage, "t")):
                    for f in files:
                        src = os.path.join(d, f)
                        await self.upload_file(src, os.path.join(str(target_dir),
                                                                 os.path.relpath(src, os.path.join(stage, "t"))))
            finally:
                shutil.rmtree(stage, ignore_errors=True)

        async def download_file(self, source_path, target_path):
            hr = self._host_rel(source_path)
            Path(target_path).parent.mkdir(parents=True, exist_ok=True)
            if hr is not None:  # written by the jail: read without following links, capped
                Path(target_path).write_bytes(host_fs.read_beneath(hr[0], hr[1], self.box.limits.task_bytes))
                return
            res = await self._internal_exec(f"base64 -w0 '{source_path}'")
            if res.return_code != 0:
                raise FileNotFoundError(f"{source_path}: {res.stdout}")
            Path(target_path).write_bytes(base64.b64decode(res.stdout.strip()))

        async def download_dir(self, source_dir, target_dir):
            host = self._host(source_dir)
            if host is None:
                raise NotImplementedError(f"bwrap environment: download_dir outside /app, /logs, /tests: {source_dir}")
            if os.path.lexists(host):  # written by the jail: no link kept or followed, capped (copy_task_tree)
                stage = tempfile.mkdtemp(prefix="download-", dir=self.root)
                try:
                    host_fs.copy_task_tree(host, os.path.join(stage, "t"), self.box.limits.task_bytes,
                                           self.box.limits.task_files, links=False)
                    shutil.copytree(os.path.join(stage, "t"), target_dir, dirs_exist_ok=True)  # our own copy
                finally:
                    shutil.rmtree(stage, ignore_errors=True)


def _tools_sandbox_class():
    class ToolsSandbox(jail.Sandbox):
        """sandbox.jail.Sandbox with /tests writable by the jail's root (Harbor empties and fills it) and a tools
        venv (the main .venv: pytest, pytest-ctrf) mounted read-only and first on PATH."""

        def __init__(self, *args, tools_prefix=None, **kw):
            super().__init__(*args, **kw)
            self.tools_prefix = tools_prefix
            self.agent_ran = False  # a command of the agent's uid ran since the agent phase last ended

        def exec(self, cmd, timeout=None, env=None, as_root=False, transfer=False):
            """Sandbox.exec; a root exec (not a file transfer) that follows the agent's commands ends the agent
            phase first (end_agent_phase)."""
            if as_root and not transfer:
                self.end_agent_phase()
            elif not as_root:
                self.agent_ran = True
            return super().exec(cmd, timeout, env, as_root)

        def end_agent_phase(self):
            """After agent commands ran: SIGKILL every process of the agent's uid (RuntimeError if one survives),
            then give /logs/verifier a fresh dir, so nothing the agent left there (a forged report, a link, a
            process rewriting it) is read. The dir is owned by the agent's uid: Harbor's verifier runs as the
            environment's default user (the agent's uid) unless the task names a verifier user."""
            if not self.agent_ran:
                return
            self.kill_uid(self.uid)
            self.agent_ran = False
            logs = os.path.join(self.root, "logs")
            fd = os.open(logs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                try:
                    st = os.lstat("verifier", dir_fd=fd)
                    if stat.S_ISDIR(st.st_mode):  # rm -rf: fts, never follows a link inside, any depth
                        err = host_fs.remove_tree(os.path.join(logs, "verifier"))
                        if err:
                            raise RuntimeError(f"sandbox: {err}")
                    else:
                        os.unlink("verifier", dir_fd=fd)
                except FileNotFoundError:
                    pass
                host_fs.make_dir("verifier", 0o755, dir_fd=fd)
                os.chown("verifier", self.uid, self.uid, dir_fd=fd, follow_symlinks=False)
            finally:
                os.close(fd)

        def _bwrap_args(self, phase="agent"):
            a = super()._bwrap_args(phase)
            i = a.index(f"{self.root}/tests")
            a[i - 1] = "--bind"  # root-owned 0755: the agent's uid still cannot write it
            for p in self._tool_paths():
                parts = p.strip("/").split("/")
                for k in range(1, len(parts)):  # intermediate dirs readable, nothing else of them
                    a += ["--perms", "0755", "--dir", "/" + "/".join(parts[:k])]
                a += ["--ro-bind", p, p]
            return a

        def _tool_paths(self):
            if not self.tools_prefix:
                return []
            cfg = os.path.join(self.tools_prefix, "pyvenv.cfg")
            home = None
            if os.path.isfile(cfg):
                for line in open(cfg):
                    if line.split("=")[0].strip() == "home":
                        home = os.path.dirname(line.split("=", 1)[1].strip())
            real = os.path.realpath(self.tools_prefix)  # a venv reached through a link (a worktree's): its scripts'
            # shebangs name the real path
            return sorted({p for p in (self.tools_prefix, real, home) if p and not p.startswith("/usr/")})

        def _env(self, extra=None):
            env = super()._env(extra)
            if self.tools_prefix:
                env["PATH"] = f"{self.tools_prefix}/bin:" + env["PATH"]
            return env
    return ToolsSandbox


def _ToolsSandbox(*args, **kw):  # noqa: N802  (a factory: BwrapEnvironment.start and the tests build the box here)
    return _tools_sandbox_class()(*args, **kw)
