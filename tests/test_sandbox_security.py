"""sandbox/jail.py's jail against a hostile agent and a hostile task directory.

Each test plays the attacker: the oracle's solve.sh runs as the agent (same uid, same jail as a model's commands), a
task's test.sh runs what the agent wrote, a task directory carries links, devices, FIFOs and oversized files.
"""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from sandbox import harbor_env  # noqa: E402
import rollout  # noqa: E402
from sandbox import host_fs  # noqa: E402
from sandbox import jail  # noqa: E402
from sandbox import seccomp  # noqa: E402
from sandbox import task_io  # noqa: E402
from sandbox.limits import Limits  # noqa: E402
from test_rollout import TEST_SH, make_task  # noqa: E402

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"),
                                reason="the bubblewrap sandbox needs root and bwrap")
SORT = "sort in.txt > out.txt"
# an agent-written program: file handles through /app's mount (the "shocker" escape: a handle for the filesystem's
# root inode opened against any mount of that filesystem reaches the whole host filesystem)
PROBE = r'''import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
name_nr, open_nr = {"x86_64": (303, 304), "aarch64": (264, 265)}[os.uname().machine]
buf = ctypes.create_string_buffer(struct.pack("=Ii", 128, 0) + bytes(128))
mount_id = ctypes.c_int()
r = libc.syscall(name_nr, -100, b"/app", buf, ctypes.byref(mount_id), 0)
print("name_to_handle_at", r, os.strerror(ctypes.get_errno()) if r else "ok")
root = ctypes.create_string_buffer(struct.pack("=IiII", 8, 1, 2, 0))  # FILEID_INO32_GEN: inode 2 (ext4 root), gen 0
r = libc.syscall(open_nr, os.open("/app", os.O_RDONLY), root, os.O_RDONLY | os.O_DIRECTORY)
print("open_by_handle_at", r, os.strerror(ctypes.get_errno()) if r < 0 else "ok")
if r >= 0:
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_TRUNC, dir_fd=r)
    os.write(fd, b"PWNED")
    print("wrote the host file")
'''


def trial_dir(work_root):
    (d,) = [p for p in work_root.iterdir() if p.is_dir()]
    return d


def fs_relative(path):
    """path relative to the root of the filesystem holding it (what a handle for the root inode reaches)."""
    path, dev = os.path.abspath(path), os.stat(path).st_dev
    top = path
    while os.path.dirname(top) != top and os.stat(os.path.dirname(top)).st_dev == dev:
        top = os.path.dirname(top)
    return os.path.relpath(path, top)


def canary(tmp_path, name="canary.txt"):
    p = tmp_path / name
    p.write_text("intact\n")
    return p


# --- the verifier has no more power than the agent ------------------------------------------------------------

def test_agent_commands_cannot_open_by_handle_or_make_a_user_namespace(tmp_path):
    task = make_task(tmp_path)
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial") as box:
        (tmp_path / "trial" / "app" / "probe.py").write_text(PROBE)
        rc, out = box.exec("python3 /app/probe.py nowhere; unshare -U true; echo unshare=$?")
    assert "name_to_handle_at -1 Operation not permitted" in out, out
    assert "open_by_handle_at -1 Operation not permitted" in out and "wrote" not in out, out
    assert "unshare=1" in out, out  # CLONE_NEWUSER refused by the filter


def test_verifier_cannot_open_by_handle(tmp_path):
    host_file = canary(tmp_path)
    task = make_task(tmp_path, solve=f"cp /solution/probe.py /app/probe.py\n{SORT}")
    (task / "solution" / "probe.py").write_text(PROBE)
    (task / "tests" / "test.sh").write_text(
        f"mkdir -p /logs/verifier\npython3 /app/probe.py {fs_relative(host_file)} > /logs/verifier/probe.txt 2>&1\n"
        + TEST_SH.split("\n", 2)[2])
    work = tmp_path / "runs"
    res = rollout.run_trial(task, "oracle", work_root=work)
    assert host_file.read_text() == "intact\n"  # nothing written outside the trial
    assert res["exit_reason"] == "oracle" and res["passed"] == 3, res
    probe = (trial_dir(work) / "verifier" / "logs" / "probe.txt").read_text()
    assert "name_to_handle_at -1 Operation not permitted" in probe, probe
    assert "open_by_handle_at -1 Operation not permitted" in probe, probe


