"""Per-trial caps of the local jail (sandbox/jail.py): a host uid of its own, a disk quota, a memory cgroup.

Paper section "rollout" (T1, arXiv 2609.11042): every trial runs in a sandbox of its own; its sizes are paper silent
(sandbox/limits.py's Limits documents the defaults). Used by sandbox/jail.py's Sandbox; tests:
tests/test_sandbox_caps.py.

- Uids (allocate_uid): the lowest uid of the range whose lock file in UID_LOCK_DIR (root-only) no live process holds
  with flock. The lease lasts as long as its descriptor (closed by release(), or by the kernel when the process
  dies), so two live trials never share a uid (RLIMIT_NPROC, keyrings and signals are per uid), across processes:
  Ray actors, pytest workers, several runs. A trial's process that dies before close() leaves its tmpfs and cgroups
  to its Guard (a process of its own session holding a copy of the uid's lock: the uid is free once they are gone);
  if the guard died too, they are removed when the uid is taken again.
- Disk (TrialDisk): the trial's root dir is a tmpfs mounted by the host (size=, nr_inodes=; a hard link counts as
  an inode), holding the agent's /app and /logs; its verifier/ (the tests, the verifier's /logs/verifier) and host/
  (the host's logs) are tmpfs mounts of their own, so an agent that fills its disk cannot fail the verifier's start
  or the host's writes. The verifier phase writes /app (the agent's budget) and /logs/verifier (its own); /tmp is a
  tmpfs of each jail. Their pages are RAM, charged to the memory cgroup of the process that writes them (the
  trial's). close() copies what they hold to the host disk when the caller keeps the trial dir (cp -a: links kept
  as links, hard links kept, holes kept: no more than the caps), then unmounts them.
- Memory (TrialCgroup): one cgroup per trial, cgroup v2 where a cgroup2 mount offers the memory controller, else
  cgroup v1's memory (+ pids) hierarchies, under <mount>/t1-sandbox/trial-<uid>: memory cap without swap, pids cap.
  Every command that enters the jail joins it before it execs (join_argv); an OOM kills a process of the trial,
  not the trial. close() SIGKILLs what is left in it and removes it. No usable memory cgroup: RuntimeError naming
  what is missing (a trial_mem_bytes of 0 runs with sandbox's per-process RLIMIT_AS only, said on stderr).
"""
import errno
import fcntl
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

UID_LOCK_DIR = "/run/t1-sandbox/uids"  # root-only: one lock file per uid ever leased on this host
UID_FIRST, UID_COUNT = 200_000, 800_000  # agent uids 200000..999999 (the verifiers': + jail.VERIFIER_UID_OFFSET)
CGROUP_PARENT = "t1-sandbox"  # <cgroup mount>/t1-sandbox/trial-<uid>
MOUNT_SOURCE = "t1-trial-{uid}"  # the tmpfs's source name: a leftover of a dead trial is found by it
HOST_BYTES, HOST_INODES = 64 << 20, 1024  # the host's own logs (root/host): written by the host only
JOIN_SH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


def _run(argv, what):
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"sandbox: {what} failed ({' '.join(argv)}): {p.stderr.strip()[-500:]}")


def mounts(path="/proc/self/mountinfo"):
    """[(mount point, fs type, source, super options)] of this mount namespace."""
    def unescape(s):
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)
    out = []
    with open(path) as f:
        for line in f:
            left, right = line.rstrip("\n").split(" - ", 1)
            fields, more = left.split(), right.split()
            out.append((unescape(fields[4]), more[0], unescape(more[1]), more[2] if len(more) > 2 else ""))
    return out


