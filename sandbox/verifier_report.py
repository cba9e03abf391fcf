"""The verifier's report channel, host side (local bubblewrap jail): per-test outcomes over a socket, not a file.

The verifier runs the agent's code (a test's subprocess, an import, `python -m pytest` from /app) as the verifier's
uid, so any file the verifier can write, /logs/verifier/ctrf.json and reward.txt included, the agent's code can
forge (it did: an all-passed ctrf.json made read-only before pytest's own write). Here the report that pays leaves
through a channel that only the reporting pytest holds:
- Channel(dir, uid) makes a root-owned dir holding a listening Unix stream socket (bound read-only into the
  verifier's jail at SOCKET_DIR_IN_JAIL: connect() needs no write access to the mount) and a root-owned dir holding
  only sandbox/verifier_report_plugin.py (the jail's PYTHONPATH, read-only; jail.VERIFIER_ENV loads it).
- The plugin (its docstring) makes the pytest process non-dumpable and connects when pytest imports it (before any
  conftest or test module), sends one JSON line per test phase and a final `done` line.
- A thread accepts and reads every connection (SO_PEERCRED recorded; at most MAX_CONNECTIONS, MAX_BYTES per
  connection, MAX_LINE per line). decide() runs once the jail is closed (every verifier process dead):
  exactly one connection, from the verifier's uid, well-formed, ended by `done` with pytest's exit status 0, 1 or 5:
  P = its tests whose phases all passed (CTRF's statuses: the first non-passed phase decides), total = its tests;
  anything else pays 0 with a reason that names it (more than one reporter: agent code or a nested pytest loaded
  the plugin; closed without `done`: the reporter was killed or timed out; a malformed or oversized report;
  pytest interrupted or crashed) and never falls back to a file the agent's code could have written;
  no connection at all: 0 when the task's test.sh runs pytest (the plugin was kept from loading), else None: the
  caller falls back to reward.txt (verifiers that do not run pytest).
Protocol, one JSON object per line: {"t": "start", "pid"}, then {"t": "test", "nodeid", "when": setup | call |
teardown, "outcome": passed | failed | skipped} per phase, then {"t": "done", "exitstatus", "foreign": [...]}.
The threat model and what stays unprotectable: sandbox/jail.py's docstring ("The verifier's report").
"""
import json
import os
import re
import select
import shutil
import socket
import struct
import threading
import time

import reward
from sandbox import host_fs

SOCKET_DIR_IN_JAIL = "/run/verifier-report"
SOCKET_NAME = "report.sock"
PLUGIN_DIR_IN_JAIL = "/run/verifier-plugin"
PLUGIN_NAME = "verifier_report_plugin"
PLUGIN_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), PLUGIN_NAME + ".py")
MAX_CONNECTIONS = 8  # more than one already pays 0; the cap only bounds the host's work
MAX_BYTES = 8 << 20  # per connection: ~50,000 test phases with long nodeids
MAX_LINE = 16 << 10  # the plugin cuts a nodeid at 1000 characters
OK_EXIT = (0, 1, 5)  # pytest's exit codes of a run that finished: all passed, some failed, no tests collected
PHASES, OUTCOMES = ("setup", "call", "teardown"), ("passed", "failed", "skipped")
_PYTEST = re.compile(rb"(?<![\w.-])pytest(?![\w-])")