def test_verifier_runs_unprivileged_in_a_fresh_jail_without_agent_processes(tmp_path):
    solve = ("setsid sleep 1000 > /dev/null 2>&1 < /dev/null &\n( (nohup sleep 1001 > /dev/null 2>&1 &) & )\n"
             f"echo agent > /tmp/agent-was-here\n{SORT}")
    task = make_task(tmp_path, solve=solve)
    (task / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\n{ id -u; grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status; ps -eo args=; ls -A /tmp;"
        " ulimit -u -f; } > /logs/verifier/view.txt 2>&1\n" + TEST_SH.split("\n", 2)[2])
    work = tmp_path / "runs"
    res = rollout.run_trial(task, "oracle", work_root=work, limits={"max_procs": 64, "file_bytes": 8 << 20})
    assert res["resolved"], res
    view = (trial_dir(work) / "verifier" / "logs" / "view.txt").read_text()
    lines = view.split("\n")
    assert int(lines[0]) >= 1_000_000, view  # the verifier's own uid, not root, not the agent's
    assert all(ln.split()[1] == "0000000000000000" for ln in lines[1:4]), view  # no capability at all
    assert "sleep 100" not in view and "agent-was-here" not in view, view  # agent processes dead, /tmp fresh
    assert "64" in view and str((8 << 20) // 1024) in view, view  # the agent's rlimits (nproc, fsize in KiB)


# --- the host never follows a link; forged reports are not scored ---------------------------------------------

FORGED = {"results": {"tool": {"name": "pytest"}, "summary": {"tests": 400, "passed": 400, "failed": 0},
                      "tests": [{"name": f"t{i}", "status": "passed"} for i in range(400)]}}


def test_agent_background_process_cannot_forge_the_report(tmp_path):
    loop = ("while :; do mkdir -p /logs/verifier 2>/dev/null; cp /solution/forged.json /logs/verifier/ctrf.json; "
            "echo 1e30 > /logs/verifier/reward.txt; sleep 0.01; done")
    solve = (f"setsid nohup bash -c '{loop}' > /dev/null 2>&1 < /dev/null &\n"
             f"( (bash -c '{loop}' > /dev/null 2>&1 < /dev/null &) & )\nsleep 0.2")  # does not solve the task
    task = make_task(tmp_path, solve=solve)
    (task / "solution" / "forged.json").write_text(json.dumps(FORGED))
    res = rollout.run_trial(task, "oracle")
    assert res["exit_reason"] == "oracle", res["error"]
    assert (res["reward_source"], res["passed"], res["total"], res["reward"]) == ("ctrf", 0, 3, 0.0), res


def test_planted_links_are_never_followed_by_the_host(tmp_path):
    host_file, host_file2 = canary(tmp_path), canary(tmp_path, "canary2.txt")
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    solve = (f"ln -s {host_file} /logs/agent/oracle.txt\nrm -rf /logs/verifier; ln -s {host_dir} /logs/verifier\n"
             f"ln -s {host_file2} /logs/verifier_output.txt\n{SORT}")
    task = make_task(tmp_path, solve=solve)
    res = rollout.run_trial(task, "oracle", work_root=tmp_path / "runs")
    assert host_file.read_text() == host_file2.read_text() == "intact\n"
    assert list(host_dir.iterdir()) == []
    assert res["exit_reason"] == "oracle" and res["resolved"] and res["passed"] == 3, res
    out = trial_dir(tmp_path / "runs") / "host"
    assert sorted(os.listdir(out)) == ["oracle.txt", "verifier_output.txt"]
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o700 and os.stat(out).st_uid == 0


def test_full_tmp_and_app_do_not_fail_a_correct_solution(tmp_path):
    solve = f"head -c 8M /dev/zero > /tmp/fill\nhead -c 8M /dev/zero > /app/fill\n{SORT}"
    task = make_task(tmp_path, solve=solve)
    (task / "tests" / "test.sh").write_text(  # a verifier that needs a little of /tmp, as most do
        "mkdir -p /logs/verifier\nhead -c 65536 /dev/urandom > /tmp/scratch || { echo 0 > /logs/verifier/reward.txt;"
        " exit 1; }\n" + TEST_SH.split("\n", 2)[2])
    res = rollout.run_trial(task, "oracle", limits={"tmp_bytes": 2 << 20, "file_bytes": 4 << 20})
    assert res["exit_reason"] == "oracle" and res["resolved"] and res["passed"] == 3, res


# --- task directories are untrusted ----------------------------------------------------------------------------

def _hostile(kind, task, tmp_path):
    app, tests = task / "environment" / "app", task / "tests"
    if kind == "app-link-to-host-file":
        os.symlink("/etc/shadow", app / "shadow")
        return app / "shadow", "leaves"
    if kind == "tests-link-to-host-file":
        os.symlink("/etc/shadow", tests / "shadow")
        return tests / "shadow", "leaves"
    if kind == "tests-link-to-dev-zero":
        os.symlink("/dev/zero", tests / "zero")
        return tests / "zero", "leaves"
    if kind == "app-relative-link-out":
        os.symlink("../../../../../etc/passwd", app / "up")
        return app / "up", "leaves"
    if kind == "tests-fifo":
        os.mkfifo(tests / "pipe")
        return tests / "pipe", "a FIFO"
    if kind == "app-device":
        os.mknod(app / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
        return app / "zero", "a device file"
    if kind == "app-oversized-file":
        (app / "big.bin").write_bytes(b"\0" * (2 << 20))
        return app / "big.bin", "more than"
    if kind == "app-is-link-to-host-dir":
        host = tmp_path / "host-secrets"
        host.mkdir()
        (host / "secret.txt").write_text("secret\n")
        shutil.rmtree(app)
        os.symlink(host, app)
        return app, "symbolic link"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["app-link-to-host-file", "tests-link-to-host-file", "tests-link-to-dev-zero",
                                  "app-relative-link-out", "tests-fifo", "app-device", "app-oversized-file",
                                  "app-is-link-to-host-dir"])
def test_hostile_task_dir_is_refused_with_its_path(tmp_path, kind):
    task = make_task(tmp_path)
    bad, why = _hostile(kind, task, tmp_path)
    work = tmp_path / "runs"
    res = rollout.run_trial(task, "oracle", work_root=work, limits={"task_bytes": 1 << 20})
    assert res["exit_reason"] == "error" and res["reward"] == 0.0, res
    assert str(bad) in res["error"] and why in res["error"], res["error"]
    copied = [os.path.join(d, n) for d, ds, fs in os.walk(work) for n in ds + fs]
    assert not any(os.path.basename(str(bad)) == os.path.basename(c) or "secret" in c for c in copied), copied


def test_copy_task_tree_keeps_in_tree_links_and_drops_special_bits(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "run.sh").write_text("echo hi\n")
    os.chmod(src / "sub" / "run.sh", 0o4755)
    os.symlink("sub/run.sh", src / "link")
    os.symlink("../link", src / "sub" / "back")
    n = host_fs.copy_task_tree(src, tmp_path / "dst", max_bytes=1 << 20, max_files=10)
    dst = tmp_path / "dst"
    assert os.readlink(dst / "link") == "sub/run.sh" and os.readlink(dst / "sub" / "back") == "../link"
    assert (dst / "link").read_text() == "echo hi\n" and stat.S_IMODE(os.stat(dst / "sub" / "run.sh").st_mode) == 0o755
    assert n == {"files": 4, "bytes": 8}
    with pytest.raises(ValueError, match="more than 3 files"):
        host_fs.copy_task_tree(src, tmp_path / "dst2", max_bytes=1 << 20, max_files=3)
    assert not (tmp_path / "dst2").exists()


def test_seccomp_filter_is_built_for_each_known_machine():
    for machine in ("x86_64", "aarch64"):
        prog = seccomp.seccomp_filter(machine)
        assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 4096
    with pytest.raises(RuntimeError, match="riscv64"):
        seccomp.seccomp_filter("riscv64")


# --- the Harbor path (sandbox/harbor_env.py's ToolsSandbox, what BwrapEnvironment drives)
# ------------------------------

def test_harbor_root_exec_ends_the_agent_phase_and_cannot_open_by_handle(tmp_path):
    import types

    host_file = canary(tmp_path)
    task = make_task(tmp_path)
    t = types.SimpleNamespace(env_dir=str(task / "environment"), solution_dir=None, config={}, tests_dir=None,
                              name="harbor")
    with harbor_env._ToolsSandbox(t, tmp_path / "trial", Limits()) as box:
        (tmp_path / "trial" / "app" / "probe.py").write_text(PROBE)
        loop = "while :; do echo forged > /logs/verifier/ctrf.json; sleep 0.01; done"
        rc, out = box.exec(f"mkdir -p /logs/verifier; setsid nohup bash -c '{loop}' > /dev/null 2>&1 < /dev/null &"
                           f"\nln -s /etc/passwd /logs/verifier/reward.txt; echo started")
        assert "started" in out
        rc, out = box.exec(f"id -u; grep CapEff /proc/self/status; ps -eo args=; ls -A /logs/verifier; "
                           f"python3 /app/probe.py {fs_relative(host_file)}", as_root=True)  # Harbor's verifier
    assert host_file.read_text() == "intact\n"
    assert "open_by_handle_at -1 Operation not permitted" in out and "name_to_handle_at -1" in out, out
    assert "while" not in out and "forged" not in out and "reward.txt" not in out, out  # agent dead, fresh dir


# int 0x80 from a 64-bit process: the i386 syscall table (its own numbers, audit arch I386), which a filter that only
# knows the x86_64 numbers lets through. push rbx; mov eax, NR; mov ebx, -100; zero ecx, edx, esi, edi; int 0x80;
# pop rbx; ret
I386_PROBE = r'''import ctypes, mmap
def int80(nr):
    code = (b"\x53\xb8" + nr.to_bytes(4, "little") + b"\xbb\x9c\xff\xff\xff\x31\xc9\x31\xd2\x31\xf6\x31\xff"
            b"\xcd\x80\x5b\xc3")
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
print("i386 name_to_handle_at", int80(341), "getpid", int80(20))
'''


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 syscall ABI exists on x86_64 only")
def test_i386_syscall_abi_cannot_name_a_handle(tmp_path):
    task = make_task(tmp_path)
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial") as box:
        (tmp_path / "trial" / "app" / "probe.py").write_text(I386_PROBE)
        rc, out = box.exec("python3 /app/probe.py")
    # -1 (EPERM): refused by the filter; unfiltered it gets -14 (EFAULT: the NULL name), -38 without IA32 emulation
    assert "i386 name_to_handle_at -1 " in out or "i386 name_to_handle_at -38 " in out, out
    pid = int(out.split("getpid")[1].split()[0])
    assert pid > 0 or pid == -38, out  # other i386 syscalls are not refused


def test_a_deep_tree_in_app_does_not_break_the_handover_to_the_verifier(tmp_path):
    # /app is chowned to the verifier's uid after the agent: 3000 levels (past Python's recursion limit and PATH_MAX)
    deep = "python3 -c 'import os\nfor i in range(3000): os.mkdir(\"d\"); os.chdir(\"d\")'"
    task = make_task(tmp_path, solve=f"{deep}\n{SORT}")
    res = rollout.run_trial(task, "oracle")
    assert res["exit_reason"] == "oracle" and res["resolved"] and res["passed"] == 3, res


def test_daytona_upload_of_a_task_dir_never_follows_its_links(tmp_path):
    pytest.importorskip("daytona")
    from sandbox import daytona
    from test_cluster import FakeDaytona, _task
    task = _task(tmp_path)
    os.symlink("/etc/shadow", os.path.join(task.tests_dir, "shadow"))
    fake = FakeDaytona()
    with daytona.DaytonaSandbox(task, tmp_path / "trial", client=fake) as box:
        with pytest.raises(ValueError, match="shadow.*leaves|links are refused"):
            box.run_verifier()
    assert fake.uploads == []  # e6526f2 uploaded the host's /etc/shadow through the link


# --- the verifier's report channel: agent code the verifier runs cannot produce or alter the report that pays -----

# The perms-family pattern: a test runs the agent's /app/fix.sh as a subprocess (as the verifier's uid). The script
# counts the tests, writes an all-passed ctrf.json and reward.txt into /logs/verifier, and makes them read-only so
# pytest's own write fails; ATTACKS adds what it does next. Honest value: 1 of 5 (only the script's own test passes).
FORGE_SH = r'''#!/bin/bash
n=$(cat /tests/*.py | grep -c 'def test_')
mkdir -p /logs/verifier
python3 -c '
import json, sys
n = int(sys.argv[1])
tests = [{"name": f"t{i}", "status": "passed"} for i in range(n)]
summary = {"tests": n, "passed": n, "failed": 0, "skipped": 0, "pending": 0, "other": 0}
json.dump({"results": {"tool": {"name": "pytest"}, "summary": summary, "tests": tests}},
          open("/logs/verifier/ctrf.json", "w"))' "$n"
echo 1 > /logs/verifier/reward.txt
chmod 0444 /logs/verifier/ctrf.json /logs/verifier/reward.txt
chmod 0555 /logs/verifier
'''
PERMS_TESTS = "import os, subprocess\n\ndef test_script_runs():\n" + \
    "    subprocess.run(['bash', '/app/fix.sh'], check=True)\n" + \
    "".join(f"\ndef test_mode_{i}():\n    assert os.path.exists('/app/never-{i}')\n" for i in range(4))
FAKE_REPORT = r'''import json, socket
s = socket.socket(socket.AF_UNIX)
s.connect("/run/verifier-report/report.sock")
lines = [{"t": "start", "pid": 1}] + [{"t": "test", "nodeid": f"t{i}", "when": w, "outcome": "passed"}
                                      for i in range(5) for w in ("setup", "call", "teardown")]
s.sendall(b"".join(json.dumps(m).encode() + b"\n" for m in lines + [{"t": "done", "exitstatus": 0, "foreign": []}]))
'''
OWN_PYTEST = ("mkdir -p /tmp/fake && printf 'def test_a(): pass\\ndef test_b(): pass\\ndef test_c(): pass\\n"
              "def test_d(): pass\\ndef test_e(): pass\\n' > /tmp/fake/test_fake.py\n"
              "PYTEST_ADDOPTS='-p verifier_report_plugin' PYTHONPATH=/run/verifier-plugin python3 -m pytest -q "
              "/tmp/fake/test_fake.py\n")
ATTACKS = {  # what the script does after the forgery -> (source, passed, total, words in the reason)
    "forge-only": ("", ("ctrf", 1, 5, None)),
    "kill-pytest": ("kill -9 $PPID\n", ("none", 0, 0, "without the done line")),
    "interrupt-pytest": ("kill -INT $PPID\nsleep 1\n", ("none", 0, 0, "exit status 2")),
    "stop-pytest": ("kill -STOP $PPID\n", ("none", 0, 0, "without the done line")),
    "own-pytest-with-the-plugin": (OWN_PYTEST, ("none", 0, 0, "2 reporters connected")),
    "raw-report-on-the-socket": (f"python3 -c '{FAKE_REPORT}'\n", ("none", 0, 0, "2 reporters connected")),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_agent_script_run_by_a_test_cannot_forge_the_report(tmp_path, attack):
    tail, (source, passed, total, why) = ATTACKS[attack]
    task = make_task(tmp_path, solve="cp /solution/fix.sh /app/fix.sh")
    (task / "solution" / "fix.sh").write_text(FORGE_SH + tail)
    (task / "tests" / "test_outputs.py").write_text(PERMS_TESTS)
    res = rollout.run_trial(task, "oracle", limits={"verifier_timeout_s": 3 if attack == "stop-pytest" else 60})
    assert res["exit_reason"] == "oracle", res["error"]
    got = (res["reward_source"], res["passed"], res["total"], res["reward"])
    assert got == (source, passed, total, passed / 20), res  # main paid 5 of 5 (0.25) for every one of these
    assert why is None and res["reward_reason"] is None or why in res["reward_reason"], res["reward_reason"]


def test_the_attacks_meet_the_same_verifier_when_the_run_ignores_sigint():
    """A run started as a background job (`nohup bash run.sh &`, or a suite started so) ignores SIGINT, and every
    process it starts inherits that: the verifier's pytest ignored the agent script's `kill -INT` above and paid
    the honest 1 of 5 (found 2026-12-06: the interrupt-pytest case failed only in suites started with nohup). The
    jail starts its processes with the default dispositions (jail._enter): the case above, rerun by a pytest whose
    SIGINT is ignored, meets the same verifier."""
    node = f"{__file__}::test_agent_script_run_by_a_test_cannot_forge_the_report[interrupt-pytest]"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", node],
                       capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items()
                            if k not in ("T1_TEST_DURATIONS", "PYTEST_XDIST_WORKER")},
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # a one-test run: no costs
    assert p.returncode == 0 and "1 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


def test_agent_script_started_by_a_conftest_cannot_replace_the_reporter(tmp_path):
    """A conftest (imported before the session starts) starts the agent's script, which kills pytest and sends an
    all-passed report of its own: the reporter connected when its plugin was imported, before any conftest, so
    this is a second reporter (0), not the only one."""
    task = make_task(tmp_path, solve="cp /solution/fix.sh /app/fix.sh")
    (task / "solution" / "fix.sh").write_text(f"#!/bin/bash\npython3 -c '{FAKE_REPORT}'\nkill -9 $PPID\n")
    (task / "tests" / "conftest.py").write_text("import subprocess\nsubprocess.run(['bash', '/app/fix.sh'])\n")
    (task / "tests" / "test_outputs.py").write_text(PERMS_TESTS)
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["reward"]) == ("none", 0.0), res
    assert "2 reporters connected" in res["reward_reason"], res["reward_reason"]


PROBE_PYTEST = r'''import ctypes, os, sys
pid = int(sys.argv[1])  # the reporting pytest
libc = ctypes.CDLL(None, use_errno=True)
def attempt(name, f):
    try:
        f()
        print(name, "ok")
    except OSError as e:
        print(name, "denied", e.errno)
attempt("fd-list", lambda: os.listdir(f"/proc/{pid}/fd"))
attempt("mem", lambda: open(f"/proc/{pid}/mem", "r+b").close())
attempt("environ", lambda: open(f"/proc/{pid}/environ", "rb").read())
attempt("fd-open", lambda: os.open(f"/proc/{pid}/fd/3", os.O_RDWR))
nr = {"x86_64": (101, 310, 311, 438), "aarch64": (117, 270, 271, 438)}[os.uname().machine]
buf = ctypes.create_string_buffer(8)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
for name, n, args in (("ptrace", nr[0], (16, pid, 0, 0)), ("process_vm_readv", nr[1], (pid, iov, 1, iov, 1, 0)),
                      ("process_vm_writev", nr[2], (pid, iov, 1, iov, 1, 0)),
                      ("pidfd_getfd", nr[3], (os.pidfd_open(pid), 3, 0))):
    ctypes.set_errno(0)
    r = libc.syscall(n, *args)
    print(name, r, ctypes.get_errno())
'''


def test_agent_script_cannot_reach_into_the_reporting_pytest(tmp_path):
    """The reporter is non-dumpable (its /proc files closed to its own uid) and the verifier's seccomp filter refuses
    ptrace, process_vm_readv / writev and pidfd_getfd: the agent's script cannot take the socket or patch memory."""
    task = make_task(tmp_path, solve="cp /solution/probe.py /app/probe.py")
    (task / "solution" / "probe.py").write_text(PROBE_PYTEST)
    (task / "tests" / "test_outputs.py").write_text(
        "import os, subprocess\n\ndef test_probe():\n    out = subprocess.run(['python3', '/app/probe.py', "
        "str(os.getpid())], capture_output=True, text=True).stdout\n"
        "    open('/logs/verifier/probe.txt', 'w').write(out)\n")
    work = tmp_path / "runs"
    res = rollout.run_trial(task, "oracle", work_root=work)
    assert (res["reward_source"], res["passed"], res["total"]) == ("ctrf", 1, 1), res
    probe = (trial_dir(work) / "verifier" / "logs" / "probe.txt").read_text()
    for name in ("fd-list", "mem", "environ", "fd-open"):
        assert f"{name} denied 13" in probe, probe  # EACCES: main's pytest was dumpable (fd-list ok)
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd"):
        assert f"{name} -1 1\n" in probe, probe  # EPERM from the filter


def test_imported_agent_module_that_writes_the_report_scores_its_honest_value(tmp_path):
    """The Terminal-Bench pattern sys.path.insert(0, "/app"); import solution: the module's forgery (a file) no
    longer pays; the report names the agent's module that ran inside the reporting pytest."""
    task = make_task(tmp_path, solve="cp /solution/solution.py /app/solution.py")
    (task / "solution" / "solution.py").write_text(
        "import subprocess\nsubprocess.run(['bash', '-c', " + repr(FORGE_SH) + "], check=True)\n"
        "def answer():\n    return 41\n")
    (task / "tests" / "test_outputs.py").write_text(
        "import sys\nsys.path.insert(0, '/app')\nimport solution\n\n" +
        "".join(f"def test_answer_{i}():\n    assert solution.answer() == 42\n\n" for i in range(3)))
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["passed"], res["total"], res["reward"]) == ("ctrf", 0, 3, 0.0), res  # main: 3/3
    assert "agent code ran inside the reporting pytest" in res["reward_reason"], res["reward_reason"]
    assert "solution (/app/solution.py)" in res["reward_reason"], res["reward_reason"]