# --- uids -------------------------------------------------------------------------------------------------------
def _root_only_dir(path):
    """Create path (0700 root) if missing; RuntimeError unless every component we may create is a real dir owned by
    root and writable by root only."""
    os.makedirs(path, 0o700, exist_ok=True)
    p = path
    while p not in ("/", "/run"):
        st = os.lstat(p)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise RuntimeError(f"sandbox: {p} must be a directory owned by root, writable by root only "
                               f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
        p = os.path.dirname(p)


class UidLease:
    """A uid leased by allocate_uid: held while its lock file descriptor is open."""

    def __init__(self, uid, fd):
        self.uid, self._f = uid, os.fdopen(fd, "rb", buffering=0)  # closed on release(), GC or process death

    def release(self):
        self._f.close()

    def fileno(self):
        return self._f.fileno()

    @property
    def held(self):
        return not self._f.closed


def allocate_uid(lock_dir=UID_LOCK_DIR, first=UID_FIRST, count=UID_COUNT, reap=True) -> UidLease:
    """Lease the lowest uid in [first, first + count) that no live process holds (flock on lock_dir/<uid>).

    Lowest first: the lock files stay as many as the most trials ever live at once. A uid taken again after its
    holder died without close(): its leftovers (tmpfs, cgroups) are removed first (reap_leftovers)."""
    _root_only_dir(lock_dir)
    dfd = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for uid in range(first, first + count):
            fd = os.open(str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            lease = UidLease(uid, fd)
            if reap:
                reap_leftovers(uid)
            return lease
    finally:
        os.close(dfd)
    raise RuntimeError(f"sandbox: no free uid in {first}..{first + count - 1} ({count} live trials hold them all)")


# The guard: waits on a pipe whose only write end the trial's process holds; at EOF (close(), or that process's
# death, however it dies) it removes what is left of the trial. It holds a copy of the uid's lock until it is done,
# so the uid is not leased again before its leftovers are gone.
_GUARD = """import os, sys
sys.path.insert(0, sys.argv[1])
import trial_caps
while os.read(0, 4096):
    pass
trial_caps.reap_leftovers(int(sys.argv[2]))
"""


class Guard:
    """The guard process of a leased uid (see _GUARD); close() ends it after a clean close and waits for it."""

    def __init__(self, lease):
        r, self._w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARD, os.path.dirname(os.path.abspath(__file__)),
                 str(lease.uid)], stdin=r, stdout=subprocess.DEVNULL, pass_fds=(lease.fileno(),),
                start_new_session=True)  # its own session: a signal to the trial's process group does not reach it
        finally:
            os.close(r)

    def close(self, timeout=10.0):
        if self._w >= 0:
            os.close(self._w)
            self._w = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def reap_leftovers(uid):
    """Remove the tmpfs and the cgroups of a dead trial that held `uid` (call only while holding its lease)."""
    for point, fstype, source, _ in reversed(mounts()):
        if fstype == "tmpfs" and source == MOUNT_SOURCE.format(uid=uid):
            subprocess.run(["umount", "-l", point], capture_output=True)
            print(f"[trial_caps] removed the tmpfs of uid {uid} at {point}: its trial died without closing",
                  file=sys.stderr)
    for d in _cgroup_dirs(uid):
        if os.path.isdir(d):
            err = _remove_cgroup(d, 5.0)
            print(f"[trial_caps] removed the cgroup {d} of a trial that died without closing"
                  + (f" ({err})" if err else ""), file=sys.stderr)


