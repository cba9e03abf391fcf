"""The verifier's pytest plugin (local jail): each test's outcome goes to the host over a socket, not to a file.

Loaded only inside the verifier's jail, by the environment jail.Sandbox.run_verifier sets (PYTEST_ADDOPTS
`-p verifier_report_plugin`, PYTHONPATH the read-only dir that holds this file alone); sandbox/verifier_report.py is
the host side and its docstring the protocol. What it does, in order:
- at import (while pytest parses its options, before any conftest, other plugin hook or test module runs): makes
  this process non-dumpable (prctl PR_SET_DUMPABLE 0: other processes of the verifier's uid can then neither ptrace
  it nor open its /proc/PID/mem, fd/ or environ); takes out of os.environ what the host set for this process only
  (the `-p` above, this dir in PYTHONPATH, PYTHONSAFEPATH), so a test's subprocesses, a nested pytest included, run
  in the plain environment and do not report; connects to the host's socket (close-on-exec: a test's subprocess
  never holds it; not for --help / --version) and sends the start line. Connecting this early leaves nothing the
  task's code runs (a conftest, a configure hook) before the reporter exists: agent code started there that kills
  this pytest leaves an unfinished report (0), not an absent one (which would fall back to reward.txt);
- at session start (after pytest configured itself, before collection): puts back the sys.path entry Python left
  out under PYTHONSAFEPATH (the cwd for `python -m pytest`: tests that import the agent's modules from the cwd
  still find them; pytest, its plugins and the modules it imports while configuring (pdb, readline) came from the
  interpreter, so an /app/pytest.py or /app/pdb.py is never imported in their place);
- each test report (setup, call, teardown): one JSON line {"t": "test", "nodeid", "when", "outcome"};
- at session finish, before any other plugin's sessionfinish (a hook wrapper: the CTRF writer failing on a
  directory the agent's code made read-only cannot stop it): {"t": "done", "exitstatus", "foreign"}, where
  foreign lists the modules this process loaded from outside the interpreter, the venv, /usr and /tests (a
  best-effort flag: agent code ran inside the reporting process, where it could have rewritten the outcomes).
Standard library and pytest only.
"""
import ctypes
import json
import os
import socket
import sys

import pytest

SOCKET_PATH = "/run/verifier-report/report.sock"  # verifier_report.SOCKET_DIR_IN_JAIL / SOCKET_NAME
PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
NAME = "verifier_report_plugin"
NODEID_MAX = 1000  # characters of a nodeid sent (the host caps a line at 16 KiB)
FOREIGN_MAX = 20  # modules named in the done line
NO_SESSION = ("-h", "--help", "-V", "--version")  # pytest options that exit before a session

_libc = ctypes.CDLL(None, use_errno=True)
if _libc.prctl(4, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:  # DUMPABLE 0
    raise RuntimeError(f"{NAME}: prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(ctypes.get_errno())}")


def _python_path0():
    """The sys.path[0] Python computes without PYTHONSAFEPATH, from sys.orig_argv: the cwd for -m, '' for -c and
    stdin, the script's directory for a script; None when it cannot tell or the command line itself asked for a
    safe path (-P, -I)."""
    args, i = sys.orig_argv[1:], 0
    while i < len(args):
        a = args[i]
        if a == "--check-hash-based-pycs":
            i += 2
            continue
        if a == "-" or not a.startswith("-"):
            return "" if a == "-" else os.path.dirname(os.path.realpath(a))
        if a.startswith("--"):
            i += 1
            continue
        for j, c in enumerate(a[1:], 1):  # a cluster of short options: -Bm pytest, -Wignore
            if c in "PI":
                return None
            if c in "mc":
                return os.getcwd() if c == "m" else ""
            if c in "WX":
                i += 0 if j + 1 < len(a) else 1  # its argument: the rest of the cluster or the next word
                break
        i += 1
    return None


def _take_host_env():
    """Remove what the host set for this pytest only; -> whether sys.path[0] is to be restored (the host's
    PYTHONSAFEPATH, not the command line, left it out)."""
    opts = os.environ.get("PYTEST_ADDOPTS", "").split()
    for k in range(len(opts) - 1):
        if opts[k] == "-p" and opts[k + 1] == NAME:
            del opts[k:k + 2]
            os.environ["PYTEST_ADDOPTS"] = " ".join(opts)
            break
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != PLUGIN_DIR]
    if paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    else:
        os.environ.pop("PYTHONPATH", None)
    return bool(os.environ.pop("PYTHONSAFEPATH", None)) and sys.flags.safe_path


def _send(msg):
    _sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


def _connect():
    """The report socket, connected (close-on-exec, PEP 446: a test's subprocess never holds it); None for pytest
    --help / --version, which run no session (a reporter that never finishes would pay 0)."""
    if any(a in NO_SESSION for a in sys.argv[1:] + os.environ.get("PYTEST_ADDOPTS", "").split()):
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(SOCKET_PATH)
    except OSError as e:
        s.close()
        raise RuntimeError(f"{NAME}: cannot reach the host's report socket {SOCKET_PATH}: {e}") from None
    return s


_restore_path0 = _take_host_env()
_sock = _connect()
if _sock is not None:
    _send({"t": "start", "pid": os.getpid()})


def _foreign_modules():
    """Names (and files) of loaded modules from outside the trusted roots (the agent's code, most likely)."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/tests",
                                           PLUGIN_DIR)}
    out = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not isinstance(f, str):
            continue
        real = os.path.realpath(f)
        if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
            out.append(f"{name[:100]} ({real[:200]})")
    return sorted(out)[:FOREIGN_MAX]


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    """Put back the sys.path entry PYTHONSAFEPATH left out (the cwd for `python -m pytest`), now that pytest has
    configured itself (it imports pdb, readline, ... lazily: from an /app cwd they would be the agent's modules)
    and just before collection imports the tests, which may import the agent's modules from the cwd."""
    if _restore_path0:
        path0 = _python_path0()
        if path0 is not None and path0 not in sys.path[:1]:
            sys.path.insert(0, path0)


def pytest_runtest_logreport(report):
    if _sock is not None:
        _send({"t": "test", "nodeid": report.nodeid[:NODEID_MAX], "when": report.when, "outcome": report.outcome})


@pytest.hookimpl(wrapper=True)
def pytest_sessionfinish(session, exitstatus):
    global _sock
    if _sock is not None:
        _send({"t": "done", "exitstatus": int(exitstatus), "foreign": _foreign_modules()})
        _sock.close()
        _sock = None
    return (yield)