PLANTED_PYTEST = r'''import json, sys
n = 3
tests = [{"name": f"t{i}", "status": "passed"} for i in range(n)]
json.dump({"results": {"tool": {"name": "pytest"}, "summary": {"tests": n, "passed": n, "failed": 0, "skipped": 0,
           "pending": 0, "other": 0}, "tests": tests}}, open("/logs/verifier/ctrf.json", "w"))
sys.exit(0)
'''


def test_python_m_pytest_from_app_runs_the_real_pytest(tmp_path):
    """test.sh `cd /app && python3 -m pytest`: a planted /app/pytest.py is not what runs (main paid it 3/3), nor an
    /app/pdb.py that exits 0 as pytest configures itself (before any test: test.sh's reward.txt would say 1); a test
    still imports the agent's module from the cwd as `python -m` allows, and a test's subprocess gets a plain
    environment (no PYTHONSAFEPATH, no plugin), so an honest nested pytest does not count as a second reporter."""
    solve = ("printf 'pear\\napple\\nfig\\nkiwi\\nbanana\\n' > out.txt\n"
             "cp /solution/pytest.py /solution/pdb.py /solution/sortcheck.py /app/")
    task = make_task(tmp_path, solve=solve)  # out.txt unsorted: exists and 5 lines pass, sorted fails
    (task / "solution" / "pytest.py").write_text(PLANTED_PYTEST)
    (task / "solution" / "pdb.py").write_text("import os\nos._exit(0)\n")  # pytest imports pdb while configuring
    (task / "solution" / "sortcheck.py").write_text("def ok():\n    return True\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\ncd /app && python3 -m pytest --ctrf /logs/verifier/ctrf.json "
        "/tests/test_outputs.py -rA\nif [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > "
        "/logs/verifier/reward.txt; fi\n")
    (task / "tests" / "test_outputs.py").write_text(
        (tmp_path / "sort-lines" / "tests" / "test_outputs.py").read_text() +
        "\ndef test_cwd_module_and_plain_subprocess_env():\n    import subprocess, sys\n    import sortcheck\n"
        "    assert sortcheck.ok() and 'PYTHONSAFEPATH' not in os.environ\n"
        "    assert 'verifier_report' not in os.environ.get('PYTEST_ADDOPTS', '') + os.environ.get('PYTHONPATH', '')\n"
        "    open('/tmp/test_nested.py', 'w').write('def test_n():\\n    pass\\n')\n"
        "    subprocess.run([sys.executable, '-m', 'pytest', '-q', '/tmp/test_nested.py'], check=True)\n")
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["passed"], res["total"]) == ("ctrf", 3, 4), res
    assert "modules: sortcheck (/app/sortcheck.py)" in res["reward_reason"], res["reward_reason"]  # flagged


