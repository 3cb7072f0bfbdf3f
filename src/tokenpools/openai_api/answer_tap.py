"""An engine's answer read as it passes through, in chunks of bytes however they were cut: the
usage it reports (a whole response's, or a stream's usage chunk), the content events it has
streamed so far (the output estimate when the engine never says), and when the first came.
A host that relays bytes without parsing them (ext_proc: Envoy hands over each chunk) feeds
every chunk in and sends on what `feed` returns: whole server-sent events only, without the
usage-only chunk the host asked for on the client's behalf. No HTTP library here."""

from __future__ import annotations

import time
from collections.abc import Callable

from tokenpools.model.request import Usage
from tokenpools.openai_api import CHAT, COMPLETIONS, RESPONSES
from tokenpools.openai_api.usage import (
    RESPONSE_END_TYPES,
    RESPONSE_ENDS,
    json_object,
    usage_from,
    usage_in,
)

# A whole answer's usage sits at its end: what is kept of it to find the counts (an embeddings
# answer can be megabytes of floats; its usage object is a few dozen bytes).
TAIL_BYTES = 64 * 1024


class AnswerTap:
    def __init__(
        self,
        path: str,
        stream: bool,
        client_wants_usage: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.stream, self.clock = path, stream, clock
        # the usage-only chunk of a chat or completions stream is kept from a client that did
        # not ask for it (the host asked on its behalf, so the stream settles on real counts)
        self.strip_usage = stream and not client_wants_usage and path in (CHAT, COMPLETIONS)
        self.usage: Usage | None = None
        self.streamed = 0  # content events seen
        self.first_token_at: float | None = None
        self.complete = False  # a stream's last event ([DONE], or a response's end) went by
        self._pending = b""  # a stream: the bytes of an event not yet whole
        self._tail = b""  # a whole answer: its last TAIL_BYTES

    def feed(self, chunk: bytes, end: bool = False) -> bytes:
        """Take the next chunk; returns the bytes to send on (`end`: the answer's last chunk,
        everything still held is sent)."""
        if not self.stream:
            if chunk and self.first_token_at is None:
                self.first_token_at = self.clock()
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]
            if end:
                self.usage = usage_in(self._tail)
            return chunk
        data = self._pending + chunk
        out: list[bytes] = []
        start = 0
        while True:
            cut = _event_end(data, start)
            if cut < 0:
                break
            event = data[start:cut]
            if self._read(event):
                out.append(event)
            start = cut
        self._pending = data[start:]
        if end and self._pending:
            if self._read(self._pending):
                out.append(self._pending)
            self._pending = b""
        return b"".join(out)

    def so_far(self, prompt_tokens: int) -> Usage:
        """The usage to settle on: the engine's, or the estimate from what was streamed."""
        return self.usage or Usage(prompt_tokens, self.streamed)

    def _read(self, event: bytes) -> bool:
        """Count what one event carries; False for the usage-only chunk kept from the client."""
        data = _data_of(event)
        if data == b"[DONE]":
            self.complete = True
        if data is None or data == b"[DONE]":
            return True
        if self.first_token_at is None:
            self.first_token_at = self.clock()
        if self.path == RESPONSES:  # typed events; the last one carries the response's usage
            if b'"response.output_text.delta"' in data:
                self.streamed += 1
            elif any(end in data for end in RESPONSE_ENDS):
                typed = json_object(data)
                if typed.get("type") in RESPONSE_END_TYPES:
                    self.usage = usage_from((typed.get("response") or {}).get("usage"))
                    self.complete = True
            return True
        chunk = json_object(data)
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = usage_from(chunk["usage"])
            return not self.strip_usage
        if chunk.get("choices"):
            self.streamed += 1
        return True


def split_events(data: bytes) -> tuple[list[bytes], bytes]:
    """The whole server-sent events at the start of `data`, and the bytes after them."""
    events, start = [], 0
    while (cut := _event_end(data, start)) >= 0:
        events.append(data[start:cut])
        start = cut
    return events, data[start:]


def event_data(event: bytes) -> bytes | None:
    """The data of one server-sent event (its `data:` lines joined); None: it has none."""
    return _data_of(event)


def _event_end(data: bytes, start: int) -> int:
    """Where the event that begins at `start` ends (after its blank line); -1: not yet whole."""
    ends = [i for i in (data.find(b"\n\n", start), data.find(b"\r\n\r\n", start)) if i >= 0]
    if not ends:
        return -1
    first = min(ends)
    return first + (4 if data.startswith(b"\r\n\r\n", first) else 2)


def _data_of(event: bytes) -> bytes | None:
    """The data of one server-sent event (its `data:` lines joined); None: it has none."""
    lines = [
        line.strip()[5:].strip() for line in event.splitlines() if line.strip().startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None