class Channel:
    """The host's end of the report channel for one verifier run: start() before the jail, finish() after it."""

    def __init__(self, host_dir, uid):
        self.dir, self.uid = os.path.abspath(host_dir), uid
        self.sock_dir, self.plugin_dir = os.path.join(self.dir, "socket"), os.path.join(self.dir, "plugin")
        self.conns = []  # dicts: pid, uid, lines (parsed), bytes, done, error
        self.accept_error = None
        self.capped = False  # MAX_CONNECTIONS reached: the listener was closed, later connect()s were refused
        self._listener = None
        self._thread = None
        self._closing = threading.Event()
        self._wake_r = self._wake_w = -1  # a pipe: finish() wakes the reader at once

    def start(self):
        """Create the dirs (root-owned, 0755: the jail reads them, never writes), copy the plugin, listen."""
        host_fs.make_dir(self.dir, 0o755)  # fresh: FileExistsError on a second run
        for d in (self.sock_dir, self.plugin_dir):
            host_fs.make_dir(d, 0o755)
        shutil.copyfile(PLUGIN_SRC, os.path.join(self.plugin_dir, PLUGIN_NAME + ".py"))
        os.chmod(os.path.join(self.plugin_dir, PLUGIN_NAME + ".py"), 0o644)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dfd = os.open(self.sock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:  # through /proc/self/fd: a trial dir deep enough to pass the 108-byte sun_path limit still binds
            self._listener.bind(f"/proc/self/fd/{dfd}/{SOCKET_NAME}")
            os.chmod(SOCKET_NAME, 0o666, dir_fd=dfd)  # connect() needs write permission on the socket inode
        finally:
            os.close(dfd)
        self._listener.listen(MAX_CONNECTIONS)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="verifier-report", daemon=True)
        self._thread.start()
        return self

    def bwrap_args(self):
        parent = os.path.dirname(SOCKET_DIR_IN_JAIL)  # /run, readable (bwrap makes a missing parent 0700)
        return ["--perms", "0755", "--dir", parent, "--ro-bind", self.sock_dir, SOCKET_DIR_IN_JAIL,
                "--ro-bind", self.plugin_dir, PLUGIN_DIR_IN_JAIL]

    def _serve(self):
        socks, bufs = {}, {}
        try:
            while True:
                rl = [self._listener] if self._listener is not None else []
                ready, _, _ = select.select(rl + list(socks) + [self._wake_r], [], [], 1.0)
                for s in ready:
                    if s == self._wake_r:
                        os.read(self._wake_r, 64)
                        continue
                    if s is self._listener:
                        self._accept(socks, bufs)
                        continue
                    c = socks[s]
                    try:
                        data = s.recv(65536)
                    except OSError as e:
                        data, c["error"] = b"", c["error"] or f"read failed: {e}"
                    if not data:
                        self._end(c, bufs.pop(s))
                        s.close()
                        del socks[s]
                        continue
                    c["bytes"] += len(data)
                    if c["bytes"] > MAX_BYTES:
                        c["error"] = c["error"] or f"sent more than {MAX_BYTES} bytes"
                        bufs.pop(s)
                        s.close()
                        del socks[s]
                        continue
                    bufs[s] = self._lines(c, bufs[s] + data)
                if self._closing.is_set() and self._listener is not None:  # the jail is closed: no new peer can
                    while self._listener is not None and self._accept(socks, bufs):  # come; take those queued
                        pass
                    if self._listener is not None:
                        self._listener.close()
                        self._listener = None
                if self._closing.is_set() and not socks:
                    return
                if self._closing.is_set() and time.time() > self._closing_deadline:
                    for s, c in socks.items():
                        c["error"] = c["error"] or "still open when the verifier's jail was closed"
                        s.close()
                    return
        except Exception as e:  # never silent: decide() names it
            self.accept_error = f"{type(e).__name__}: {e}"

    def _accept(self, socks, bufs):
        try:
            s, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        c = dict(pid=pid, uid=uid, lines=[], bytes=0, done=None, error=None)
        self.conns.append(c)
        socks[s], bufs[s] = c, b""
        if len(self.conns) >= MAX_CONNECTIONS:  # a flood of connections: later ones are refused by the kernel
            self.capped = True
            self._listener.close()
            self._listener = None
        return True

    def _lines(self, c, buf):
        """Parse the complete lines in buf into c; return the incomplete rest (refused past MAX_LINE)."""
        *complete, rest = buf.split(b"\n")
        for raw in complete:
            if c["error"] is None:
                try:
                    self._line(c, raw)
                except ValueError as e:
                    c["error"] = str(e)
        if len(rest) > MAX_LINE and c["error"] is None:
            c["error"] = f"a line longer than {MAX_LINE} bytes"
        return b"" if len(rest) > MAX_LINE else rest

    @staticmethod
    def _line(c, raw):
        n = len(c["lines"]) + 1
        if len(raw) > MAX_LINE:
            raise ValueError(f"line {n}: longer than {MAX_LINE} bytes")
        if c["done"] is not None:
            raise ValueError(f"line {n}: data after the done line")
        try:
            msg = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"line {n}: not strict JSON ({str(e)[:80]})") from None
        t = msg.get("t") if isinstance(msg, dict) else None
        if n == 1 and t != "start":
            raise ValueError("line 1: not the start line")
        if t == "start":
            if n != 1:
                raise ValueError(f"line {n}: a second start line")
        elif t == "test":
            nodeid, when, outcome = msg.get("nodeid"), msg.get("when"), msg.get("outcome")
            if not isinstance(nodeid, str) or when not in PHASES or outcome not in OUTCOMES:
                raise ValueError(f"line {n}: a test line needs a string nodeid, when in {PHASES}, outcome in "
                                 f"{OUTCOMES}")
            c["lines"].append((nodeid, when, outcome))
            return
        elif t == "done":
            status, foreign = msg.get("exitstatus"), msg.get("foreign")
            if isinstance(status, bool) or not isinstance(status, int) or not isinstance(foreign, list) or \
                    not all(isinstance(f, str) for f in foreign):
                raise ValueError(f"line {n}: a done line needs an integer exitstatus and a list of strings foreign")
            c["done"] = dict(exitstatus=status, foreign=[f[:300] for f in foreign[:20]])
            return
        else:
            raise ValueError(f"line {n}: unknown line type {str(t)[:40]!r}")
        c["lines"].append(None)  # the start line (counted, not a test)

    def finish(self, timeout=5.0):
        """Stop serving (call once every verifier process is dead: their connections are at EOF) and close."""
        self._closing_deadline = time.time() + timeout
        self._closing.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout + 1.0)
        if self._thread is not None and self._thread.is_alive():
            self.accept_error = self.accept_error or f"the reader did not stop within {timeout:g} s"
        elif self._wake_r >= 0:
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1

    @staticmethod
    def _end(c, rest):
        if rest and c["error"] is None:
            c["error"] = "closed in the middle of a line"


