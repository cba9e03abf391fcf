"""sandbox/verifier_report.py (the host's end of the verifier's report channel) and its pytest plugin, without a jail.

The jail end to end (the attacks: a forging script, a killed or stopped pytest, a second reporter, an imported agent
module, a planted pytest.py) is in test_sandbox_security.py.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from sandbox import verifier_report  # noqa: E402


def _channel(tmp_path, uid=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return verifier_report.Channel(tmp_path / "report", os.getuid() if uid is None else uid).start()


def _connect(ch):
    """A client socket connected through /proc/self/fd (tmp_path may pass the 108-byte sun_path limit)."""
    s = socket.socket(socket.AF_UNIX)
    dfd = os.open(ch.sock_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.connect(f"/proc/self/fd/{dfd}/{verifier_report.SOCKET_NAME}")
    finally:
        os.close(dfd)
    return s


def _lines(*msgs):
    return b"".join(json.dumps(m).encode() + b"\n" for m in msgs)


START = {"t": "start", "pid": 1}


def _test(nodeid, when, outcome):
    return {"t": "test", "nodeid": nodeid, "when": when, "outcome": outcome}


def _done(status=1, foreign=()):
    return {"t": "done", "exitstatus": status, "foreign": list(foreign)}


def _run(tmp_path, *payloads, uid=None, scale=20, n_assertions=None):
    """Each payload is sent on its own connection, then closed; -> decide()'s dict."""
    ch = _channel(tmp_path, uid)
    for p in payloads:
        s = _connect(ch)
        s.sendall(p)
        s.close()
    ch.finish()
    return verifier_report.decide(ch, scale, n_assertions=n_assertions)


def _phases(nodeid, setup="passed", call="passed", teardown="passed"):
    return [_test(nodeid, "setup", setup)] + ([_test(nodeid, "call", call)] if call else []) + \
        [_test(nodeid, "teardown", teardown)]


def test_a_finished_report_pays_its_passed_tests_with_ctrf_semantics(tmp_path):
    msgs = (_phases("t::ok") + _phases("t::fails", call="failed") + _phases("t::skipped", setup="skipped", call=None)
            + _phases("t::teardown_error", teardown="failed")
            + _phases("t::rerun", call="failed") + _phases("t::rerun"))  # a rerun: its last attempt counts
    res = _run(tmp_path, _lines(START, *msgs, _done(1)))
    assert res == dict(reward=2 / 20, passed=2, total=5, source="ctrf", reason=None)
    res = _run(tmp_path / "b", _lines(START, *msgs, _done(1)), n_assertions=6)
    assert (res["passed"], res["total"]) == (2, 6) and "5 tests of the task's 6 assertions" in res["reason"]
    res = _run(tmp_path / "c", _lines(START, *msgs, _done(1)), n_assertions=4)  # more tests than the audit's count
    assert (res["reward"], res["source"]) == (0.0, "none") and "5 tests, more than the task's 4" in res["reason"]


def test_no_connection_is_none_for_the_binary_fallback_unless_test_sh_runs_pytest(tmp_path):
    assert _run(tmp_path) is None
    ch = _channel(tmp_path / "b")
    ch.finish()
    assert verifier_report.decide(ch, 20, test_sh=b"#!/bin/bash\n# pytest is not used\necho 1 > r\n") is None
    res = verifier_report.decide(ch, 20, test_sh=b"cd /tests\npython3 -m pytest test_outputs.py\n")
    assert res["source"] == "none" and "test.sh runs pytest but no pytest reported" in res["reason"]


@pytest.mark.parametrize("line, runs", [
    (b"pytest /tests", True), (b"python3 -m pytest -q", True), (b"/usr/bin/pytest", True),
    (b"pip install pytest", True),
    (b"# pytest", False), (b"   # run pytest", False), (b"echo pytest-json-ctrf", False), (b"mypytest", False),
    (b"echo pytest_x", False),
])
def test_runs_pytest_reads_test_sh_lines(line, runs):
    assert verifier_report.runs_pytest(b"#!/bin/bash\n" + line + b"\n") is runs


