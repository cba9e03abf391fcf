"""engine/httpjson.py: the servers' bounds (a total request deadline, no thread for a waiting connection, a cap on open
connections), strict text (UTF-8, no lone surrogates, bounded nesting), every 5xx logged. Loopback only."""
import json
import socket
import threading
import time

import pytest

from engine import httpjson

pytestmark = pytest.mark.waits  # slow HTTP clients: mostly waiting (tests/suite_order.py runs them first)


class Echo(httpjson.JSONHandler):
    timeout = 1.0  # the request deadline of these tests (httpjson.READ_TIMEOUT_S in service)

    def do_POST(self):
        try:
            body = self.read_json()
            if self.path == "/slow":
                time.sleep(2.0)  # serving may take longer than the read deadline
            if self.path == "/boom":
                try:
                    {}["no-such-key"]
                except KeyError as e:
                    return self._send(500, {"error": f"server: {type(e).__name__}: {e}"})
            if self.path == "/plain":  # a 5xx sent without a fault in hand: one line
                return self._send(503, {"error": "backend: not ready"})
            if self.path == "/escapes":
                raise RuntimeError("a fault that escapes do_POST")
            self._send(200, {"echo": body})
        except httpjson.HTTPError as e:
            self.send_error_json(e)


@pytest.fixture()
def server():
    srv = httpjson.JSONServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def request(path, body: bytes, headers=()):
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_replies(s, n, timeout=10.0):
    """n HTTP replies from socket s -> [(status, JSON body)]; AssertionError if the server closed before."""
    s.settimeout(timeout)
    buf, out = b"", []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"closed without a reply (got {buf[:200]!r})")
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        k = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        while len(buf) < k:
            buf += s.recv(65536)
        out.append((int(head.split()[1]), json.loads(buf[:k])))
        buf = buf[k:]
    return out


def read_reply(s, timeout=10.0):
    return read_replies(s, 1, timeout)[0]


def post(srv, path, body: bytes, headers=()):
    with socket.create_connection(srv.server_address[:2], timeout=10) as s:
        s.sendall(request(path, body, headers))
        return read_reply(s)


def test_a_client_sending_a_byte_at_a_time_is_cut_off_at_the_request_deadline(server):
    """The deadline is on the whole request, not per read: a byte every 0.3 s (each read well inside 1 s) gets 408
    about 1 s after its first byte. Before: the read timeout restarted on each byte and the client held on."""
    data = request("/", b'{"a": ' + b"1" * 200 + b"}")
    for start in (1, len(data) - 20):  # trickled from its first byte, then from within the body
        with socket.create_connection(server.server_address[:2], timeout=10) as s:
            s.sendall(data[:start])
            t0, status = time.monotonic(), None
            for i in range(start, len(data)):  # bounded: one byte per 0.3 s, at most 5 s
                try:
                    status, res = read_reply(s, timeout=0.3)
                    break
                except TimeoutError:
                    s.sendall(data[i:i + 1])
                assert time.monotonic() - t0 < 5, "still held after 5 s"
            took = time.monotonic() - t0
        assert status == 408 and 0.9 < took < 3.0, (status, took)
        assert res["error"].startswith("request:" if start == 1 else "body:"), res


def test_waiting_connections_hold_no_thread_and_over_the_cap_are_refused_at_once(monkeypatch):
    """Idle connections wait in the selector (0 threads; before: one thread each). Past max_connections a new
    connection gets 503 naming the cap at once; idle ones are closed after IDLE_TIMEOUT_S; the count returns to 0."""
    monkeypatch.setattr(httpjson, "IDLE_TIMEOUT_S", 3.0)
    srv = httpjson.JSONServer(("127.0.0.1", 0), Echo, max_connections=40)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    addr = srv.server_address[:2]
    base = threading.active_count()
    idle = [socket.create_connection(addr, timeout=10) for _ in range(40)]
    try:
        deadline = time.monotonic() + 5
        while srv.open < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.open == 40 and threading.active_count() - base <= 1, (srv.open, threading.active_count() - base)
        t0 = time.monotonic()
        with socket.create_connection(addr, timeout=10) as s:
            status, res = read_reply(s, timeout=5)
        assert status == 503 and "max_connections" in res["error"] and time.monotonic() - t0 < 2, (status, res)
        assert srv.refused == 1
        for s in idle[:5]:  # room again: served
            s.close()
        deadline = time.monotonic() + 5
        while srv.open > 35 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert post(srv, "/", b'{"x": 1}') == (200, {"echo": {"x": 1}})
        for s in idle[5:]:  # the idle timeout closes the rest (EOF on the client's side)
            s.settimeout(6)
            assert s.recv(10) == b""
        deadline = time.monotonic() + 5
        while srv.open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.open == 0
    finally:
        for s in idle:
            s.close()
        srv.shutdown()
        srv.server_close()
    assert 560 <= httpjson.MAX_CONNECTIONS <= httpjson.LISTEN_BACKLOG  # paper: 560 trials, one request in flight each