def test_a_planted_ini_and_conftest_in_the_test_dir_pytest_uses(tmp_path):
    """A test.sh that runs pytest from /app on a copy of its tests reads the agent's pytest.ini (addopts: -p no: the
    plugin) and conftest.py (forges the report, main paid 3 of 3): the plugin loads anyway (`-p NAME` after
    `-p no:NAME` unblocks it), the honest 0 of 3 is paid and the conftest is named as agent code in the reporter."""
    solve = ("printf '[pytest]\\naddopts = -p no:verifier_report_plugin\\n' > /app/pytest.ini\n"
             "cp /solution/conftest.py /app/conftest.py")
    task = make_task(tmp_path, solve=solve)  # out.txt never written
    (task / "solution" / "conftest.py").write_text(
        "import subprocess\nsubprocess.run(['bash', '-c', " + repr(FORGE_SH) + "])\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\ncp /tests/test_outputs.py /app/\ncd /app && pytest --ctrf "
        "/logs/verifier/ctrf.json test_outputs.py -rA\nif [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["passed"], res["total"], res["reward"]) == ("ctrf", 0, 3, 0.0), res
    assert "conftest (/app/conftest.py)" in res["reward_reason"], res["reward_reason"]


def test_a_test_sh_that_runs_pytest_without_the_reporter_pays_zero(tmp_path):
    """A test.sh that replaces PYTEST_ADDOPTS keeps the plugin out: no reporter, and reward.txt (writable by any
    code the verifier ran) is not trusted in its place for a verifier that runs pytest."""
    task = make_task(tmp_path)
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\nPYTEST_ADDOPTS=-q pytest --ctrf /logs/verifier/ctrf.json "
        "/tests/test_outputs.py\necho 1 > /logs/verifier/reward.txt\n")
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["reward"]) == ("none", 0.0), res
    assert "test.sh runs pytest but no pytest reported" in res["reward_reason"], res["reward_reason"]


