"""The terminal's text, shared by the local jail and Daytona: tmux key names, ANSI cleanup, the output cap."""
import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Z0-9]|\x1b[=>]")
KEYS = {"Enter": "\n", "Tab": "\t", "Escape": "\x1b", "Up": "\x1b[A", "Down": "\x1b[B", "Right": "\x1b[C",
        "Left": "\x1b[D", "BSpace": "\x7f"}  # tmux key names Terminus-2 agents use


class Capped:
    """Byte collector that keeps the first and last cap/2 bytes and counts what it dropped."""

    def __init__(self, cap):
        self.half, self.head, self.tail, self.dropped = max(cap // 2, 1), bytearray(), bytearray(), 0

    def add(self, data):
        room = max(self.half - len(self.head), 0)
        self.head, self.tail = self.head + data[:room], self.tail + data[room:]
        if len(self.tail) > self.half:
            self.dropped += len(self.tail) - self.half
            del self.tail[:len(self.tail) - self.half]

    def text(self):
        mid = f"\n[... output truncated: {self.dropped} bytes omitted ...]\n".encode() if self.dropped else b""
        return clean(bytes(self.head + mid + self.tail))


def clean(data: bytes) -> str:
    """Terminal bytes -> text: utf-8, ANSI escapes and carriage returns removed."""
    return _ANSI.sub("", data.decode("utf-8", errors="replace")).replace("\r", "")