def test_a_long_request_keep_alive_and_pipelining_still_work(server):
    """Serving is not under the read deadline (a 2 s request with a 1 s deadline is answered); a kept-alive
    connection goes back to the waiting room and serves again; two pipelined requests get two replies."""
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        s.sendall(request("/slow", b'{"n": 1}'))
        assert read_reply(s) == (200, {"echo": {"n": 1}})
        time.sleep(0.5)
        s.sendall(request("/", b'{"n": 2}'))
        assert read_reply(s) == (200, {"echo": {"n": 2}})
        s.sendall(request("/", b'{"n": 3}') + request("/", b'{"n": 4}'))
        assert read_replies(s, 2) == [(200, {"echo": {"n": 3}}), (200, {"echo": {"n": 4}})]
    # Expect: 100-continue: the waiting room says continue, then the body is read
    with socket.create_connection(server.server_address[:2], timeout=10) as s:
        body = b'{"n": 5}'
        s.sendall(request("/", body, ["Expect: 100-continue"])[:-len(body)])
        s.settimeout(5)
        assert s.recv(100).startswith(b"HTTP/1.1 100")
        s.sendall(body)
        assert read_reply(s) == (200, {"echo": {"n": 5}})


def test_text_that_is_not_unicode_or_too_deep_is_400_naming_the_field(server):
    cases = [
        (b'{"messages": [{"content": "a\\ud800b"}]}', "messages[0].content", "lone surrogate U+D800"),
        (b'{"a": {"b": ["x", "\\udfff"]}}', "a.b[1]", "U+DFFF"),
        (b'{"a": {"\\ud800": 1}}', "a", "a key"),
        (b'{"odd key": "\\ud83d"}', '["odd key"]', "U+D83D"),  # a high surrogate without its low half
        (b'{"a": "\\ude00\\ud83d"}', "a", "U+DE00"),  # the halves in the wrong order
        (b'"\\ud800"', "body", "lone surrogate"),
        (b'{"a": "\xff"}', None, "not UTF-8"),  # invalid UTF-8 byte
        (b'{"a": "\xed\xa0\x80"}', None, "not UTF-8"),  # a surrogate encoded as UTF-8 bytes (CESU)
        ('{"a": 1}'.encode("utf-16"), None, "not UTF-8"),
        (b'{"a": ' + b"9" * 5000 + b"}", None, "invalid JSON"),  # over Python's 4300-digit int limit
        (b"[" * 65 + b"]" * 65, "[0]" * 64, "nested deeper"),  # MAX_JSON_DEPTH = 64
        (b"[" * 100000, None, "invalid JSON"),
        (b'{"a": ' + b'{"b": ' * 80 + b"1" + b"}" * 81, "a" + ".b" * 63, "nested deeper"),
    ]
    for raw, param, what in cases:
        status, res = post(server, "/", raw)
        assert status == 400 and what in res["error"], (raw[:60], status, res)
        assert param is None or res["error"].startswith(param + ":"), (raw[:60], res)
    # what is valid stays valid: a surrogate pair (an emoji), 64 levels, non-characters, NUL, a big float
    ok = [b'{"a": "\\ud83d\\ude00"}', b"[" * 64 + b"]" * 64, b'{"a": "\\uffff\\u0000"}', b'{"a": 1e308}',
          '{"a": "\U0001f600 caf\u00e9"}'.encode()]
    for raw in ok:
        assert post(server, "/", raw) == (200, {"echo": json.loads(raw)}), raw[:60]
    assert httpjson.check_json({"a": [{"b": "x"}]}) is None and httpjson.MAX_JSON_DEPTH == 64


def test_every_5xx_is_logged_with_its_traceback(server, capfd):
    status, res = post(server, "/boom", b"{}")
    assert status == 500 and "KeyError" in res["error"]
    status, res = post(server, "/escapes", b"{}")  # a fault that escapes do_POST: answered 500, not a dropped line
    assert status == 500 and "a fault that escapes do_POST" in res["error"]
    assert post(server, "/plain", b"{}")[0] == 503
    err = capfd.readouterr().err
    assert "httpjson: 500 POST /boom" in err and "Traceback" in err and "KeyError: 'no-such-key'" in err, err
    assert "httpjson: 500 POST /escapes" in err and "RuntimeError: a fault that escapes do_POST" in err, err
    assert 'httpjson: 503 POST /plain: "backend: not ready"\n' in err and err.count("Traceback") == 2, err
    assert server.status_5xx == {500: 2, 503: 1}