def test_agent_code_cannot_turn_a_pytest_verifier_into_a_binary_one(tmp_path):
    """No reporter at all falls back to reward.txt (verifiers without pytest); a forged ctrf.json is never read."""
    task = make_task(tmp_path, solve="true")  # does not solve the task
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\ncp /tests/forged.json /logs/verifier/ctrf.json\n"
        "echo 0 > /logs/verifier/reward.txt\n")
    (task / "tests" / "forged.json").write_text(json.dumps(FORGED))
    res = rollout.run_trial(task, "oracle")
    assert (res["reward_source"], res["reward"]) == ("binary", 0.0), res
    assert "no pytest reported through the report channel" in res["reward_reason"], res


# --- seccomp: the keyring and io_uring in both jails; ptrace in the verifier's ---------------------------------
SYSCALL_PROBE = r'''import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
nr = {"x86_64": dict(add_key=248, request_key=249, keyctl=250, io_uring_setup=425, ptrace=101),
      "aarch64": dict(add_key=217, request_key=218, keyctl=219, io_uring_setup=425, ptrace=117)}[os.uname().machine]
params = ctypes.create_string_buffer(120)
for name, args in (("add_key", (b"user", b"probe", b"secret /tests", 13, -3)), ("keyctl", (0, -3, 1)),
                   ("request_key", (b"user", b"probe", None, 0)), ("io_uring_setup", (4, params)),
                   ("ptrace", (16, 999999, 0, 0))):
    ctypes.set_errno(0)
    print(name, libc.syscall(nr[name], *args), ctypes.get_errno())
'''


