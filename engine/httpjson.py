"""The JSON-over-HTTP layer of the embedded engine (engine/server.py) and the token gateway (engine/gateway.py):
machinery, no paper section. An HTTP/1.1 server whose threads serve only complete requests: a waiting room (one thread,
a selector) holds every connection while its request arrives, with a total deadline on reading it and a cap on open
connections; a quiet handler with strict body framing (Content-Length required, size-capped), strict JSON (UTF-8,
no lone surrogates, bounded nesting), JSON replies and errors, every 5xx logged on stderr (one sent while handling
an exception with its traceback), and a watcher that notices a client hanging up (so that its request is aborted,
not decoded for nobody).

The phases of a connection and their bounds (paper silent; the constants below):
  waiting, no request begun (new, or kept alive after a reply): no thread; closed after IDLE_TIMEOUT_S.
  reading a request (line, headers, body): no thread; all of it within READ_TIMEOUT_S of its first byte (a total,
    so a client sending a byte every few seconds is cut off: 408), the head within MAX_HEAD_BYTES (431).
  serving it: a thread, no deadline here (a long /generate takes as long as it takes; the client's own timeout or
    its hang-up ends it), then the reply is written within WRITE_TIMEOUT_S.
  over MAX_CONNECTIONS open connections: a new one gets 503 at once and is closed (one stderr line a second says so).

Run: not by itself; tests/test_http_limits.py, tests/test_engine.py and tests/test_gateway.py send it malformed,
slow and hostile requests.

Departure: the standard library's server, not SGLang's FastAPI + uvicorn (engine/server.py says why).
"""
import collections
import contextlib
import http.client
import io
import json
import re
import resource
import select
import selectors
import socket
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer

LISTEN_BACKLOG = 1024  # listen(2) queue: >= the paper's 560 trials launched per step, one request in flight each
MAX_CONNECTIONS = 1024  # open connections at once, waiting or served (paper silent; >= the 560 trials' requests with
# keep-alive slack); over it a new connection is answered 503 and closed. Clamped below RLIMIT_NOFILE.
FD_RESERVE = 64  # file descriptors kept free of connections (the engine's own files, checkpoints, pipes)
MAX_BODY_BYTES = 8 * 2**20  # a 131k-token prompt is ~1 MB as JSON ids; a longer body is refused unread (413)
MAX_HEAD_BYTES = 64 * 2**10  # request line + headers (paper silent; ours are < 1 KB): over it 431
READ_TIMEOUT_S = 30.0  # the whole request (line, headers, body) within this of its first byte, else 408 and closed
# (paper silent; a total, not per read: 8 MB at >= 0.3 MB/s); a handler class may lower its `timeout` (tests do)
IDLE_TIMEOUT_S = 15.0  # a connection with no request begun (new, or kept alive) is closed after this (paper silent;
# uvicorn's keep-alive is 5 s); it holds a file descriptor meanwhile, never a thread
WRITE_TIMEOUT_S = 60.0  # each write of a reply, head and body (paper silent): a client not taking it loses it
MAX_JSON_DEPTH = 64  # nesting of a request body (paper silent; the deepest field served is 5 levels): over it 400
DISCONNECT_POLL_S = 1.0  # a disconnect watcher wakes at once on a hang-up; this only bounds its life after the reply
SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads leaves of an unpaired \\ud800-\\udfff escape