# --- disk -------------------------------------------------------------------------------------------------------
class TrialDisk:
    """The trial's tmpfs mounts, all under its root dir and owned by the host (the jails reach them only through
    their binds): the root itself (the agent's /app, /logs), then mounts below it with budgets of their own."""

    def __init__(self, root, uid):
        self.root, self.source, self.points = os.path.abspath(root), MOUNT_SOURCE.format(uid=uid), []

    def _path(self, rel):
        return os.path.join(self.root, rel) if rel else self.root

    def mount(self, rel, size, inodes):
        """A tmpfs of size bytes and inodes (files, dirs, links) at root/rel ("": the root)."""
        path = self._path(rel)  # private: no copy of it propagates into other mount namespaces
        _run(["mount", "--make-private", "-t", "tmpfs", "-o",
              f"size={int(size)},nr_inodes={int(inodes)},mode=0700,nosuid,nodev", self.source, path],
             "mounting a trial tmpfs")
        self.points.append(path)

    def used(self, rel=""):
        """(bytes, inodes) in use on the tmpfs at root/rel."""
        st = os.statvfs(self._path(rel))
        return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_files - st.f_ffree

    def resize(self, rel, size, inodes):
        _run(["mount", "-o", f"remount,size={int(size)},nr_inodes={int(inodes)}", self._path(rel)],
             "resizing a trial tmpfs")

    def close(self, keep, keep_bytes=None):
        """Unmount them all; keep: first copy what they hold (cp -a: links not followed, hard links and holes kept)
        to the host disk and put it back at root; when they take more than keep_bytes, only host/ (the host's own
        logs) and a note host/not_kept.txt. -> None, or the error text (never raises: used in close())."""
        if not self.points:
            return None
        errors, stage = [], None
        if keep:
            try:
                stage = tempfile.mkdtemp(prefix=f".{os.path.basename(self.root)}-keep-", dir=os.path.dirname(self.root))
                used = sum((st.f_blocks - st.f_bfree) * st.f_frsize for st in map(os.statvfs, self.points))
                over = keep_bytes is not None and used > keep_bytes
                src, dst = (self.root + "/host/.", os.path.join(stage, "host")) if over else (self.root + "/.", stage)
                if over:
                    os.mkdir(dst, 0o700)
                p = subprocess.run(["cp", "-a", "--sparse=always", "--", src, dst], capture_output=True, text=True)
                if p.returncode != 0:
                    errors.append(f"copying the trial's files out: {p.stderr.strip()[-500:]}")
                if over:
                    with open(os.path.join(dst, "not_kept.txt"), "x") as f:
                        f.write(f"the trial's files took {used} bytes, more than keep_bytes = {keep_bytes}: only "
                                "host/ was kept\n")
            except OSError as e:
                errors.append(f"copying the trial's files out: {e}")
        p = subprocess.run(["umount", "-R", self.root], capture_output=True, text=True)  # the root, then below it
        if p.returncode != 0:  # busy: detached now, freed when its last user goes
            errors.append(f"umount -R {self.root}: {p.stderr.strip()[-300:]}; detached (umount -l)")
            subprocess.run(["umount", "-R", "-l", self.root], capture_output=True)
        self.points = []
        if stage is not None:
            try:
                for name in os.listdir(stage):
                    os.rename(os.path.join(stage, name), os.path.join(self.root, name))
                os.rmdir(stage)
            except OSError as e:
                errors.append(f"moving the kept files back into {self.root}: {e} (they are in {stage})")
        return "; ".join(errors) or None


# --- memory cgroup ----------------------------------------------------------------------------------------------
def cgroup_layout(mount_table=None):
    """Where trial cgroups go -> ("v2", mount point, None) | ("v1", memory mount, pids mount or None); RuntimeError
    naming what is missing when no memory controller is usable."""
    table = mounts() if mount_table is None else mount_table
    seen = []
    for point, fstype, _, _ in table:
        if fstype == "cgroup2":
            try:
                ctrl = open(os.path.join(point, "cgroup.controllers")).read().split()
            except OSError:
                ctrl = []
            if "memory" in ctrl:
                return "v2", point, None
            seen.append(f"cgroup2 at {point} without the memory controller (cgroup.controllers: {' '.join(ctrl)})")
    v1 = {}
    for point, fstype, _, opts in table:
        if fstype == "cgroup":
            for c in ("memory", "pids"):
                if c in opts.split(",") and c not in v1:
                    v1[c] = point
    if "memory" in v1:
        return "v1", v1["memory"], v1.get("pids")
    raise RuntimeError("sandbox: no usable memory cgroup for the trial's memory cap (no cgroup v1 memory hierarchy"
                       + (", " + "; ".join(seen) if seen else ", no cgroup2 mount") + "); mount one, or set "
                       "Limits.trial_mem_bytes=0 to run with the per-process RLIMIT_AS only")