def test_keyring_and_io_uring_are_refused_in_both_jails_ptrace_in_the_verifiers(tmp_path):
    """Kernel keyrings are not namespaced (a key stored by one trial outlived it and another trial read it from
    /proc/keys): add_key, keyctl, request_key -> EPERM; io_uring -> ENOSYS (libraries fall back). ptrace stays for
    the agent (debuggers), and is EPERM in the verifier's jail."""
    task = make_task(tmp_path, solve="cp /solution/probe.py /app/probe.py\nsort in.txt > out.txt")
    (task / "solution" / "probe.py").write_text(SYSCALL_PROBE)
    (task / "tests" / "test.sh").write_text(
        "mkdir -p /logs/verifier\npython3 /app/probe.py > /logs/verifier/probe.txt 2>&1\n"
        + TEST_SH.split("\n", 2)[2])
    with jail.Sandbox(task_io.load_task(task), tmp_path / "trial", solution=True) as box:
        rc, agent = box.exec("bash /solution/solve.sh && python3 /app/probe.py")
        res = box.run_verifier()
        verifier = (tmp_path / "trial" / "verifier" / "logs" / "probe.txt").read_text()
    assert res["passed"] == 3, res
    for out in (agent, verifier):
        for name in ("add_key", "keyctl", "request_key"):
            assert f"{name} -1 1\n" in out, out  # EPERM (main: add_key returned a key's serial number)
        assert "io_uring_setup -1 38\n" in out, out  # ENOSYS (main: a ring's fd)
    assert "ptrace -1 3\n" in agent and "ptrace -1 1\n" in verifier, (agent, verifier)  # ESRCH: allowed; EPERM