def statuses_of(lines):
    """CTRF statuses per test from its phase reports, as pytest-json-ctrf computes them: the first phase that did not
    pass decides (skipped, failed); a second setup starts a new attempt (a rerun), whose status counts."""
    status, seen_setup = {}, set()
    for nodeid, when, outcome in lines:
        if when == "setup" and nodeid in seen_setup:
            status[nodeid] = "pending"  # a rerun: the new attempt's status replaces the old one
        if when == "setup":
            seen_setup.add(nodeid)
        cur = status.get(nodeid, "pending")
        if cur in ("pending", "passed"):
            status[nodeid] = outcome
    return status


def runs_pytest(test_sh: bytes) -> bool:
    """Whether a test.sh runs pytest: the word on a line that is not a comment."""
    return any(_PYTEST.search(ln) for ln in test_sh.splitlines() if not ln.lstrip().startswith(b"#"))


def decide(ch, scale, n_assertions=None, test_sh=b""):
    """The reward of a verifier run from its Channel (after finish()): reward.py's dict, or None when no pytest
    connected and test_sh (the task's test.sh) does not run pytest (the caller falls back to reward.txt). What pays
    0 and why: the module docstring."""
    if ch.accept_error:
        return _zero(f"report channel failed: {ch.accept_error}")
    conns = ch.conns
    if not conns and runs_pytest(test_sh):  # its plugin was kept from loading, or pytest never started
        return _zero("test.sh runs pytest but no pytest reported through the report channel (its plugin did not "
                     "load: PYTEST_ADDOPTS replaced, -p no:, python -I, an ini file's addopts; or pytest did not "
                     "start); a ctrf.json or reward.txt file does not pay in its place")
    if not conns:
        return None
    if len(conns) > 1:
        who = ", ".join(f"pid {c['pid']}" for c in conns[:4]) + (", ..." if len(conns) > 4 else "")
        more = " (the cap: later ones were refused)" if ch.capped else ""
        return _zero(f"{len(conns)} reporters connected{more} ({who}): only the verifier's own pytest may report; "
                     f"another one is the agent's code or a nested pytest that loaded {PLUGIN_NAME}")
    c = conns[0]
    who = f"the reporting pytest (pid {c['pid']})"
    if c["uid"] != ch.uid:
        return _zero(f"{who} runs as uid {c['uid']}, not the verifier's uid {ch.uid}")
    if c["error"]:
        return _zero(f"{who} sent a malformed report: {c['error']}")
    if c["done"] is None:
        return _zero(f"{who} closed its report without the done line (killed, crashed or timed out)")
    status = c["done"]["exitstatus"]
    if status not in OK_EXIT:
        return _zero(f"{who} ended with exit status {status} (interrupted, internal or usage error): its tests did "
                     f"not all run")
    statuses = list(statuses_of([ln for ln in c["lines"] if ln is not None]).values())
    res = reward.score_statuses(statuses, scale, n_assertions=n_assertions, origin="the report channel")
    if c["done"]["foreign"]:
        flag = (f"agent code ran inside the reporting pytest, where it could rewrite outcomes (modules: "
                f"{', '.join(c['done']['foreign'][:5])}); the outcomes are taken as reported")
        res["reason"] = flag if res["reason"] is None else f"{res['reason']}; {flag}"
    return res


def _no_constant(name):
    raise ValueError(f"{name} is not strict JSON")


def _zero(reason):
    return dict(reward=0.0, passed=0, total=0, source="none", reason=reason)