def _cgroup_dirs(uid):
    try:
        kind, a, b = cgroup_layout()
    except RuntimeError:
        return []
    return [os.path.join(p, CGROUP_PARENT, f"trial-{uid}") for p in (a, b) if p]


def _write(path, value):
    with open(path, "w") as f:
        f.write(str(value))


def _procs(d):
    try:
        return [int(x) for x in open(os.path.join(d, "cgroup.procs")).read().split()]
    except FileNotFoundError:
        return []


def _remove_cgroup(d, timeout):
    """SIGKILL every process in cgroup d until none is left, then rmdir it -> None or the error text."""
    deadline = time.time() + timeout
    while True:
        pids = _procs(d)
        if not pids:
            try:
                os.rmdir(d)
                return None
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno != errno.EBUSY:
                    return f"rmdir {d}: {e.strerror}"
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.time() > deadline:
            return f"cgroup {d}: processes {pids} still alive (or it is busy) after {timeout:g} s"
        time.sleep(0.02)


class TrialCgroup:
    """The trial's cgroup(s): memory cap (swap none) and pids cap; join_argv() puts a command in them."""

    def __init__(self, uid, mem_bytes, max_procs, layout=None):
        kind, a, b = layout or cgroup_layout()
        self.kind, self.dirs = kind, []
        try:
            if kind == "v2":
                self._parent_v2(a)
                d = self._mkdir(a, uid)
                _write(f"{d}/memory.max", mem_bytes)
                if os.path.exists(f"{d}/memory.swap.max"):
                    _write(f"{d}/memory.swap.max", 0)
                if os.path.exists(f"{d}/pids.max"):
                    _write(f"{d}/pids.max", max_procs)
            else:
                d = self._mkdir(a, uid)
                _write(f"{d}/memory.limit_in_bytes", mem_bytes)
                if os.path.exists(f"{d}/memory.memsw.limit_in_bytes"):  # memory + swap: no swap beyond the cap
                    _write(f"{d}/memory.memsw.limit_in_bytes", mem_bytes)
                if b:
                    d = self._mkdir(b, uid)
                    _write(f"{d}/pids.max", max_procs)
        except BaseException:
            self.close(1.0)
            raise

    @staticmethod
    def _parent_v2(point):
        """Enable memory (and pids) for <point>/t1-sandbox's children: RuntimeError naming the file that refuses."""
        parent = os.path.join(point, CGROUP_PARENT)
        for d in (point, parent):
            os.makedirs(d, exist_ok=True)
            have = open(os.path.join(d, "cgroup.subtree_control")).read().split()
            avail = open(os.path.join(d, "cgroup.controllers")).read().split()
            want = [c for c in ("memory", "pids") if c in avail and c not in have]
            if "memory" not in avail:
                raise RuntimeError(f"sandbox: cgroup v2: no memory controller in {d}/cgroup.controllers; set "
                                   f"Limits.trial_mem_bytes=0 to run with the per-process RLIMIT_AS only")
            for c in want:
                try:
                    _write(os.path.join(d, "cgroup.subtree_control"), f"+{c}")
                except OSError as e:
                    if c == "memory":
                        raise RuntimeError(f"sandbox: cgroup v2: cannot enable the memory controller in "
                                           f"{d}/cgroup.subtree_control ({e.strerror}: a cgroup with processes "
                                           f"of its own cannot delegate it); run from a cgroup tree that "
                                           f"delegates memory, or set Limits.trial_mem_bytes=0") from None

    def _mkdir(self, point, uid):
        parent = os.path.join(point, CGROUP_PARENT)
        os.makedirs(parent, exist_ok=True)
        d = os.path.join(parent, f"trial-{uid}")
        os.mkdir(d)  # FileExistsError: a live trial with this uid (the lease says none) or an unreaped leftover
        self.dirs.append(d)
        return d

    def join_argv(self):
        """argv prefix: a host shell that moves itself into the trial's cgroups, then execs the rest (exit 125 if a
        write fails: never run outside the cap)."""
        return ["/bin/sh", "-c", JOIN_SH, "cgroup-join"] + [f"{d}/cgroup.procs" for d in self.dirs] + ["--"]

    def procs(self):
        return sorted({p for d in self.dirs for p in _procs(d)})

    def oom_kills(self):
        """Processes the kernel's OOM killer killed in the trial's memory cgroup so far."""
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        for line in open(os.path.join(self.dirs[0], name)):
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self, timeout=10.0):
        """SIGKILL what is left in the cgroups, remove them -> None or the error text (never raises)."""
        errors = [e for e in (_remove_cgroup(d, timeout) for d in reversed(self.dirs)) if e]
        self.dirs = [d for d in self.dirs if os.path.isdir(d)]
        return "; ".join(errors) or None