@pytest.mark.parametrize("payload, needle", [
    (_lines(START, *_phases("t::a")), "without the done line"),  # killed, crashed, timed out
    (_lines(START, *_phases("t::a"), _done(2)), "exit status 2"),  # interrupted (SIGINT from the agent's code)
    (_lines(START, *_phases("t::a"), _done(3)), "exit status 3"),
    (_lines(*_phases("t::a"), _done(0)), "line 1: not the start line"),
    (_lines(START, START, _done(0)), "a second start line"),
    (_lines(START, _done(0), _test("t::a", "call", "passed")), "data after the done line"),
    (_lines(START, {"t": "tests"}), "unknown line type 'tests'"),
    (_lines(START, _test("t::a", "call", "PASSED")), "outcome in"),
    (_lines(START, _test(["x"], "call", "passed")), "string nodeid"),
    (_lines(START, {"t": "done", "exitstatus": True, "foreign": []}), "integer exitstatus"),
    (_lines(START) + b'{"t": "done", "exitstatus": NaN, "foreign": []}\n', "not strict JSON"),
    (_lines(START) + b"\xff\xfe\n", "not strict JSON"),
    (_lines(START) + b"[" * 100_000 + b"\n", "longer than"),
    (_lines(START, _done(0))[:-1], "closed in the middle of a line"),
    (_lines(START) + b"x" * (verifier_report.MAX_LINE + 10), "a line longer than"),
])
def test_a_broken_report_pays_zero_and_names_why(tmp_path, payload, needle):
    res = _run(tmp_path, payload)
    assert (res["reward"], res["passed"], res["total"], res["source"]) == (0.0, 0, 0, "none"), res
    assert needle in res["reason"], res["reason"]


def test_a_second_reporter_pays_zero_whatever_it_sends(tmp_path):
    good = _lines(START, *_phases("t::a"), _done(0))
    res = _run(tmp_path, good, good)
    assert res["reward"] == 0.0 and "2 reporters connected" in res["reason"], res
    res = _run(tmp_path / "b", good, b"")  # a second connection that says nothing
    assert res["reward"] == 0.0 and "2 reporters connected" in res["reason"], res


def test_a_report_from_another_uid_pays_zero(tmp_path):
    res = _run(tmp_path, _lines(START, *_phases("t::a"), _done(0)), uid=os.getuid() + 4242)
    assert res["reward"] == 0.0 and f"not the verifier's uid {os.getuid() + 4242}" in res["reason"]


def test_a_flood_is_cut_at_the_byte_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(verifier_report, "MAX_BYTES", 1 << 20)
    ch = _channel(tmp_path)
    s = _connect(ch)
    line = json.dumps(_test("t::" + "x" * 900, "call", "passed")).encode() + b"\n"
    t0, sent = time.time(), 0
    with pytest.raises(OSError):  # the host closes its end past the cap: the flooder's write fails
        s.sendall(_lines(START))
        while time.time() - t0 < 20:
            s.sendall(line * 64)
            sent += len(line) * 64
    s.close()
    ch.finish()
    res = verifier_report.decide(ch, 20)
    assert res["reward"] == 0.0 and f"sent more than {1 << 20} bytes" in res["reason"], res
    assert sent < 16 << 20  # stopped within a few socket buffers of the cap


def test_a_connection_flood_closes_the_listener(tmp_path):
    ch = _channel(tmp_path)
    socks = [_connect(ch) for _ in range(verifier_report.MAX_CONNECTIONS)]
    deadline = time.time() + 5
    while not ch.capped and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError):  # the listener is closed: refused (or no such socket)
        _connect(ch)
    for s in socks:
        s.close()
    ch.finish()
    res = verifier_report.decide(ch, 20)
    assert res["reward"] == 0.0 and f"{verifier_report.MAX_CONNECTIONS} reporters connected (the cap" in res["reason"]


def test_a_reporter_still_queued_at_finish_is_counted(tmp_path):
    """A connection the reader has not accepted yet when the jail is closed is still taken (never a silent 'no
    reporter', which would fall back to reward.txt)."""
    ch = _channel(tmp_path)
    ch._closing_deadline = time.time() + 5
    ch._closing.set()  # as finish() does, but the connection arrives while the reader winds down
    s = _connect(ch)
    s.sendall(_lines(START, *_phases("t::a")))
    s.close()
    ch.finish()
    res = verifier_report.decide(ch, 20)
    assert res is not None and "without the done line" in res["reason"], res


def test_the_socket_binds_below_a_deep_directory(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    assert len(str(deep / "report" / "socket" / verifier_report.SOCKET_NAME)) > 108
    res = _run(deep, _lines(START, *_phases("t::a"), _done(0)))
    assert (res["passed"], res["total"]) == (1, 1)


def test_foreign_modules_are_flagged(tmp_path):
    res = _run(tmp_path, _lines(START, *_phases("t::a"), _done(0, ["solution (/app/solution.py)"])))
    assert (res["passed"], res["total"]) == (1, 1)
    assert "agent code ran inside the reporting pytest" in res["reason"] and "solution (/app/solution.py)" in \
        res["reason"]


# --- the plugin in a small bwrap jail of its own (the socket and the plugin at their in-jail paths) ---------------
needs_bwrap = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("bwrap"), reason="needs root and bwrap")


