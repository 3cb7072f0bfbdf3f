"""The events of a server-sent stream, as aiohttp reads them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp


async def events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[bytes, bytes]]:
    """Server-sent events: each one's bytes as received, and its data."""
    lines: list[bytes] = []
    data = b""
    async for line in content:
        lines.append(line)
        stripped = line.strip()
        if stripped.startswith(b"data:"):
            data = stripped[5:].strip()
        elif not stripped:
            if data:
                yield b"".join(lines), data
            lines, data = [], b""
    if data:
        yield b"".join(lines) + b"\n", data