# --- limits from task.toml ----------------------------------------------------------------------------------------
def _harbor_mb(env, name, legacy):
    """Harbor's [environment] <name> (int MB) or its deprecated <legacy> ("4G", "512M", "1024K"; it wins, as in
    Harbor's EnvironmentConfig) -> bytes or None."""
    if legacy in env:
        s = env[legacy]
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([GgMmKk])\s*", s) if isinstance(s, str) else None
        if not m:
            raise ValueError(f"task.toml [environment] {legacy}: expected a size like '4G' or '512M', got {s!r}")
        mb = float(m.group(1)) * {"G": 1024, "M": 1, "K": 1 / 1024}[m.group(2).upper()]
    elif name in env:
        mb = env[name]
        if isinstance(mb, bool) or not isinstance(mb, int):
            raise ValueError(f"task.toml [environment] {name}: expected an integer (MB), got {mb!r}")
    else:
        return None
    if not 1 <= mb <= 1 << 30:
        raise ValueError(f"task.toml [environment] {legacy if legacy in env else name}: {mb:g} MB is out of range "
                         f"(1 MB .. 1 PB)")
    return int(mb * (1 << 20))


def task_caps(config):
    """(memory bytes, storage bytes) a task.toml asks for in Harbor's [environment] memory_mb / storage_mb (or the
    deprecated memory / storage strings); None where absent. ValueError naming the field when malformed."""
    env = (config or {}).get("environment", {})
    if not isinstance(env, dict):
        raise ValueError(f"task.toml [environment]: expected a table, got {type(env).__name__}")
    return _harbor_mb(env, "memory_mb", "memory"), _harbor_mb(env, "storage_mb", "storage")


def capped_limits(limits, config):
    """limits (a limits.Limits) checked, with the task's Harbor [environment] memory / storage as lower caps (the
    memory cap only where it is on) -> a new Limits. ValueError naming the field when a cap is out of range."""
    import dataclasses
    for name, low in (("disk_bytes", 1 << 20), ("disk_inodes", 16), ("trial_mem_bytes", 0), ("trial_procs", 16)):
        v = getattr(limits, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low or (name == "trial_mem_bytes" and 0 < v < 16 << 20):
            raise ValueError(f"limits.{name}: expected an integer >= {low}"
                             + (" (0: off, else >= 16 MiB)" if name == "trial_mem_bytes" else "") + f", got {v!r}")
    mem, disk = task_caps(config)
    return dataclasses.replace(limits, disk_bytes=min(limits.disk_bytes, disk or limits.disk_bytes),
                               trial_mem_bytes=min(limits.trial_mem_bytes, mem) if mem and limits.trial_mem_bytes
                               else limits.trial_mem_bytes)


_said_off = []


def say_memory_cap_off():
    """trial_mem_bytes == 0: the per-process RLIMIT_AS is the only memory bound; said once per process."""
    if not _said_off:
        _said_off.append(True)
        print("[trial_caps] trial_mem_bytes=0: no memory cap per trial (per-process RLIMIT_AS only)", file=sys.stderr)


def check_tools():
    missing = [t for t in ("mount", "umount", "cp") if shutil.which(t) is None]
    if missing:
        raise RuntimeError(f"sandbox: missing tools {missing} (util-linux, coreutils)")