def _in_jail(ch, argv, cwd, env):
    jail = ["bwrap", "--dev-bind", "/", "/", "--tmpfs", "/run"] + ch.bwrap_args() + ["--chdir", str(cwd), "--"]
    return subprocess.run(jail + argv, env=env, capture_output=True, text=True, timeout=120)


PATH0_PROBE = ("import ctypes, json, os, sys\nimport verifier_report_plugin as p\np.pytest_sessionstart(None)\n"
               "print(json.dumps([sys.path[0], ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), "
               "{k: os.environ.get(k) for k in ('PYTHONSAFEPATH', 'PYTHONPATH', 'PYTEST_ADDOPTS')}]))\n")


@needs_bwrap
@pytest.mark.parametrize("argv, path0", [
    (["-c", PATH0_PROBE], ""),
    (["-X", "dev", "-W", "ignore", "-c", PATH0_PROBE], ""),
    (["-Bm", "probe_main"], "CWD"),
    (["-W", "ignore", "-m", "probe_main"], "CWD"),
    (["SCRIPT"], "SCRIPTDIR"),
    (["-P", "-c", PATH0_PROBE], "NOT-RESTORED"),
])
def test_the_plugin_takes_the_host_env_and_restores_sys_path_0(tmp_path, argv, path0):
    """At import: non-dumpable, the host's variables out of its environment, connected; at session start the
    sys.path[0] PYTHONSAFEPATH left out is back (-P on the command line: not)."""
    scripts, cwd = tmp_path / "scripts", tmp_path / "cwd"
    scripts.mkdir()
    cwd.mkdir()
    (scripts / "probe_main.py").write_text(PATH0_PROBE)
    argv = [str(scripts / "probe_main.py") if a == "SCRIPT" else a for a in argv]
    ch = _channel(tmp_path)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(
        [verifier_report.PLUGIN_DIR_IN_JAIL, str(scripts), "/keep"]),
           "PYTEST_ADDOPTS": f"-p no:cacheprovider -p {verifier_report.PLUGIN_NAME} -x"}
    out = _in_jail(ch, [sys.executable] + argv, cwd, env)
    ch.finish()
    assert out.returncode == 0, out.stderr
    got_path0, dumpable, got_env = json.loads(out.stdout.strip().splitlines()[-1])
    want = {"CWD": str(cwd), "SCRIPTDIR": str(scripts), "NOT-RESTORED": verifier_report.PLUGIN_DIR_IN_JAIL}
    assert got_path0 == want.get(path0, path0)  # -P: the first PYTHONPATH entry stays first
    assert dumpable == 0  # PR_GET_DUMPABLE
    assert got_env == {"PYTHONSAFEPATH": None, "PYTHONPATH": os.pathsep.join([str(scripts), "/keep"]),
                       "PYTEST_ADDOPTS": "-p no:cacheprovider -x"}
    assert len(ch.conns) == 1 and ch.conns[0]["uid"] == os.getuid() and ch.conns[0]["done"] is None


@needs_bwrap
def test_a_real_pytest_reports_through_the_plugin_and_help_or_version_does_not_connect(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("import pytest\n\ndef test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n\n"
                                     "@pytest.mark.skip\ndef test_skip():\n    pass\n\n"
                                     "@pytest.fixture\ndef broken():\n    yield\n    raise RuntimeError\n\n"
                                     "def test_teardown_error(broken):\n    pass\n")
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": verifier_report.PLUGIN_DIR_IN_JAIL,
           "PYTEST_ADDOPTS": f"-p no:cacheprovider -p {verifier_report.PLUGIN_NAME}",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    ch = _channel(tmp_path / "a")
    out = _in_jail(ch, [sys.executable, "-m", "pytest", "-q", str(tests)], tmp_path, env)
    ch.finish()
    assert out.returncode == 1, out.stdout + out.stderr
    res = verifier_report.decide(ch, 20)
    assert (res["passed"], res["total"], res["source"]) == (1, 4, "ctrf"), res
    assert "(modules: test_x (" in res["reason"]  # tests outside /tests: flagged as code from outside the roots
    for flag in ("--version", "--help"):
        ch = _channel(tmp_path / flag)
        out = _in_jail(ch, [sys.executable, "-m", "pytest", flag], tmp_path, env)
        ch.finish()
        assert out.returncode == 0 and verifier_report.decide(ch, 20) is None, (flag, out.stderr)
