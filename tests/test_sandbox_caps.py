"""Per-trial caps of the local jail (sandbox/trial_caps.py, sandbox/jail.py's Sandbox): a disk quota (bytes and inodes)
on all the trial can write, a memory cgroup for the whole trial, uids that two live trials never share. Each test
plays the attacker with small caps (64 MiB, 1000 inodes) so it runs in seconds.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sandbox import jail  # noqa: E402
from sandbox import task_io  # noqa: E402
from sandbox import trial_caps  # noqa: E402
from test_rollout import TEST_SH, make_task  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not jail.shutil.which("bwrap"),
                                reason="the bubblewrap sandbox needs root and bwrap")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
SMALL = {"disk_bytes": 64 * MiB, "disk_inodes": 1000, "file_bytes": 256 * MiB, "tmp_bytes": 32 * MiB,
         "trial_mem_bytes": 512 * MiB}


def du_bytes(path):
    """Bytes a tree takes on its disk (allocated blocks; hard links once)."""
    seen, total = set(), 0
    for d, dirs, files in os.walk(path):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def test_trial_writes_past_the_disk_caps_get_enospc_in_both_phases_and_the_kept_copy_is_bounded(tmp_path):
    task = make_task(tmp_path)
    (task / "tests" / "test.sh").write_text(  # the verifier phase (agent code run by the verifier) fills it too
        "(head -c 100M /dev/zero > /logs/verifier/fill) 2>&1 | grep -q 'No space' && echo VERIFIER-LOGS-FULL\n"
        "(head -c 100M /dev/zero > /app/vfill) 2>&1 | grep -q 'No space' && echo VERIFIER-APP-FULL\n"
        "rm -f /logs/verifier/fill /app/vfill\n" + TEST_SH.split("\n", 1)[1])
    host = os.stat(tmp_path).st_dev
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", SMALL) as box:
        assert os.stat(box.root).st_dev != host and os.stat(f"{box.root}/app").st_dev != host  # not the host disk
        for target in ("/app/big", "/logs/big", "/logs/agent/big", "/tmp/big"):
            rc, out = box.exec(f"head -c 100M /dev/zero > {target}; echo rc=$?; rm -f {target}")
            assert "No space left on device" in out and "rc=1" in out, (target, out)
        rc, out = box.exec("for i in $(seq 1 2000); do : > /app/f$i || { echo stopped at $i; break; }; done")
        assert "No space left on device" in out and "stopped at" in out, out  # the inode cap
        assert int(out.split("stopped at ")[1].split()[0]) == 1001  # 1000 made, the next refused
        rc, out = box.exec("rm -f /app/f*; head -c 30M /dev/zero > /app/h; for i in $(seq 1 2000); do "
                           "ln /app/h /app/h$i 2>/dev/null || { echo links stop at $i; break; }; done")
        assert "links stop at" in out, out  # a hard link is an inode too
        rc, out = box.exec("rm -f /app/h{101..2000}; truncate -s 200M /app/sparse && mkdir -p /app/a/b && "
                           "ln -s /etc/shadow /app/a/b/l && mkfifo /app/fifo && echo ok")
        assert out.strip() == "ok", out
        box.exec("echo sort > /app/note; sort in.txt > out.txt")
        rc, out = box.exec("head -c 100M /dev/zero > /app/full; for i in $(seq 1 2000); do : > /logs/f$i || break; "
                           "done; df /app | tail -1")  # the agent leaves its disk full, bytes and inodes
        assert " 100% " in out, out
        res = box.run_verifier()  # its own budget: the full /app does not fail the verifier or the host's logs
        assert res["passed"] == 3, (res, open(f"{box.host_dir}/verifier_output.txt").read())
    out = open(f"{tmp_path}/trial/host/verifier_output.txt").read()
    assert "VERIFIER-LOGS-FULL" in out and "VERIFIER-APP-FULL" in out, out
    trial = tmp_path / "trial"  # kept (keep_files): on the host disk again, no larger than the cap
    assert os.stat(trial).st_dev == host and not any(p.name.startswith(".trial-keep") for p in tmp_path.iterdir())
    assert (trial / "app" / "note").read_text() == "sort\n" and os.path.islink(trial / "app" / "a" / "b" / "l")
    assert os.path.getsize(trial / "app" / "sparse") == 200 * MiB and os.stat(trial / "app" / "h").st_nlink == 101
    assert du_bytes(trial) < 70 * MiB  # full, with a sparse file and 100 hard links to 30 MB: stored once
    assert not any(m[2].startswith("t1-trial-") and m[0] == str(trial) for m in trial_caps.mounts())


def test_dropped_files_leave_nothing_and_the_trial_dir_must_be_empty(tmp_path):
    task = task_io.load_task(make_task(tmp_path))
    with jail.Sandbox(task, tmp_path / "trial", SMALL, keep_files=False) as box:
        box.exec("head -c 10M /dev/zero > /app/x")
    assert os.listdir(tmp_path / "trial") == []
    (tmp_path / "t2").mkdir()
    (tmp_path / "t2" / "old").write_text("x")
    with pytest.raises(ValueError, match="must be empty"):
        jail.Sandbox(task, tmp_path / "t2", SMALL).start()


MEM_HOG = "python3 -c 'import time; a = b\"x\" * (80 << 20); time.sleep(2)'"


def test_processes_past_the_trial_memory_cap_are_oom_killed_and_the_trial_is_scored(tmp_path):
    task = make_task(tmp_path)
    limits = {**SMALL, "trial_mem_bytes": 160 * MiB}  # three processes of 80 MB each: 240 MB, under RLIMIT_AS
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", limits) as box:
        rc, out = box.exec(f"{MEM_HOG} & a=$!; {MEM_HOG} & b=$!; {MEM_HOG} & c=$!; "
                           "wait $a; echo rc=$?; wait $b; echo rc=$?; wait $c; echo rc=$?")
        codes = [int(x.split("=")[1]) for x in out.split() if x.startswith("rc=")]
        assert len(codes) == 3 and 137 in codes, out  # SIGKILLed by the cgroup's OOM killer
        assert box._cgroup.oom_kills() >= 1  # the trial's cgroup, not the host's
        rc, out = box.exec("sort in.txt > out.txt && echo alive")
        assert rc == 0 and out.strip() == "alive", out  # the trial goes on
        res = box.run_verifier()
    assert res["passed"] == 3 and res["source"] == "ctrf", res


def test_the_agent_cannot_see_or_leave_its_cgroup_and_close_kills_what_is_in_it(tmp_path):
    with jail.Sandbox(task_io.load_task(make_task(tmp_path)), tmp_path / "trial", SMALL) as box:
        dirs = list(box._cgroup.dirs)
        rc, out = box.exec("ls /sys/fs/cgroup 2>&1; ls /sys 2>&1; mount -t cgroup2 none /tmp 2>&1; "
                           "setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo started")
        assert "No such file" in out and "started" in out, out
        time.sleep(0.3)
        sleeps = [p for p in box._cgroup.procs() if open(f"/proc/{p}/cmdline", "rb").read() == b"sleep\x00300\x00"]
        assert sleeps, "the setsid'd process left the trial's cgroup"
        rc, out = box.exec("for f in /proc/1/root/sys/fs/cgroup/memory/cgroup.procs /proc/1/cgroup; do "
                           "echo $$ > $f && echo WROTE $f; done 2>&1")
        assert "WROTE" not in out, out
    assert not any(os.path.exists(d) for d in dirs) and not os.path.exists(f"/proc/{sleeps[0]}/cmdline")


HOLDER = """import sys, time
sys.path.insert(0, {repo!r})
from sandbox import jail, task_io
boxes = [jail.Sandbox(task_io.load_task({task!r}), "/nonexistent", {{}}) for _ in range({n})]
print(" ".join(str(b.uid) for b in boxes), flush=True)
sys.stdin.readline()
"""


def test_live_sandboxes_never_share_a_uid_across_processes(tmp_path):
    task = str(make_task(tmp_path))
    code = HOLDER.format(repo=REPO, task=task, n=60)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        held = [set(map(int, p.stdout.readline().split())) for p in procs]
        mine = [jail.Sandbox(task_io.load_task(task), "/nonexistent") for _ in range(201)]  # past pid % 4000 x 200
        uids = [b.uid for b in mine]
        assert len(set(uids)) == 201 and len(held[0]) == len(held[1]) == 60, (uids, held)
        assert not (held[0] & held[1]) and not (held[0] | held[1]) & set(uids)
        assert all(b.verifier_uid == b.uid + jail.VERIFIER_UID_OFFSET for b in mine)
        procs[0].kill()  # a holder dies: its uids are free again (the kernel dropped its locks)
        procs[0].wait()
        for b in mine:
            b.close()
        again = jail.Sandbox(task_io.load_task(task), "/nonexistent").uid
        assert again <= min(held[0]), (again, min(held[0]))  # lowest free first
    finally:
        for p in procs:
            p.kill()
            p.wait()


DIES = """import sys
sys.path.insert(0, {repo!r})
from sandbox import jail, task_io
box = jail.Sandbox(task_io.load_task({task!r}), {trial!r}, {limits!r}).start()
box.exec("setsid sleep 300 > /dev/null 2>&1 < /dev/null &")
print(box.uid, box._guard.proc.pid, flush=True)
sys.stdin.readline()
"""


def _killed_trial(tmp_path, kill_guard):
    """A trial process SIGKILLed after start (its guard too, with kill_guard) -> (uid, its cgroup dirs, its tmpfs
    source name)."""
    code = DIES.format(repo=REPO, task=str(make_task(tmp_path)), trial=str(tmp_path / "trial"), limits=SMALL)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    uid, guard = map(int, p.stdout.readline().split())
    dirs = [os.path.join(d, trial_caps.CGROUP_PARENT, f"trial-{uid}") for d in trial_caps.cgroup_layout()[1:] if d]
    if kill_guard:
        os.kill(guard, signal.SIGKILL)
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 10  # gone, and its copy of the uid's lock with it
    while kill_guard and os.path.exists(f"/proc/{guard}/fd/0") and time.time() < deadline:
        time.sleep(0.02)
    return uid, dirs, trial_caps.MOUNT_SOURCE.format(uid=uid)


def _left(dirs, source):
    return any(m[2] == source for m in trial_caps.mounts()) or any(os.path.isdir(d) for d in dirs)


def test_a_trial_killed_before_close_leaves_nothing_behind(tmp_path):
    uid, dirs, source = _killed_trial(tmp_path, kill_guard=False)
    deadline = time.time() + 15  # its guard saw the pipe close: tmpfs and cgroups (the setsid'd sleep) gone
    while _left(dirs, source) and time.time() < deadline:
        time.sleep(0.1)
    assert not _left(dirs, source)


def test_leftovers_of_a_killed_trial_and_guard_go_when_the_uid_is_taken_again(tmp_path):
    uid, dirs, source = _killed_trial(tmp_path, kill_guard=True)
    assert _left(dirs, source)
    leases = []
    try:
        while not leases or leases[-1].uid < uid:  # lowest free first: its uid comes up (or a concurrent test's
            leases.append(trial_caps.allocate_uid())  # trial took it first, reaping it the same way)
        assert not _left(dirs, source)  # while the uid is held: once released, another trial may take it and make
    finally:  # its own cgroup dirs under the same names
        for lease in leases:
            lease.release()


def test_task_toml_memory_and_storage_lower_the_caps_and_bad_values_are_named(tmp_path):
    task = make_task(tmp_path)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml + '\n[environment]\nmemory_mb = 300\nstorage = "100M"\n')
    box = jail.Sandbox(task_io.load_task(task), tmp_path / "trial")
    assert (box.limits.trial_mem_bytes, box.limits.disk_bytes) == (300 * MiB, 100 * MiB)
    box = jail.Sandbox(task_io.load_task(task), tmp_path / "trial", {"trial_mem_bytes": 200 * MiB})
    assert box.limits.trial_mem_bytes == 200 * MiB  # a lower cap only: never raises ours
    assert trial_caps.task_caps({"environment": {"memory": "2G", "memory_mb": 100}})[0] == 2 << 30  # as Harbor
    for env, field in [({"memory_mb": "lots"}, "memory_mb"), ({"storage": "10 parsecs"}, "storage"),
                       ({"memory_mb": 0}, "memory_mb"), ({"storage_mb": True}, "storage_mb")]:
        with pytest.raises(ValueError, match=f"environment\\] {field}"):
            trial_caps.task_caps({"environment": env})
    with pytest.raises(ValueError, match="limits.disk_inodes"):
        jail.Sandbox(task_io.load_task(task), tmp_path / "trial", {"disk_inodes": -1})


def test_no_memory_cgroup_is_an_error_naming_it_unless_the_cap_is_off(tmp_path, capsys):
    with pytest.raises(RuntimeError, match="no usable memory cgroup.*trial_mem_bytes=0"):
        trial_caps.cgroup_layout([("/", "ext4", "/dev/vda", "rw"), ("/cg/cpu", "cgroup", "cgroup", "rw,cpu")])
    trial_caps._said_off.clear()
    with jail.Sandbox(task_io.load_task(make_task(tmp_path)), tmp_path / "trial",
                         {**SMALL, "trial_mem_bytes": 0}) as box:
        assert box._cgroup is None and box.exec("echo ok")[1].strip() == "ok"
    assert "trial_mem_bytes=0: no memory cap per trial" in capsys.readouterr().err


def test_cgroup_v2_layout_writes_the_caps_and_delegates_memory(tmp_path, monkeypatch):
    """The cgroup v2 branch against a tree of plain files laid out as cgroupfs (this host's memory controller is
    on cgroup v1; the kernel's side of v2 is not exercised here)."""
    root = tmp_path / "cg"
    for d in (root, root / "t1-sandbox"):
        d.mkdir()
        (d / "cgroup.controllers").write_text("cpu io memory pids\n")
        (d / "cgroup.subtree_control").write_text("")
    table = [("/", "ext4", "/dev/vda", "rw"), (str(root), "cgroup2", "cgroup2", "rw")]
    layout = trial_caps.cgroup_layout(table)
    assert layout == ("v2", str(root), None)
    mkdir, write, writes = os.mkdir, trial_caps._write, []

    def mkdir_with_files(path, *a, **kw):  # cgroupfs makes a new cgroup's files itself
        mkdir(path, *a, **kw)
        for f in ("memory.max", "memory.swap.max", "pids.max", "cgroup.procs"):
            open(os.path.join(path, f), "w").close()
    monkeypatch.setattr(trial_caps.os, "mkdir", mkdir_with_files)
    monkeypatch.setattr(trial_caps, "_write", lambda path, value: (writes.append((path, value)), write(path, value)))
    cg = trial_caps.TrialCgroup(234567, 300 * MiB, 77, layout=layout)
    d = root / "t1-sandbox" / "trial-234567"
    assert [(d / f).read_text() for f in ("memory.max", "memory.swap.max", "pids.max")] == [str(300 * MiB), "0", "77"]
    assert cg.join_argv()[-2:] == [str(d / "cgroup.procs"), "--"]
    for parent in (root, root / "t1-sandbox"):  # memory (and pids) delegated down to the trial's cgroup
        assert (str(parent / "cgroup.subtree_control"), "+memory") in writes, writes
    (root / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(RuntimeError, match="cgroup2 at .* without the memory controller"):
        trial_caps.cgroup_layout(table)


def test_the_cgroup_join_runs_nothing_when_it_cannot_join(tmp_path):
    argv = ["/bin/sh", "-c", trial_caps.JOIN_SH, "cgroup-join", str(tmp_path / "no" / "cgroup.procs"), "--",
            "sh", "-c", "echo RAN"]
    p = subprocess.run(argv, capture_output=True, text=True)
    assert p.returncode == 125 and "RAN" not in p.stdout, p


def test_a_kept_trial_over_keep_bytes_keeps_only_the_hosts_logs(tmp_path):
    """A run that keeps every trial (train_t1's run_dir/trials) must not let agents fill the host disk trial by
    trial: over keep_bytes only host/ comes back (the verifier's output, the transcript), with a note; under it,
    everything, as before."""
    task = task_io.load_task(make_task(tmp_path))
    with jail.Sandbox(task, tmp_path / "big", {**SMALL, "keep_bytes": 4 * MiB}) as box:
        box.exec("head -c 20M /dev/urandom > /app/junk; sort in.txt > out.txt")
        assert box.run_verifier()["passed"] == 3
    big = tmp_path / "big"
    assert sorted(os.listdir(big)) == ["host"] and du_bytes(big) < 1 * MiB
    assert "more than keep_bytes = 4194304: only host/ was kept" in (big / "host" / "not_kept.txt").read_text()
    assert "[exit 0]" in (big / "host" / "verifier_output.txt").read_text()
    with jail.Sandbox(task, tmp_path / "small", {**SMALL, "keep_bytes": 4 * MiB}) as box:
        box.exec("head -c 1M /dev/urandom > /app/junk")
    small = tmp_path / "small"
    assert os.path.getsize(small / "app" / "junk") == MiB and not (small / "host" / "not_kept.txt").exists()