class HTTPError(ValueError):
    """A client error answered with `status`; the message starts with the field / header at fault."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class BadRequest(HTTPError):
    def __init__(self, message, param=None, code=None):
        super().__init__(400, message, param, code)


def check_json(obj, max_depth=MAX_JSON_DEPTH):
    """BadRequest naming the first string (a value or a key) that holds a lone surrogate (not Unicode text: the
    tokenizer and the file system cannot encode it), or the first container nested deeper than max_depth. The path is
    OpenAI's param style (messages[0].content; "body" for the whole)."""
    def path(node):
        parts = []
        while node is not None:
            node, key = node
            name = key if isinstance(key, int) or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,63}", key) else None
            parts.append(f"[{key}]" if isinstance(key, int) else f".{key}" if name else f"[{json.dumps(key)[:40]}]")
        return "".join(reversed(parts)).lstrip(".") or "body"

    def bad_string(s, node, what="not valid Unicode text"):
        m = SURROGATE.search(s)
        if m:
            where = path(node)
            return BadRequest(f"{where}: {what} (a lone surrogate U+{ord(m.group()):04X} at character {m.start()})",
                              where)
    stack = [(obj, 1, None)]
    while stack:
        o, depth, node = stack.pop()
        if isinstance(o, str):
            err = bad_string(o, node)
            if err:
                raise err
        elif isinstance(o, (dict, list)):
            if depth > max_depth:
                where = path(node)
                raise BadRequest(f"{where}: nested deeper than {max_depth} levels", where)
            for k, v in (o.items() if isinstance(o, dict) else enumerate(o)):
                if isinstance(k, str):
                    err = bad_string(k, node, "a key is not valid Unicode text")
                    if err:
                        raise err
                stack.append((v, depth + 1, (node, k)))


def _framing(buf: bytes):
    """How much of `buf` the request at its start takes: None (more to come), or (n, expect_100) once it is complete
    enough for a handler: n bytes (head + Content-Length body) or the head alone where the framing is to be refused
    (chunked, a bad or oversized Content-Length, unparsable headers: the handler names the fault)."""
    m = re.search(rb"\r?\n\r?\n", buf)
    if m is None:
        return None
    head_end = m.end()
    try:
        line_end = buf.index(b"\n") + 1
        if line_end >= head_end:  # no headers
            return head_end, False
        headers = http.client.parse_headers(io.BytesIO(buf[line_end:head_end]))
    except Exception:  # too many / too long headers ...: http.server refuses it with its own status
        return head_end, False
    values = headers.get_all("Content-Length") or []
    if headers.get("Transfer-Encoding") or len(set(v.strip() for v in values)) != 1:
        return head_end, False
    v = values[0].strip()
    if not re.fullmatch(r"[0-9]{1,12}", v) or int(v) > MAX_BODY_BYTES:
        return head_end, False
    expect = (headers.get("Expect") or "").strip().lower() == "100-continue"
    return head_end + int(v), expect


class _Waiting:
    __slots__ = ("addr", "buf", "since", "first_byte", "continued")

    def __init__(self, addr, buf, now):
        self.addr, self.buf, self.since, self.continued = addr, buf, now, False
        self.first_byte = now if buf else None


