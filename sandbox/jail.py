"""Sandbox: the bubblewrap jail of one trial (limits, terminal, keystrokes, verifier run).

Paper section "rollout" (T1, arXiv 2609.11042): every trial runs in a sandbox of its own; the agent's keystrokes
go to a real shell there; when it stops, the task's tests are copied in and its own verifier scores the trial
(reward.py: r = P/S). Sandbox is the local member of the sandbox interface, sandbox/daytona.py's DaytonaSandbox
the cluster's; rollout.run_trial picks one (sandbox="bwrap" | "daytona"). The interface: Box(task, root_dir, limits,
stop_event, solution).start() / close() (a context manager too), exec(cmd, timeout, env, as_root) -> (rc, output),
send_keys(keystrokes, deadline), read(wait_s) -> the new output, run_verifier(scale) -> reward.compute's report,
host_dir (the host's own logs).

Run (as root): through rollout.py, `python rollout.py --task DIR --agent oracle|nop [--keep DIR]`; tests:
tests/test_sandbox_security.py (a hostile agent, a hostile task dir), tests/test_sandbox_caps.py, tests/test_rollout.py.
The parts, each in its own module: Limits (sandbox/limits.py), the seccomp filter (sandbox/seccomp.py), the host's
file operations on untrusted trees (sandbox/host_fs.py), the jail's processes seen through /proc (sandbox/procs.py),
the terminal's text (sandbox/terminal.py), the per-trial caps (sandbox/trial_caps.py), the verifier's report channel
(sandbox/verifier_report.py); this module starts and closes the jails and runs commands, the terminal and the verifier.

The jails (the security contract):
- Two per trial, one after the other, each a long-lived bwrap whose command waits on a lifeline pipe (it ends when
  the process that started it dies, --die-with-parent besides) with new ipc/pid/net/uts/cgroup
  namespaces (no network: a private loopback only), every capability dropped; /usr, /etc (and
  the /bin, /lib links) read-only; the running Python's venv and base interpreter read-only at their own paths (so
  `pytest --ctrf` works inside); a size-capped fresh /tmp tmpfs; nothing else of the host.
- Every command enters a jail with nsenter and runs as a per-trial host uid under rlimits (prlimit): RLIMIT_NPROC,
  RLIMIT_FSIZE, RLIMIT_AS, no core; no_new_privs, no capabilities, the seccomp filter below.
- Per-trial caps (sandbox/trial_caps.py): the agent's uid is leased (flock) so no two live trials share one, in any
  process; the trial dir is a tmpfs of disk_bytes / disk_inodes beyond the staged task (the agent's /app and /logs;
  verifier/, with the verifier's /logs/verifier, another of its own; host/ a third); every command joins the trial's
  memory cgroup (trial_mem_bytes, no swap; trial_procs) before it runs. close(): the cgroup emptied and removed, the
  files copied back to the host disk (keep_files; bounded by the caps) and the tmpfs unmounted, then the uid
  released (a guard process does the same when the trial's process dies before close()).
- The agent's jail: /app and /logs writable (host dirs under the trial root, owned by the agent's uid 200000+),
  /tests empty and read-only, /solution (oracle only) a checked copy, read-only.
- The verifier's jail (run_verifier): the agent's jail is closed first (SIGKILL bwrap: its pid 1 dies, the kernel
  kills its pid namespace; run_verifier checks it is empty), /app is lchowned to the verifier's uid (agent uid +
  800000), then a fresh jail with /app, the task's tests read-only at /tests and a fresh /logs/verifier (a host dir
  the agent never owned); `bash /tests/test.sh` runs as the verifier's uid with the agent's rlimits. The jail is
  closed (every verifier process dead) before the report is decided (the verifier's report, below).
- seccomp (both jails, every command; sandbox/seccomp.py): open_by_handle_at, name_to_handle_at -> EPERM (a handle
  for the filesystem's root opened through the /app mount reaches the whole host); clone / unshare with
  CLONE_NEWUSER -> EPERM, clone3 -> ENOSYS (libc falls back to clone): a user namespace hands out every capability
  over new namespaces, where most escapes start, and no task needs one; add_key, keyctl, request_key -> EPERM
  (kernel keyrings are not namespaced: a key one trial stored outlived it and a later trial read it from
  /proc/keys); io_uring_setup / _enter / _register -> ENOSYS (libraries fall back to plain I/O; io_uring is a large
  kernel surface no task needs); x32 syscalls, unknown 32-bit ABIs -> EPERM. The verifier's commands get a second
  filter on top: ptrace, process_vm_readv, process_vm_writev, pidfd_getfd -> EPERM (the reporter's memory and
  socket).
- The verifier's report (local jail; the threat model): the verifier runs the agent's code as the verifier's uid
  (a test's subprocess, an imported module, `python -m pytest` from /app), and that code can write whatever the
  verifier can, /logs/verifier included (an all-passed ctrf.json made read-only before pytest's own write was paid
  in full). So no file pays here. The verifier's pytest reports each test over a Unix socket the host listens on
  (sandbox/verifier_report.py, bound read-only at /run/verifier-report) from a plugin the host's environment loads out
  of a read-only dir holding it alone (sandbox/verifier_report_plugin.py). The reporter makes itself non-dumpable and
  connects as pytest imports the plugin, before any conftest or test; the socket is close-on-exec; the verifier's filter
  refuses ptrace and its relatives. Agent code in another process therefore cannot write the report, cannot reach
  the reporter's socket or memory (/proc/PID/fd, mem, environ: EACCES; ptrace, process_vm_*, pidfd_getfd: EPERM)
  and cannot stand in for it: a second connection, or a reporter that did not end with its done line (killed,
  stopped until the timeout, interrupted), pays 0 with a reason naming it, never a fallback. PYTHONSAFEPATH:
  `python -m pytest` from /app imports the interpreter's pytest, and pdb / readline while pytest configures (the
  cwd is put back at session start, for tests that import from it). No reporter: 0 when test.sh runs pytest (the
  plugin was kept out), else reward.txt, the binary fallback of verifiers without pytest.
- Not protected, declared: (1) agent code imported into the reporting pytest (`sys.path.insert(0, "/app"); import
  solution`, a conftest or a lazily imported module from an /app cwd) runs inside the reporter and can rewrite its
  outcomes or lines: a forgery through a file no longer pays, a smarter in-process one would. The report names the
  modules loaded from outside the interpreter, the venv, /usr and /tests (reward_reason "agent code ran inside the
  reporting pytest ..."), best effort: such code can hide itself. (2) A test.sh that runs the agent's code before or
  beside its pytest: code left running could kill pytest before its plugin connects and report in its place. (3) A
  verifier without pytest: its reward.txt is written by a process tree that ran the agent's code. (4) Whatever the
  tests read that the verifier's uid can write (/app, /tmp) the agent's code may change while they run. (5)
  pytest-xdist workers (a test.sh with `-p xdist -n N`) run the tests and pass their reports to the reporter; they
  are not made non-dumpable, so agent code a test starts could rewrite a worker's memory (/proc/PID/mem). Daytona
  (sandbox/daytona.py), Harbor's environments (sandbox/harbor_env.py) and sandbox/harbor_run.py's Harbor runs still read
  ctrf.json and reward.txt from the verifier's folder (reward.compute): the forgeries this channel stops still pay
  there.
- Task dirs are untrusted (sandbox/host_fs.py's copy_task_tree for environment/app, tests, solution): a root that is
  a link, links absolute or leaving the tree, device files, FIFOs, sockets, more than Limits.task_files entries or
  task_bytes bytes: ValueError naming the path (the trial: "error").
- The host writes its own logs (host/oracle.txt, host/verifier_output.txt) into a root-only dir with O_CREAT |
  O_EXCL | O_NOFOLLOW; it reads nothing the agent wrote, and touches /app only once every agent process is dead
  (chown -R -P -h; rm -rf at the end: no link followed, any depth).
- Terminal: a pty (no tmux) running `bash -i` as session leader with the pty as controlling tty (C-c reaches the
  foreground job), started once its first prompt shows (up to SHELL_START_S); read() returns the output since the
  last read, ANSI stripped. Keystrokes never block: send_keys
  writes in chunks while draining the output, and drops what the terminal has not taken at the trial's deadline,
  on cancellation or after max_duration_s without progress (a paste into `sleep 100`), saying so in the next read().

Departures from the paper / Terminus-2:
1. Local bubblewrap jails, not Daytona/Docker: the task's Dockerfile is ignored, environment/app/ is copied to
   /app, the host's /usr provides the tools. bwrap runs as root without a user namespace (bwrap 0.8 as a plain uid
   cannot bind dirs below the 0700 trial root); commands run as unprivileged uids, the verifier too (Harbor's: root).
2. Caps per trial: processes (RLIMIT_NPROC of its uid, pids of its cgroup), memory (a cgroup; its files count, they
   are RAM), disk (tmpfs). Not bounded: CPU time. Sizes are paper silent (Limits, sandbox/limits.py; Harbor's
   task.toml memory_mb / storage_mb lower them). trial_mem_bytes=0 where no memory cgroup exists: memory is then
   capped per process only.
3. The agent is an unprivileged uid without network (Terminal-Bench agents are root): tasks that need apt/pip or
   root cannot be solved here. The host needs root, and uids 200000..1799999 unused (verifiers 1000000+).
4. Terminal state is the incremental output stream of a pty (keystroke echo included), not a tmux screen capture;
   read() may return before `duration` once the shell prompt is back.
5. The verifier reports through a socket, not ctrf.json (above): a test.sh that runs pytest twice pays 0 (two
   reporters; a test's own nested pytest does not report), python scripts test.sh runs directly do not get their dir
   on sys.path (PYTHONSAFEPATH), and debuggers (ptrace) do not work inside the verifier. The agent's jail keeps
   ptrace: tasks debug programs with gdb / strace, the agent can trace only its own uid, and all of it is dead
   before the verifier starts.
"""
import fcntl
import json
import os
import re
import select
import shlex
import shutil
import stat
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import reward
from sandbox import host_fs
from sandbox import procs
from sandbox import seccomp
from sandbox import terminal
from sandbox import trial_caps
from sandbox import verifier_report
from sandbox.limits import make_limits

