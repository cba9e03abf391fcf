"""sandbox.py's jail against a hostile agent and a hostile task directory (issue 11, section 1).

Each test plays the attacker: the oracle's solve.sh runs as the agent (same uid, same jail as a model's commands), a
task's test.sh runs what the agent wrote, a task directory carries links, devices, FIFOs and oversized files.
"""
import json
import os
import shutil
import stat
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harbor_env  # noqa: E402
import rollout  # noqa: E402
import sandbox  # noqa: E402
import task_io  # noqa: E402
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
    with sandbox.Sandbox(task_io.load_task(task), tmp_path / "trial") as box:
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
    n = sandbox.copy_task_tree(src, tmp_path / "dst", max_bytes=1 << 20, max_files=10)
    dst = tmp_path / "dst"
    assert os.readlink(dst / "link") == "sub/run.sh" and os.readlink(dst / "sub" / "back") == "../link"
    assert (dst / "link").read_text() == "echo hi\n" and stat.S_IMODE(os.stat(dst / "sub" / "run.sh").st_mode) == 0o755
    assert n == {"files": 4, "bytes": 8}
    with pytest.raises(ValueError, match="more than 3 files"):
        sandbox.copy_task_tree(src, tmp_path / "dst2", max_bytes=1 << 20, max_files=3)
    assert not (tmp_path / "dst2").exists()


def test_seccomp_filter_is_built_for_each_known_machine():
    for machine in ("x86_64", "aarch64"):
        prog = sandbox.seccomp_filter(machine)
        assert len(prog) % 8 == 0 and 0 < len(prog) // 8 < 4096
    with pytest.raises(RuntimeError, match="riscv64"):
        sandbox.seccomp_filter("riscv64")


# --- the Harbor path (harbor_env.py's ToolsSandbox, what BwrapEnvironment drives) ------------------------------

def test_harbor_root_exec_ends_the_agent_phase_and_cannot_open_by_handle(tmp_path):
    import types

    host_file = canary(tmp_path)
    task = make_task(tmp_path)
    t = types.SimpleNamespace(env_dir=str(task / "environment"), solution_dir=None, config={}, tests_dir=None,
                              name="harbor")
    with harbor_env._ToolsSandbox(t, tmp_path / "trial", sandbox.Limits()) as box:
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
    with sandbox.Sandbox(task_io.load_task(task), tmp_path / "trial") as box:
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
    import daytona_sandbox
    from test_cluster import FakeDaytona, _task
    task = _task(tmp_path)
    os.symlink("/etc/shadow", os.path.join(task.tests_dir, "shadow"))
    fake = FakeDaytona()
    with daytona_sandbox.DaytonaSandbox(task, tmp_path / "trial", client=fake) as box:
        with pytest.raises(ValueError, match="shadow.*leaves|links are refused"):
            box.run_verifier()
    assert fake.uploads == []  # e6526f2 uploaded the host's /etc/shadow through the link