class _WaitingRoom:
    """One thread holding every connection whose request has not fully arrived (selectors, non-blocking): it reads
    the bytes, applies IDLE_TIMEOUT_S / READ_TIMEOUT_S / MAX_HEAD_BYTES, and hands a complete request to a thread."""

    def __init__(self, server):
        self.server, self.sel = server, selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()
        for s in (self.wake_r, self.wake_w):
            s.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.new, self.conns, self.stopped = collections.deque(), {}, False
        self.thread = threading.Thread(target=self.run, daemon=True, name="httpjson-waiting-room")
        self.thread.start()

    def add(self, sock, addr, buf=b""):
        self.new.append((sock, addr, buf))
        with contextlib.suppress(OSError):
            self.wake_w.send(b"\0")

    def stop(self):
        self.stopped = True
        with contextlib.suppress(OSError):
            self.wake_w.send(b"\0")
        self.thread.join(timeout=10)
        for sock in list(self.conns) + [s for s, _, _ in self.new]:
            self.server.close_connection(sock)
        self.conns.clear()
        self.sel.close()
        self.wake_r.close()
        self.wake_w.close()

    def run(self):
        while not self.stopped:
            try:
                self.step()
            except Exception:  # a fault here would stop every connection: logged, and the room goes on
                print(f"httpjson: waiting room:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
                time.sleep(0.01)

    def step(self):
        """One turn: wait for bytes or the nearest deadline, take in new connections, expire the late."""
        now = time.monotonic()
        nearest = min((self.deadline(c) for c in self.conns.values()), default=now + 1.0)
        for key, _ in self.sel.select(max(0.0, min(1.0, nearest - now))):
            if key.fileobj is self.wake_r:
                with contextlib.suppress(OSError):
                    self.wake_r.recv(4096)
            elif key.fileobj in self.conns:
                self.read(key.fileobj)
        now = time.monotonic()
        while self.new:
            sock, addr, buf = self.new.popleft()
            try:
                sock.setblocking(False)
                self.sel.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError):
                self.server.close_connection(sock)
                continue
            self.conns[sock] = _Waiting(addr, buf, now)
            self.check(sock)
        for sock, c in list(self.conns.items()):
            if now >= self.deadline(c):
                self.expire(sock, c)

    def read_timeout(self):
        return self.server.RequestHandlerClass.timeout or READ_TIMEOUT_S

    def deadline(self, c):
        if c.first_byte is None:
            return c.since + IDLE_TIMEOUT_S
        return c.first_byte + self.read_timeout()

    def drop(self, sock):
        del self.conns[sock]
        with contextlib.suppress(KeyError, ValueError, OSError):
            self.sel.unregister(sock)

    def read(self, sock):
        c = self.conns[sock]
        eof = False
        for _ in range(16):  # at most 1 MB per wake-up: one fast client does not starve the others
            try:
                data = sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset
                data = b""
            if not data:
                eof = True
                break
            c.buf += data
            if c.first_byte is None:
                c.first_byte = time.monotonic()
            if len(data) < 65536:
                break
        if not self.check(sock) and eof:
            self.drop(sock)  # the client hung up mid-request: a handler answers a complete head (body short: 400)
            if _framing(c.buf) is not None:
                self.server.dispatch(sock, c.addr, c.buf)
            else:
                self.server.close_connection(sock)

    def check(self, sock) -> bool:
        """Hand the connection to a thread if its request is complete (True), refuse an oversized head."""
        c = self.conns[sock]
        f = _framing(c.buf)
        if f is None:
            if len(c.buf) > MAX_HEAD_BYTES:
                self.drop(sock)
                self.server.refuse(sock, HTTPError(431, f"request: the request line and headers are over "
                                                        f"{MAX_HEAD_BYTES} bytes"))
                return True
            return False
        n, expect = f
        if len(c.buf) < n:
            if expect and not c.continued:
                c.continued = True
                with contextlib.suppress(OSError):
                    sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            return False
        self.drop(sock)
        self.server.dispatch(sock, c.addr, c.buf)
        return True

    def expire(self, sock, c):
        self.drop(sock)
        if c.first_byte is None:  # idle: closed without a word, as keep-alive servers do
            self.server.close_connection(sock)
            return
        t = self.read_timeout()
        m = re.search(rb"\r?\n\r?\n", c.buf)
        if m is None:
            msg = f"request: the request line and headers did not arrive within {t:g} s"
        else:
            msg = (f"body: {len(c.buf) - m.end()} bytes of the body arrived within {t:g} s (the whole request must "
                   f"arrive within {t:g} s of its first byte)")
        self.server.refuse(sock, HTTPError(408, msg))