# --- the verifier's environment -------------------------------------------------------------------------------------
# The verifier's pytest is this project's venv (bound read-only into the jail): its other plugins (xdist, anyio, ...)
# are the host's, not the task's, so they are not auto-loaded; only the CTRF reporter behind `pytest --ctrf` is.
# A clean pytest also takes ~40% off a trial (an oracle's test.sh 0.22-0.31 s against 0.42-0.70 s, loaded machine).
# The report channel's plugin (sandbox/verifier_report_plugin.py, from a read-only dir that holds it alone) reports each
# test to the host; PYTHONSAFEPATH: `python -m pytest` run from /app imports pytest, not an /app/pytest.py (the
# plugin removes these three from its own environment, so a test's subprocesses see none of them).
VERIFIER_ENV = {"PYTEST_ADDOPTS": f"-p no:cacheprovider -p ctrf.main -p {verifier_report.PLUGIN_NAME}",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": verifier_report.PLUGIN_DIR_IN_JAIL,
                "PYTHONSAFEPATH": "1"}
# Every process of a jail starts with umask 022 (Docker's default), whatever the host process's: a task's files get
# the modes a container would give them (under a host umask of 077 an agent's files came out 0600).
JAIL_UMASK = 0o022


# --- sandbox --------------------------------------------------------------------------------------
TOOLS = ("bwrap", "nsenter", "prlimit", "setpriv", "setsid", "chown")
PROMPT_END = "$ "  # the shell prompt is PS1='$PWD$ '
SHELL_START_S = 10.0  # how long a new terminal may take to show its first prompt before keystrokes go in
VERIFIER_UID_OFFSET = 800_000  # verifier uid = agent uid + this (agent uids 200000..999999, verifier 1000000..1799999)


