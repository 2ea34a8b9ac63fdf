"""HTTP/1.1 messages in one direction of a connection's plaintext: heads, bodies and framing."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HttpMessage:
    """One request or response: its span in the plaintext stream, its head and its body.

    ``framing`` counts the bytes HTTP adds besides the head (chunk sizes and their line ends).
    """

    start: int
    end: int
    first_line: str
    headers: dict[str, str] = field(default_factory=dict)
    raw_headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    framing: int = 0

    @property
    def http_bytes(self) -> int:
        """What HTTP itself put on the wire for this message: head and framing."""
        return (self.end - self.start) - len(self.body)

    def header_bytes(self, prefix: str) -> int:
        """Bytes of the head lines whose name starts with ``prefix`` (line ends included)."""
        return sum(len(name) + 2 + len(value) + 2 for name, value in self.raw_headers
                   if name.lower().startswith(prefix))

    @property
    def path(self) -> str:
        """A request's path (empty for a response)."""
        parts = self.first_line.split()
        return parts[1] if len(parts) >= 2 and not self.first_line.startswith("HTTP/") else ""

    @property
    def status(self) -> int:
        """A response's status code (0 for a request)."""
        parts = self.first_line.split()
        if self.first_line.startswith("HTTP/") and len(parts) >= 2 and parts[1].isdigit():
            return int(parts[1])
        return 0


def parse_messages(plain: bytes, responses: bool) -> tuple[list[HttpMessage], int]:
    """The HTTP/1.1 messages of ``plain`` and the bytes after the last complete one.

    A response with neither ``content-length`` nor chunked encoding runs to the end of the
    stream (the server closes the connection); a request without them has no body.
    """
    out: list[HttpMessage] = []
    pos = 0
    while pos < len(plain):
        head_end = plain.find(b"\r\n\r\n", pos)
        if head_end < 0:
            break
        head = plain[pos:head_end].decode("latin-1").split("\r\n")
        headers, raw = {}, []
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
            raw.append((name, value))
        body_start = head_end + 4
        msg = HttpMessage(pos, body_start, head[0], headers, raw)
        if "content-length" in headers:
            end = body_start + int(headers["content-length"])
            if end > len(plain):
                break
            msg.body, msg.end = plain[body_start:end], end
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            parsed = _chunked(plain, body_start)
            if parsed is None:
                break
            msg.body, msg.end, msg.framing = parsed
        elif responses and not (100 <= msg.status < 200 or msg.status in (204, 304)):
            msg.body, msg.end = plain[body_start:], len(plain)
        out.append(msg)
        pos = msg.end
    return out, len(plain) - pos


def _chunked(plain: bytes, pos: int) -> tuple[bytes, int, int] | None:
    body = bytearray()
    framing = 0
    while True:
        line_end = plain.find(b"\r\n", pos)
        if line_end < 0:
            return None
        size = int(plain[pos:line_end].split(b";")[0].strip() or b"0", 16)
        framing += line_end + 2 - pos
        pos = line_end + 2
        if size == 0:
            trailer_end = plain.find(b"\r\n", pos)
            if trailer_end < 0:
                return None
            framing += trailer_end + 2 - pos
            return bytes(body), trailer_end + 2, framing
        if pos + size + 2 > len(plain):
            return None
        body += plain[pos:pos + size]
        framing += 2
        pos += size + 2