class JSONServer(HTTPServer):
    """HTTP/1.1 server: a listen backlog that holds the rollout fan-out, a waiting room for requests still arriving,
    one thread per complete request, at most max_connections open connections. Counts: `refused` (over the cap),
    `status_5xx` (status -> replies sent)."""
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address, handler_class, max_connections=MAX_CONNECTIONS):
        super().__init__(address, handler_class)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            max_connections = min(max_connections, max(1, soft - FD_RESERVE))
        self.max_connections, self.open, self.refused = max_connections, 0, 0
        self.status_5xx = collections.Counter()
        self.lock, self.last_refusal_log = threading.Lock(), 0.0
        self.room = _WaitingRoom(self)

    def process_request(self, request, client_address):
        """After accept(): into the waiting room, or refused at once over max_connections."""
        with self.lock:
            full = self.open >= self.max_connections
            if full:
                self.refused += 1
            else:
                self.open += 1
        if not full:
            return self.room.add(request, client_address)
        now = time.monotonic()
        if now - self.last_refusal_log >= 1.0:
            self.last_refusal_log = now
            print(f"httpjson: {self.server_address[:2]}: refusing connections: {self.open} open, the cap is "
                  f"max_connections = {self.max_connections} ({self.refused} refused so far)", file=sys.stderr,
                  flush=True)
        err = HTTPError(503, f"server: {self.max_connections} connections are open (max_connections); retry later",
                        code="server_busy")
        self.refuse(request, err, counted=False)

    def refuse(self, sock, err: HTTPError, counted=True):
        """A canned error reply, sent without blocking (it fits any socket buffer), then the connection closed."""
        data = json.dumps(self.RequestHandlerClass.error_body(err)).encode()
        head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n"
                + ("Retry-After: 1\r\n" if err.status == 503 else "") + "\r\n").encode()
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.recv(65536)  # what the client already sent: unread bytes would turn our close into a reset
            sock.send(head + data)
        if counted:
            self.close_connection(sock)
        else:
            self.shutdown_request(sock)

    def close_connection(self, sock):
        with self.lock:
            self.open -= 1
        self.shutdown_request(sock)

    def dispatch(self, sock, addr, buf):
        try:
            threading.Thread(target=self.serve_one, args=(sock, addr, buf), daemon=True,
                             name="httpjson-request").start()
        except RuntimeError as e:  # no thread to be had: refused, never dropped
            self.refuse(sock, HTTPError(503, f"server: cannot start a thread ({e}); retry later", code="server_busy"))

    def serve_one(self, sock, addr, buf):
        """One request (buf holds it) on its own thread; a kept-alive connection goes back to the waiting room."""
        keep = False
        try:
            sock.setblocking(True)
            sock.settimeout(WRITE_TIMEOUT_S)
            h = self.RequestHandlerClass(sock, addr, self, buf)
            keep = not h.close_connection and not self.room.stopped
        except Exception:
            self.handle_error(sock, addr)  # socketserver's: the traceback on stderr
        if keep:
            self.room.add(sock, addr, h.leftover)
        else:
            self.close_connection(sock)

    def server_close(self):
        super().server_close()
        self.room.stop()


class _Writer(io.BufferedIOBase):
    """The reply side of a connection: every write is one sendall (bounded by the socket's WRITE_TIMEOUT_S)."""

    def __init__(self, sock):
        self.sock = sock

    def writable(self):
        return True

    def write(self, b):
        self.sock.sendall(b)
        return len(b)