class Sandbox:
    """A bubblewrap jail for one trial; context manager. See the module docstring for what is visible.

    Two jails in turn: the agent's (start(), until run_verifier()) and the verifier's (run_verifier()). The verifier
    runs as its own uid, agent uid + VERIFIER_UID_OFFSET, not the agent's: the agent's processes are all dead by
    then (its jail is closed and run_verifier checks its pid namespace is empty), but a distinct uid keeps that
    from being the only guard: a process of the agent's uid that survived by a bug could neither signal nor
    ptrace the verifier, nor write its /logs/verifier, and the report files must be owned by a uid that no agent
    process ever ran as.
    """

    def __init__(self, task, root_dir, limits=None, stop_event=None, solution=False, keep_files=True):
        """keep_files: close() copies the trial's files (its tmpfs) back to root_dir on the host disk, bounded by
        the disk caps; False: they are dropped with the tmpfs (a caller that deletes root_dir anyway)."""
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise RuntimeError(f"sandbox: missing tools {missing} (install bubblewrap and util-linux)")
        if os.geteuid() != 0:
            raise RuntimeError("sandbox: must run as root (namespaces, nsenter and per-trial uids)")
        trial_caps.check_tools()
        self.task, self.root = task, os.path.abspath(root_dir)
        self.limits = trial_caps.capped_limits(make_limits(limits), getattr(task, "config", None))
        self.stop_event, self.solution, self.keep_files = stop_event or threading.Event(), solution, keep_files
        self._disk = self._cgroup = None  # the trial's tmpfs (start) and memory cgroup (start; None: cap off)
        self._guard = None  # removes the tmpfs and cgroup if this process dies before close() (start)
        self._uid_lease = trial_caps.allocate_uid()  # until close(): no other live trial, in any process, has it
        self.uid = self._uid_lease.uid  # per-trial host uid (the agent's)
        self.verifier_uid = self.uid + VERIFIER_UID_OFFSET
        self.run_uid = self.uid  # the uid exec() and the terminal run as: the agent's, then the verifier's
        self.jail = self.term = self.pid = self.pidns = None  # pid: host pid of the jail's pid 1; pidns: its ns
        self._lifeline = -1  # the write end of the jail's lifeline pipe (_start_jail)
        self.master = -1  # pty master of the terminal
        self.host_dir = os.path.join(self.root, "host")  # host-written logs (oracle.txt, verifier_output.txt)
        self.verifier_logs = os.path.join(self.root, "verifier", "logs")  # the verifier's /logs/verifier
        self._pending = None  # terminal output drained by send_keys, returned by the next read()
        self._echoed = True  # output arrived since keystrokes last reached the tty (read()'s prompt check needs it)
        self.keys_dropped = 0  # bytes of keystrokes the terminal never took (send_keys)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def _bwrap_args(self, phase="agent"):
        a = ["bwrap", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(d):
                a += ["--symlink", os.readlink(d), d]
            elif os.path.isdir(d):
                a += ["--ro-bind", d, d]
        # /tmp first: a venv that lives under /tmp (a CI clone) is bound on top of the tmpfs, not hidden by it
        a += ["--perms", "1777", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp"]
        prefixes = {sys.prefix, sys.base_prefix, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
        for p in sorted(p for p in prefixes if not p.startswith("/usr/")):
            parts = p.strip("/").split("/")
            for i in range(1, len(parts)):  # intermediate dirs readable (0755), nothing else of them
                if "/" + "/".join(parts[:i]) != "/tmp":
                    a += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
            a += ["--ro-bind", p, p]
        r = self.root
        if phase == "agent":
            a += ["--bind", f"{r}/app", "/app", "--bind", f"{r}/logs", "/logs", "--ro-bind", f"{r}/tests", "/tests"]
            if self.solution and self.task.solution_dir:
                a += ["--ro-bind", f"{r}/solution", "/solution"]
        else:  # the verifier: the agent's /app, the task's tests, a fresh /logs/verifier, the report channel's
            # socket and plugin (root-owned, read-only); nothing else of the trial
            a += ["--bind", f"{r}/app", "/app", "--ro-bind", f"{r}/verifier/tests", "/tests",
                  "--perms", "0755", "--dir", "/logs", "--bind", self.verifier_logs, "/logs/verifier"]
            a += self.report_channel.bwrap_args()
        return a + ["--proc", "/proc", "--dev", "/dev", "--chdir", "/app"]

    def start(self):
        """Stage the task (untrusted: copy_task_tree, no link followed) and start the agent's jail."""
        r, L = self.root, self.limits
        os.makedirs(r, mode=0o700, exist_ok=True)
        st = os.lstat(r)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError(f"sandbox: trial dir {r} must be a directory owned by uid {os.geteuid()} (not a link)")
        os.chmod(r, 0o700)  # the trial's host dirs: reached only by root and through the jails' binds
        if os.listdir(r):
            raise ValueError(f"sandbox: trial dir {r} must be empty (the trial's tmpfs is mounted over it)")
        try:
            # the disk caps: the trial dir is a tmpfs (the agent's /app, /logs); verifier/ (the tests, the verifier's
            # /logs/verifier) and host/ are tmpfs mounts of their own, so a full /app cannot fail the verifier's start
            # or the host's logs. Each holds its staged files, then disk_bytes / disk_inodes more (host/: the host's).
            self._guard = trial_caps.Guard(self._uid_lease)
            self._disk = trial_caps.TrialDisk(r, self.uid)
            self._disk.mount("", 2 * L.task_bytes + L.disk_bytes, 2 * L.task_files + L.disk_inodes + 64)
            for d in ("host", "verifier", "logs", "logs/agent", "tests"):
                host_fs.make_dir(os.path.join(r, d), 0o700 if d in ("host", "verifier") else 0o755)  # fresh
            self._disk.mount("verifier", L.task_bytes + L.disk_bytes, L.task_files + L.disk_inodes + 64)
            self._disk.mount("host", trial_caps.HOST_BYTES, trial_caps.HOST_INODES)
            app_src = os.path.join(self.task.env_dir, "app")
            if os.path.lexists(app_src):
                host_fs.copy_task_tree(app_src, f"{r}/app", L.task_bytes, L.task_files)
            else:
                host_fs.make_dir(f"{r}/app", 0o755)
            # the tests are staged now in a host-only dir (the agent never sees them; a bad tree fails before the
            # agent phase) and bound into the verifier's jail only; None: the caller brings them (Harbor's upload_dir)
            if self.task.tests_dir is not None:
                host_fs.copy_task_tree(self.task.tests_dir, f"{r}/verifier/tests", L.task_bytes, L.task_files)
            if self.solution and self.task.solution_dir:
                host_fs.copy_task_tree(self.task.solution_dir, f"{r}/solution", L.task_bytes, L.task_files)
            for d in ("app", "logs"):
                host_fs.chown_tree(f"{r}/{d}", self.uid)
            for d in ("", "verifier"):
                used_bytes, used_inodes = self._disk.used(d)
                self._disk.resize(d, used_bytes + L.disk_bytes, used_inodes + L.disk_inodes)
            if L.trial_mem_bytes:  # the memory cap: every command that enters a jail joins this cgroup (_enter)
                self._cgroup = trial_caps.TrialCgroup(self.uid, L.trial_mem_bytes, L.trial_procs)
            else:
                trial_caps.say_memory_cap_off()
            self._start_jail(self._bwrap_args("agent"))
        except BaseException:
            self.close()  # no tmpfs, cgroup or uid lease left behind by a failed start (callers get no box to close)
            raise
        return self

    def _start_jail(self, args):
        """Start `args` (bwrap ...) running the lifeline wait as the jail's pid 1, under the seccomp filter.

        The jail's command blocks reading its stdin, the lifeline pipe, whose only write end this process holds: EOF
        and it exits (bwrap and the pid namespace with it) once this process dies, however it dies. --die-with-parent
        alone leaves a window: a parent killed between fork and bwrap's prctl(PR_SET_PDEATHSIG) orphaned a jail
        running `sleep infinity` for ever (seen once in CI: a SIGKILLed run left a jail behind)."""
        (rfd, wfd), (sfd, swfd), (lfd, self._lifeline) = os.pipe(), os.pipe(), os.pipe()
        prog = seccomp.seccomp_filter()
        os.write(swfd, prog)  # a few hundred bytes: fits the pipe buffer
        os.close(swfd)
        try:
            self.jail = subprocess.Popen(
                args[:1] + ["--info-fd", str(wfd), "--seccomp", str(sfd)] + args[1:] +
                ["--", "/bin/sh", "-c", "echo ready; exec cat >/dev/null"],  # stdin: the lifeline
                stdin=lfd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(wfd, sfd), start_new_session=True,
                umask=JAIL_UMASK)
        finally:
            os.close(wfd)
            os.close(sfd)
            os.close(lfd)
        with os.fdopen(rfd) as info:
            ready, _, _ = select.select([self.jail.stdout], [], [], 20)
            line = self.jail.stdout.readline() if ready else b""
            if line.strip() != b"ready":
                procs.kill_group(self.jail)
                raise RuntimeError(f"sandbox: bwrap did not start: {self.jail.stderr.read()[-800:].decode()!r}")
            self.pid = json.loads(info.read())["child-pid"]
        self.pidns = os.readlink(f"/proc/{self.pid}/ns/pid")

    def _close_jail(self, timeout=10.0):
        """Kill the jail (terminal, then bwrap: pid 1 dies, the kernel kills its pid namespace) and wait until no
        process is left in its pid namespace; RuntimeError if one is still there after `timeout` seconds."""
        procs.kill_group(self.term)
        self.term = None
        if self.master >= 0:
            os.close(self.master)
            self.master = -1
        procs.kill_group(self.jail)
        for s in (self.jail.stdout, self.jail.stderr) if self.jail else ():
            s.close()
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        ns, self.jail, self.pid, self.pidns = self.pidns, None, None, None
        deadline = time.time() + timeout
        while ns is not None and procs.pidns_procs(ns):
            if time.time() > deadline:
                raise RuntimeError(f"sandbox: processes {procs.pidns_procs(ns)} of the closed jail ({ns}) are still "
                                   f"alive after {timeout:g} s")
            time.sleep(0.02)

    def kill_uid(self, uid, timeout=10.0):
        """SIGKILL every process of `uid` in the jail (the jail itself stays); wait until they are gone."""
        deadline = time.time() + timeout
        while True:
            pids = procs.uid_procs_in(self.pidns, uid) if self.pidns else []
            if not pids:
                return
            if time.time() > deadline:
                raise RuntimeError(f"sandbox: processes {pids} of uid {uid} survive SIGKILL after {timeout:g} s")
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)

    def _env(self, extra=None):
        env = {"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TERM": "dumb",
               "LANG": "C.UTF-8", "PS1": "$PWD" + PROMPT_END, "PYTHONDONTWRITEBYTECODE": "1"}
        return {**env, **(extra or {})}

    def _enter(self, argv, as_root=False):
        """argv run inside the jail's namespaces as run_uid (or the jail's root, for Harbor's root execs), under the
        rlimits and the seccomp filter (installed on the host before nsenter; inherited by everything after), in the
        trial's memory cgroup (joined by the first host process, before any of it runs: a setsid cannot leave it),
        with HUP / INT / QUIT at their default action: a run started in the background (`nohup bash run.sh &`)
        ignores them and every child would inherit that (a verifier's pytest deaf to an agent script's SIGINT, C-c
        no longer interrupting the agent's commands: the jail's processes behaved by how the run was launched)."""
        L, u = self.limits, "0" if as_root else str(self.run_uid)
        caps = "-all,+chown,+dac_override,+fowner" if as_root else "-all"  # never dac_read_search (open_by_handle)
        return ((self._cgroup.join_argv() if self._cgroup is not None else []) + seccomp.seccomp_prefix() +
                ["env", "--default-signal=HUP,INT,QUIT",
                 "nsenter", "-t", str(self.pid), "-m", "-n", "-p", "-i", "-u", "-r", "--wdns=/app", "--",
                 "prlimit", f"--nproc={L.max_procs}", f"--fsize={L.file_bytes}", f"--as={L.mem_bytes}", "--core=0",
                 "--", "setpriv", "--reuid", u, "--regid", u, "--clear-groups", "--no-new-privs",
                 "--inh-caps=-all", f"--bounding-set={caps}", "--"] + list(argv))

    def exec(self, cmd, timeout=None, env=None, as_root=False):
        """Run `bash -c cmd` in the jail (non-interactive) -> (returncode, output capped); 124 on timeout."""
        if self.pid is None:
            raise RuntimeError("sandbox: exec before start()")
        timeout = self.limits.cmd_timeout_s if timeout is None else timeout
        p = subprocess.Popen(self._enter(["bash", "-c", cmd], as_root), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                             env=self._env(env), umask=JAIL_UMASK)
        out, deadline, note = terminal.Capped(self.limits.output_bytes), time.time() + timeout, ""
        fd, exited_at = p.stdout.fileno(), None
        while True:
            if time.time() > deadline or self.stop_event.is_set():
                note = f"\n[command timed out after {timeout:g} s]" if not self.stop_event.is_set() else "\n[cancelled]"
                procs.kill_group(p)  # the command's process group; escaped (setsid) processes die at close()
                break
            ready, _, _ = select.select([fd], [], [], 0.05)
            data = os.read(fd, 65536) if ready else b""
            if ready and not data:
                break  # EOF
            out.add(data)
            if p.poll() is not None and not data:  # exited; background children may hold the pipe
                exited_at = exited_at or time.time()
                if time.time() - exited_at > 0.2:
                    break
        p.stdout.close()
        rc = p.wait()
        return (124 if note.startswith("\n[command timed out") else rc), out.text() + note

    # -- terminal (pty) --
    def _open_terminal(self):
        self.master, slave = os.openpty()
        os.set_blocking(self.master, False)  # send_keys gives up at the deadline instead of blocking forever
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))  # rows, cols
        try:  # setsid -c: bash leads a new session with the pty as controlling tty (C-c works); default signal
            # dispositions: _enter
            shell = ["setsid", "-c", "bash", "--norc", "--noprofile", "-i"]
            self.term = subprocess.Popen(self._enter(shell),
                                         stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                         env=self._env(), umask=JAIL_UMASK)
        finally:
            os.close(slave)
        # wait for the shell's first prompt (kept for the next read()): on a loaded machine bash can take longer to
        # start than a fast agent's whole trial, whose keystrokes then sat unread in the tty when it was graded
        self._collect(self._pending_out(), time.time() + SHELL_START_S)

    def send_keys(self, keystrokes: str, deadline=None) -> int:
        """Type keystrokes (a tmux key name like C-c or Enter, or literal text) into the terminal -> bytes dropped.

        Never blocks past `deadline` (time.time() seconds; the trial's end) or stop_event: the pty master is
        non-blocking and written in chunks while the terminal's output is drained (kept for the next read(), so
        the pty cannot deadlock on a full output queue). A command that is not reading (`sleep 100` in the
        foreground) stops taking input once the tty's queue is full: the rest is dropped at the deadline, on
        cancellation, or after limits.max_duration_s without progress, and the next read() says how many bytes
        were not delivered (also counted in self.keys_dropped).
        """
        if self.term is None or self.term.poll() is not None:
            if self.master >= 0:
                os.close(self.master)
            self._open_terminal()  # first use, or the agent's shell exited: a fresh one
        k = keystrokes.strip()
        data = chr(ord(k[2]) - 96) if re.fullmatch(r"C-[a-z]", k) else terminal.KEYS.get(k, keystrokes)  # C-c -> \x03
        buf, sent, why = data.encode(), 0, None
        stall, last_progress = self.limits.max_duration_s, time.time()
        while sent < len(buf):  # one write attempt at least, then the limits
            now = time.time()
            left = 0.05 if deadline is None else max(deadline - now, 0)
            wait = min(0.05, max(stall - (now - last_progress), 0), left)
            readable, writable, _ = select.select([self.master], [self.master], [], wait)
            if readable and not self._drain():
                why = "the shell exited"  # the next send_keys restarts it
                break
            n = 0
            if writable:
                try:
                    n = os.write(self.master, buf[sent:sent + 4096])
                except BlockingIOError:
                    pass
                except OSError:
                    why = "the shell exited"
                    break
            if n:
                sent, last_progress, self._echoed = sent + n, time.time(), False
            now = time.time()
            if sent == len(buf):
                break
            if self.stop_event.is_set():
                why = "the trial was cancelled"
            elif deadline is not None and now >= deadline:
                why = "the trial's time ran out"
            elif now - last_progress >= stall:
                why = f"the terminal took none of them for {stall:g} s"
            if why:
                break
            if writable and not n:
                time.sleep(0.01)  # writable but full: do not spin
        dropped = len(buf) - sent
        if dropped:
            self.keys_dropped += dropped
            self._pending_out().add(f"\n[{dropped} of {len(buf)} bytes of keystrokes not delivered: "
                                    f"{why}]\n".encode())
        return dropped

    def _pending_out(self):
        if self._pending is None:
            self._pending = terminal.Capped(self.limits.output_bytes)
        return self._pending

    def _drain(self) -> bool:
        """Move the terminal's waiting output into the buffer the next read() returns; False once the shell exited."""
        try:
            data = os.read(self.master, 65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False  # EIO: the shell exited
        self._pending_out().add(data)
        self._echoed = self._echoed or bool(data)
        return bool(data)

    def read(self, wait_s=0.5) -> str:
        """Output since the last read, collected for up to wait_s (earlier once the prompt is back), capped."""
        if self.term is None:
            self._open_terminal()
        out, self._pending = self._pending or terminal.Capped(self.limits.output_bytes), None
        self._collect(out, time.time() + wait_s)
        return out.text()

    def _collect(self, out, end):
        """Terminal output into `out` (a terminal.Capped) until time `end`, stop_event, the shell's exit, or its
        prompt back and quiet for 50 ms, once output has come since the last keystrokes: a prompt from before them
        (the shell's first one, kept by send_keys) had ended a loaded machine's read before the command echoed."""
        last = bytes((out.head + out.tail)[-64:])
        while time.time() < end and not self.stop_event.is_set():
            ready, _, _ = select.select([self.master], [], [], min(0.05, max(end - time.time(), 0)))
            if not ready:
                if self._echoed and last.replace(b"\r", b"").endswith(PROMPT_END.encode()):
                    return  # shell prompt back and quiet for 50 ms
                continue
            try:
                data = os.read(self.master, 65536)
            except BlockingIOError:
                continue
            except OSError:
                return  # shell exited (after the first prompt wait: the next send_keys starts another)
            out.add(data)
            last, self._echoed = (last + data)[-64:], True

    # -- verifier --
    def run_verifier(self, scale=None) -> dict:
        """Close the agent's jail, run `bash /tests/test.sh` in a fresh jail of its own, close it, score.

        The verifier: uid verifier_uid (/app chowned to it once every agent process is dead, so it reads and may
        modify the agent's files as Harbor's root verifier could), no capabilities, the agent's rlimits, the
        seccomp filter with ptrace and its relatives refused too, a fresh /tmp, /tests read-only, a fresh
        /logs/verifier (a host dir the agent never owned), the report channel (sandbox/verifier_report.py). The report
        is decided only after every verifier process is dead: the pytest that reported through the channel pays;
        without any, reward.txt (a regular file owned by verifier_uid); a ctrf.json file never pays here.
        """
        scale = reward.SCALE if scale is None else scale
        self._close_jail()  # every agent process dies here (RuntimeError if one does not)
        host_fs.chown_tree(os.path.join(self.root, "app"), self.verifier_uid)
        host_fs.make_dir(self.verifier_logs, 0o755)  # fresh (FileExistsError on a second call)
        os.chown(self.verifier_logs, self.verifier_uid, self.verifier_uid)
        self.run_uid = self.verifier_uid
        self.report_channel = verifier_report.Channel(os.path.join(self.root, "verifier", "report"), self.verifier_uid)
        self.report_channel.start()
        try:
            self._start_jail(self._bwrap_args("verifier"))
            timeout = (self.limits.verifier_timeout_s or
                       float(self.task.config.get("verifier", {}).get("timeout_sec", 600)))
            # a second filter stacked on every command's: the verifier's refuses ptrace and process_vm_* as well
            cmd = shlex.join(seccomp.seccomp_prefix(verifier=True) + ["bash", "/tests/test.sh"])
            try:
                rc, out = self.exec(cmd, timeout=timeout, env=VERIFIER_ENV)
            finally:
                self._close_jail()  # every verifier process dies before the report is decided
        finally:
            self.report_channel.finish()
        host_fs.write_host_file(os.path.join(self.host_dir, "verifier_output.txt"), f"[exit {rc}]\n{out}")
        try:  # the host's staged copy (a checked regular file): does the task's verifier run pytest?
            test_sh = host_fs.read_beneath(os.path.join(self.root, "verifier", "tests"), "test.sh", 1 << 20)
        except (OSError, ValueError):
            test_sh = b""
        res = verifier_report.decide(self.report_channel, scale, n_assertions=self.task.n_assertions, test_sh=test_sh)
        if res is None:  # no pytest reported, none run: a verifier without pytest; its reward.txt is all there is
            res = reward.compute(self.verifier_logs, scale, n_assertions=self.task.n_assertions,
                                 owner_uid=self.verifier_uid,
                                 no_ctrf_reason="missing CTRF: no pytest reported through the report channel (a "
                                                "ctrf.json file does not pay in the local jail: the agent's code, run "
                                                "by the verifier, can write it)")
        return res

    def close(self):
        """Kill everything: the terminal, then bwrap (pid 1 of the jail dies -> its pid namespace is killed), then what
        is left in the trial's cgroup; remove the cgroup; copy the tmpfs's files out (keep_files) and unmount it;
        release the uid, unless a process of the trial may still be alive (then it stays leased until this process
        exits)."""
        errors = []
        try:
            self._close_jail()
        except RuntimeError as e:  # close() runs in finally blocks: report, never raise
            errors.append(str(e))
        if self._cgroup is not None:
            err = self._cgroup.close()
            errors += [err] if err else []
            self._cgroup = None if err is None else self._cgroup
        alive = bool(errors)  # a process of the trial may have survived: its uid is not handed out again
        if self._disk is not None:
            err = self._disk.close(self.keep_files, self.limits.keep_bytes)
            errors += [err] if err else []
            self._disk = None
        if alive:
            errors.append(f"uid {self.uid} stays leased until this process exits")
        else:
            self._uid_lease.release()
        if self._guard is not None:
            self._guard.close()  # after a clean close it finds nothing left; then the uid is free
            self._guard = None
        for e in errors:
            print(f"[Sandbox] {e}", file=sys.stderr)
