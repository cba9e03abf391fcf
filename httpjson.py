"""The JSON-over-HTTP layer of the embedded engine (engine.py) and the token gateway (gateway.py): machinery, no
paper section. A ThreadingHTTPServer with a listen backlog for the rollout fan-out, and a quiet HTTP/1.1 handler
with strict body framing (Content-Length required, size-capped, read timeout), JSON replies and errors, and a
watcher that notices a client hanging up (so that its request is aborted, not decoded for nobody).

Run: not by itself; tests/test_engine.py and tests/test_gateway.py send it malformed and hostile requests.

Departure: the standard library's server, not SGLang's FastAPI + uvicorn (engine.py departure 7).
"""
import contextlib
import json
import re
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LISTEN_BACKLOG = 1024  # listen(2) queue: >= the paper's 560 trials launched per step, one request in flight each
MAX_BODY_BYTES = 8 * 2**20  # a 131k-token prompt is ~1 MB as JSON ids; a longer body is refused unread (413)
READ_TIMEOUT_S = 30.0  # one socket read (request line, a header, the body) waiting longer: 408 / connection closed
DISCONNECT_POLL_S = 1.0  # a disconnect watcher wakes at once on a hang-up; this only bounds its life after the reply


class HTTPError(ValueError):
    """A client error answered with `status`; the message starts with the field / header at fault."""

    def __init__(self, status, message, param=None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class BadRequest(HTTPError):
    def __init__(self, message, param=None, code=None):
        super().__init__(400, message, param, code)


class JSONServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog that holds the rollout fan-out (socketserver's default is 5)."""
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True


class JSONHandler(BaseHTTPRequestHandler):
    """Quiet HTTP/1.1 handler with JSON replies (the engine's and the gateway's servers): strict body framing,
    a read timeout, and a disconnect watcher."""
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # socketserver sets it on the connection: a silent client cannot hold a thread forever

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client hung up: nobody to answer
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (malformed request line, oversized headers, unknown method) as JSON too."""
        self.close_connection = True
        self.send_error_json(HTTPError(code, f"request: {message or 'refused'}"))

    def send_error_json(self, err: HTTPError):
        """Engine error shape {"error": "field: message"}; gateway.py answers in OpenAI's shape instead."""
        self._send(err.status, {"error": str(err)})

    def read_json(self):
        """The request body parsed as JSON, None when there is none (RFC 9112 6.3: a request without
        Content-Length has an empty body). HTTPError: chunked 411, bad Content-Length 400, over MAX_BODY_BYTES
        413, body shorter than announced 400 (closed) / 408 (stalled), not JSON 400. Any of these closes the
        connection afterwards (its framing is lost)."""
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
        try:
            data = self.rfile.read(n)
        except TimeoutError:
            raise fail(408, f"body: Content-Length is {n} but the body stalled for {self.timeout:g} s") from None
        if len(data) < n:
            raise fail(400, f"body: Content-Length is {n} but the client closed after {len(data)} bytes")
        if not data.strip():
            return None
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, > 4300-digit ints, deep nesting
            raise HTTPError(400, f"body: invalid JSON ({str(e)[:200]})") from None

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