class JSONHandler(BaseHTTPRequestHandler):
    """Quiet HTTP/1.1 handler with JSON replies (the engine's and the gateway's servers), serving one complete
    request that JSONServer's waiting room read: strict body framing and JSON, 5xx logged, a disconnect watcher."""
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # the waiting room's deadline for a whole request (a total from its first byte)

    def __init__(self, request, client_address, server, data=b""):
        self.data, self.leftover, self.replied = data, b"", False
        super().__init__(request, client_address, server)

    def setup(self):
        self.connection = self.request
        self.rfile, self.wfile = io.BytesIO(self.data), _Writer(self.connection)

    def handle(self):
        """One request; a fault that escapes do_* is logged with its traceback and answered 500 if nothing was sent."""
        self.close_connection = True
        try:
            self.handle_one_request()
        except Exception as e:
            self.close_connection = True
            if not self.replied:
                self._send(500, self.error_body(HTTPError(500, f"server: {type(e).__name__}: {e}")))
            else:
                self.log_5xx(500, f"a fault after the reply began: {type(e).__name__}: {e}")

    def finish(self):
        self.leftover = b"" if self.close_connection else self.rfile.read()  # a pipelined next request

    def handle_expect_100(self):
        return True  # the waiting room sent 100 Continue (or the body had already come)

    def log_message(self, *args):  # quiet
        pass

    def send_response(self, code, message=None):
        self.replied = True
        super().send_response(code, message)

    def log_5xx(self, code, what):
        """Every 5xx on stderr: status, method, path, the error, and the traceback of the exception being handled
        (a 5xx sent from an except block: a fault); counted in server.status_5xx. A subclass may add context."""
        if hasattr(self.server, "status_5xx"):
            self.server.status_5xx[code] += 1
        exc = sys.exc_info()[1]
        tb = "".join(traceback.format_exception(exc)) if exc is not None else ""
        print(f"httpjson: {code} {getattr(self, 'command', '')} {str(getattr(self, 'path', ''))[:200]}: "
              f"{str(what)[:1000]}\n{tb}", end="" if tb else "\n", file=sys.stderr, flush=True)

    def _send(self, code, obj):
        if code >= 500:
            self.log_5xx(code, json.dumps(obj.get("error", obj) if isinstance(obj, dict) else obj))
        data = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client hung up or did not take the reply within WRITE_TIMEOUT_S: nobody to answer
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (malformed request line, oversized headers, unknown method) as JSON too."""
        self.close_connection = True
        self.send_error_json(HTTPError(code, f"request: {message or 'refused'}"))

    @classmethod
    def error_body(cls, err: HTTPError) -> dict:
        """Engine error shape {"error": "field: message"}; engine/gateway.py answers in OpenAI's shape instead."""
        return {"error": str(err)}

    def send_error_json(self, err: HTTPError):
        self._send(err.status, self.error_body(err))

    def read_json(self):
        """The request body parsed as JSON, None when there is none (RFC 9112 6.3: a request without
        Content-Length has an empty body). HTTPError: chunked 411, bad Content-Length 400, over MAX_BODY_BYTES
        413, body shorter than announced 400 (the client closed; a stalled one is the waiting room's 408), not UTF-8
        or not JSON 400, a lone surrogate or nesting over MAX_JSON_DEPTH 400 naming the field (check_json). The
        framing errors close the connection afterwards (its framing is lost)."""
        def fail(status, message):
            self.close_connection = True
            return HTTPError(status, message)
        if self.headers.get("Transfer-Encoding"):
            raise fail(411, "Content-Length: required (a Transfer-Encoding body is not accepted)")
        values = [v.strip() for v in self.headers.get_all("Content-Length") or []]
        if not values:
            return None
        if len(set(values)) > 1 or not re.fullmatch(r"[0-9]+", values[0]):
            raise fail(400, f"Content-Length: expected one non-negative integer, got {', '.join(values)[:100]!r}")
        if len(values[0]) > 12 or int(values[0]) > MAX_BODY_BYTES:
            raise fail(413, f"Content-Length: {values[0][:20]} bytes is over the limit of {MAX_BODY_BYTES}")
        n = int(values[0])
        data = self.rfile.read(n)
        if len(data) < n:
            raise fail(400, f"body: Content-Length is {n} but the client closed after {len(data)} bytes")
        if not data.strip():
            return None
        try:
            text = data.decode("utf-8")  # RFC 8259 8.1: JSON between systems is UTF-8
        except UnicodeDecodeError as e:
            raise HTTPError(400, f"body: not UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, > 4300-digit ints, deep nesting
            raise HTTPError(400, f"body: invalid JSON ({str(e)[:200]})") from None
        if "\\u" in text or text.count("[") + text.count("{") > MAX_JSON_DEPTH:  # else neither can be there
            check_json(obj)
        return obj

    @contextlib.contextmanager
    def on_disconnect(self, callback):
        """While the block runs, watch the client's socket; call callback() (once) if the client hangs up.
        A hang-up is end-of-file (or a reset) on the socket; bytes from the client mean it is still there."""
        done, lock, sock = threading.Event(), threading.Lock(), self.connection

        def watch():
            poller = select.poll()
            poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
            while not done.is_set():
                if not poller.poll(DISCONNECT_POLL_S * 1000):
                    continue
                try:
                    gone = not sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    gone = True
                with lock:
                    if gone and not done.is_set():
                        callback()
                return
        threading.Thread(target=watch, daemon=True, name="disconnect-watch").start()
        try:
            yield
        finally:
            with lock:
                done.set()
