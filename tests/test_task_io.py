"""task_io.load_task on hostile task dirs: it never hangs, never reads without bound, never follows a link, and every
refusal is a ValueError naming the file and the problem."""
import os
import stat
import threading
import time

import pytest

from sandbox import task_io

TOML = ('version = "1.0"\n\n[metadata]\ndifficulty = "medium"\ncategory = "system-administration"\n\n'
        '[verifier]\ntimeout_sec = 900.0\n\n[agent]\ntimeout_sec = 1800.0\n\n'
        '[environment]\nbuild_timeout_sec = 600.0\ncpus = 1\nmemory = "2G"\n')


def make_task(root):
    """A small Terminal-Bench 2 style task dir."""
    files = {"task.toml": TOML, "instruction.md": "Rotate the logs in /var/log/app.\n",
             "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n", "environment/app/in.txt": "a\nb\n",
             "tests/test.sh": "#!/bin/bash\npytest /tests/test_outputs.py\n",
             "tests/test_outputs.py": "def test_rotated():\n    assert True\n",
             "solution/solve.sh": "#!/bin/bash\nls\n"}
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def load_within(d, seconds=10.0):
    """load_task(d) in a thread -> the Task or the exception it raised; fails the test when it takes longer than
    `seconds` (then every FIFO in d is opened for writing once, so the stuck thread can end)."""
    out = []
    th = threading.Thread(target=lambda: out.append(_call(d)), daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(seconds)
    if th.is_alive():
        for dirpath, dirs, files in os.walk(d):
            for n in dirs + files:
                p = os.path.join(dirpath, n)
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    try:
                        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
                    except OSError:
                        pass
        pytest.fail(f"load_task({d}) still running after {seconds} s")
    assert time.monotonic() - t0 < seconds
    return out[0]


def _call(d):
    try:
        return task_io.load_task(str(d))
    except BaseException as e:  # noqa: BLE001 (the test inspects what was raised)
        return e


def refused(d, *needles):
    """load_task(d) raises ValueError; its message names every needle and is printable UTF-8 -> the message."""
    got = load_within(d)
    assert isinstance(got, ValueError), f"expected a ValueError, got {got!r}"
    msg = str(got)
    msg.encode("utf-8")  # no lone surrogate: the message can be printed and logged
    for n in needles:
        assert str(n) in msg, msg
    return msg


def test_a_real_task_loads(tmp_path):
    t = load_within(make_task(tmp_path / "t"))
    assert isinstance(t, task_io.Task), t
    assert t.instruction == "Rotate the logs in /var/log/app." and t.config["verifier"]["timeout_sec"] == 900.0
    assert t.solution_dir == str(tmp_path / "t" / "solution")


HARBOR_TOML = """schema_version = "1.1"
artifacts = []

[task]
name = "terminal-bench/sort-logs"
description = "Sort the logs."
keywords = ["file-operations"]
[[task.authors]]
name = "Jane Doe"
email = "jane@example.com"

[metadata]
author_name = "Jane Doe"
difficulty = "hard"
category = "file-operations"
tags = []
expert_time_estimate_min = 960.0

[verifier]
timeout_sec = 3600.0

[agent]
timeout_sec = 3600.0

[environment]
build_timeout_sec = 600.0
docker_image = "example/sort-logs:20251031"
cpus = 1
memory_mb = 2048
storage_mb = 10240
gpus = 0
allow_internet = true
mcp_servers = []

[verifier.env]

[environment.env]

[solution.env]
"""


def test_a_terminal_bench_2_task_toml_in_harbor_schema_1_1_loads(tmp_path):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_text(HARBOR_TOML)
    t = load_within(d)
    assert isinstance(t, task_io.Task), t
    assert t.config["task"]["authors"][0]["name"] == "Jane Doe" and t.config["agent"]["timeout_sec"] == 3600.0


# --- special files: never opened blocking, never read --------------------------------------------------------

@pytest.mark.parametrize("rel", ["task.toml", "instruction.md", "tests/test.sh", "environment/app/sub/pipe"])
def test_a_fifo_anywhere_is_refused_without_hanging(tmp_path, rel):
    d = make_task(tmp_path / "t")
    p = d / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists():
        p.unlink()
    os.mkfifo(p)
    refused(d, p, "a FIFO")


@pytest.mark.parametrize("rel, target", [("task.toml", "/dev/zero"), ("instruction.md", "/proc/self/environ"),
                                         ("instruction.md", "/etc/hostname"), ("instruction.md", "tests/test.sh"),
                                         ("environment/app/sub/link", "../in.txt"),
                                         ("tests/test_outputs.py", "/etc/passwd")])
def test_a_link_anywhere_is_refused_and_never_followed(tmp_path, rel, target):
    d = make_task(tmp_path / "t")
    p = d / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists():
        p.unlink()
    os.symlink(target, p)
    msg = refused(d, p, "symbolic link", repr(target))
    assert "PATH=" not in msg and "root:" not in msg  # nothing of the target was read
    assert ("leaves the task dir" in msg) == target.startswith("/")


def test_a_task_dir_that_is_a_link_is_refused(tmp_path):
    real = make_task(tmp_path / "real")
    os.symlink(real, tmp_path / "link")
    refused(tmp_path / "link", tmp_path / "link", "symbolic link")


def test_a_hard_link_is_refused(tmp_path):
    host = tmp_path / "host-secret.txt"
    host.write_text("secret\n")
    d = make_task(tmp_path / "t")
    (d / "instruction.md").unlink()
    os.link(host, d / "instruction.md")
    msg = refused(d, d / "instruction.md", "2 hard links")
    assert "secret" not in msg
    (d / "instruction.md").unlink()
    (d / "instruction.md").write_text("Do it.\n")
    os.link(host, d / "environment" / "app" / "copy.txt")
    refused(d, d / "environment" / "app" / "copy.txt", "hard links")


def test_sockets_and_devices_are_refused(tmp_path):
    import socket
    d = make_task(tmp_path / "t")
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(d / "tests" / "sock"))
        refused(d, d / "tests" / "sock", "a socket")
    finally:
        s.close()
    os.unlink(d / "tests" / "sock")
    if os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    (d / "task.toml").unlink()
    os.mknod(d / "task.toml", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's numbers
    refused(d, d / "task.toml", "a device file")


@pytest.mark.parametrize("rel", ["task.toml", "instruction.md", "tests/test.sh"])
def test_a_directory_in_place_of_a_file_is_refused(tmp_path, rel):
    d = make_task(tmp_path / "t")
    (d / rel).unlink()
    (d / rel).mkdir()
    refused(d, d / rel, "a directory, not a regular file")


@pytest.mark.parametrize("rel", ["environment", "tests", "solution"])
def test_a_file_in_place_of_a_directory_is_refused(tmp_path, rel):
    import shutil
    d = make_task(tmp_path / "t")
    shutil.rmtree(d / rel)
    (d / rel).write_text("x\n")
    refused(d, d / rel, "not a directory")


# --- sizes: capped before reading ----------------------------------------------------------------------------

def test_a_sparse_100_gib_instruction_is_refused_before_reading(tmp_path):
    d = make_task(tmp_path / "t")
    os.truncate(d / "instruction.md", 100 << 30)
    t0 = time.monotonic()
    refused(d, d / "instruction.md", str(100 << 30), f"cap of {task_io.MAX_INSTRUCTION_BYTES} bytes")
    assert time.monotonic() - t0 < 2


def test_instruction_and_toml_size_caps(tmp_path):
    d = make_task(tmp_path / "t")
    line = "Rotate the logs in /var/log/app and keep the last three files.\n"
    text = line * (task_io.MAX_INSTRUCTION_BYTES // len(line))
    (d / "instruction.md").write_text(text)
    assert load_within(d).instruction == text.strip()  # at the cap: loads
    (d / "instruction.md").write_text(text + "x" * len(line))
    refused(d, d / "instruction.md", "cap of")
    (d / "instruction.md").write_text("Do it.\n")
    (d / "task.toml").write_text(TOML + "# padding\n" * (task_io.MAX_TOML_BYTES // 10))
    refused(d, d / "task.toml", f"cap of {task_io.MAX_TOML_BYTES} bytes")


def test_real_terminal_bench_sizes_are_far_below_the_caps():
    # Terminal-Bench 2's task.toml files are about 1 KiB and its instructions a few KiB
    assert task_io.MAX_TOML_BYTES >= 16 << 10 and task_io.MAX_INSTRUCTION_BYTES >= 256 << 10


# --- the tree walk: bounded ----------------------------------------------------------------------------------

def test_too_many_entries_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(task_io, "MAX_TASK_ENTRIES", 200)
    d = make_task(tmp_path / "t")
    assert isinstance(load_within(d), task_io.Task)
    for i in range(300):
        (d / "environment" / "app" / f"f{i}").write_text("")
    refused(d, "more than 200 files and directories")


def test_too_deep_a_tree_is_refused(tmp_path):
    d = make_task(tmp_path / "t")
    p = d / "environment" / "app"
    for _ in range(task_io.MAX_TASK_DEPTH + 2):
        p = p / "d"
    p.mkdir(parents=True)
    refused(d, f"more than {task_io.MAX_TASK_DEPTH} directory levels")


def test_odd_bytes_in_names(tmp_path):
    d = make_task(tmp_path / "t")
    odd = os.path.join(os.fsencode(d / "environment" / "app"), b"\xff\x1bname\n.txt")
    with open(odd, "wb") as f:  # a data file with an odd name: it loads (the jail copies it as it is)
        f.write(b"x")
    assert isinstance(load_within(d), task_io.Task)
    os.unlink(odd)
    os.mkfifo(odd)  # refused with a printable message
    msg = refused(d, "a FIFO", "\\xff")
    assert "\n" not in msg
    os.unlink(odd)
    root = os.path.join(os.fsencode(tmp_path), b"task-\xff\n")
    os.rename(d, root)
    refused(os.fsdecode(root), "not printable UTF-8")


# --- parse errors name the file and the problem --------------------------------------------------------------

@pytest.mark.parametrize("text, needle", [
    ("a = " + "[" * 6_000 + "]" * 6_000 + "\n", "nested"),
    ("a = " + "{b = " * 2_000 + "1" + "}" * 2_000 + "\n", "nested"),
    ("a" + ".a" * 40 + " = 1\n", "nested"),
    ("[metadata\nx = 1\n", "invalid TOML"),
    (b"\xff\xfe[\x00m\x00", "not UTF-8"),
    ("x = 1\x00\n", "NUL bytes"),
    ("metadata = [1, 2]\n", "[metadata] must be a table"),
    ("[[verifier]]\ntimeout_sec = 9\n", "[verifier] must be a table"),
    ('[metadata]\nfamily = 5\n', "[metadata] family must be a string"),
    ('[environment]\ndocker_image = ["x"]\n', "[environment] docker_image must be a string"),
])
def test_bad_task_toml_is_a_value_error_naming_it(tmp_path, text, needle):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(d, d / "task.toml", needle)


def test_the_slowest_task_toml_under_the_cap_parses_quickly(tmp_path):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_text("a" + ".a" * (task_io.MAX_TOML_BYTES // 2 - 4) + " = 1\n")  # tomllib: quadratic
    t0 = time.process_time()  # this process's CPU time: the parse's own cost, whatever else the machine runs
    refused(d, d / "task.toml", "nested more than")
    assert time.process_time() - t0 < 5  # about 1 s at the 16 KiB cap; 64 KiB took ~10 s


@pytest.mark.parametrize("data, needle", [(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xd8", "not UTF-8"),
                                          (b"Do it.\x00\x00\n", "NUL"), (b"\xef\xbb\xbf  \n\t\n", "empty")])
def test_bad_instruction_is_a_value_error_naming_it(tmp_path, data, needle):
    d = make_task(tmp_path / "t")
    (d / "instruction.md").write_bytes(data)
    refused(d, d / "instruction.md", needle)


# --- sane ranges ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["100000000000000000", "10001", "0", "-1", "1e17", "true"])
def test_n_assertions_out_of_range_is_refused(tmp_path, value):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_text(TOML.replace("[metadata]\n", f"[metadata]\nn_assertions = {value}\n"))
    refused(d, d / "task.toml", "[metadata] n_assertions", f"1..{task_io.MAX_N_ASSERTIONS}")
    (d / "task.toml").write_text(TOML)
    (d / task_io.AUDIT_FILE).write_text(f'{{"n_assertions": {value}}}')
    refused(d, d / task_io.AUDIT_FILE, "n_assertions", f"1..{task_io.MAX_N_ASSERTIONS}")


def test_n_assertions_in_range_loads(tmp_path):
    d = make_task(tmp_path / "t")
    n = task_io.MAX_N_ASSERTIONS
    (d / "task.toml").write_text(TOML.replace("[metadata]\n", f"[metadata]\nn_assertions = {n}\n"))
    assert load_within(d).n_assertions == task_io.MAX_N_ASSERTIONS


@pytest.mark.parametrize("key", ["[verifier] timeout_sec", "[agent] timeout_sec", "[environment] build_timeout_sec",
                                 "[solution] timeout_sec", "[environment.healthcheck] timeout_sec"])
@pytest.mark.parametrize("value", ["1e-300", "0.5", "86401", "1e9", "nan", "inf", "-inf", "-5", "0", "true", '"60"'])
def test_every_timeout_out_of_range_is_refused(tmp_path, key, value):
    table, field = key[1:].split("] ")
    d = make_task(tmp_path / "t")
    toml = TOML.replace(f"[{table}]\n{field} = ", f"[{table}]\n# was ") if f"[{table}]\n" in TOML else TOML
    toml = toml.replace(f"[{table}]\n", f"[{table}]\n{field} = {value}\n") if f"[{table}]\n" in toml \
        else toml + f"\n[{table}]\n{field} = {value}\n"
    (d / "task.toml").write_text(toml)
    refused(d, d / "task.toml", key, f"{task_io.MIN_TIMEOUT_S:g}..{task_io.MAX_TIMEOUT_S:g} s")


@pytest.mark.parametrize("value", ["1", "1.0", "86400", "12000.0"])
def test_timeouts_in_range_load(tmp_path, value):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_text(TOML.replace("[agent]\ntimeout_sec = 1800.0", f"[agent]\ntimeout_sec = {value}"))
    assert load_within(d).config["agent"]["timeout_sec"] == float(value)


def test_environment_variables_are_not_taken_for_timeouts(tmp_path):
    d = make_task(tmp_path / "t")
    (d / "task.toml").write_text(TOML + '\n[verifier.env]\nmy_timeout_sec = "soon"\n')
    assert load_within(d).config["verifier"]["env"]["my_timeout_sec"] == "soon"


def test_an_unreadable_directory_is_a_value_error(tmp_path, monkeypatch):
    d = make_task(tmp_path / "t")
    real = os.scandir

    def scandir(fd):
        if isinstance(fd, int) and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "app":
            raise PermissionError(13, "Permission denied")
        return real(fd)
    monkeypatch.setattr(task_io.os, "scandir", scandir)
    refused(d, d / "environment" / "app", "cannot be listed (Permission denied)")


def test_rollout_cli_on_a_fifo_task_toml_exits_with_the_reason(tmp_path):
    import subprocess
    import sys
    d = make_task(tmp_path / "t")
    (d / "task.toml").unlink()
    os.mkfifo(d / "task.toml")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "rollout.py"), "--task", str(d), "--agent", "oracle"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and f"{d / 'task.toml'}: not a regular file inside the task dir: a FIFO" in p.stderr


def test_a_file_swapped_after_the_walk_is_still_refused(tmp_path, monkeypatch):
    """Between the walk and the read, task.toml becomes a FIFO, a link to /dev/zero, a hard link: refused at open."""
    host = tmp_path / "host.txt"
    host.write_text("secret = 1\n")
    swaps = {"a FIFO": lambda p: os.mkfifo(p), "without following a link": lambda p: os.symlink("/dev/zero", p),
             "2 hard links": lambda p: os.link(host, p)}
    for needle, swap in swaps.items():
        d = make_task(tmp_path / needle.replace(" ", "-"))

        def walk_then_swap(*a, swap=swap, d=d):
            (d / "task.toml").unlink()
            swap(d / "task.toml")
        monkeypatch.setattr(task_io, "_check_tree", walk_then_swap)
        msg = refused(d, d / "task.toml", needle)
        assert "secret" not in msg
