"""The event loop a server process runs on: uvloop where it is installed (a dependency on
Linux; ~30 % less CPU per request for the gateway), else asyncio's own."""

from __future__ import annotations

import asyncio


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
