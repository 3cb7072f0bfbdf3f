"""A config file, followed: a changed file is loaded and adopted; an invalid one is logged and
the running config kept. `tokenpools serve` and the LiteLLM integration both follow theirs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from tokenpools.model.config import Config, ConfigError, load_config

log = logging.getLogger("tokenpools.admission")


class Reloadable(Protocol):
    async def reload(self, config: Config) -> object: ...


async def reload_from(host: Reloadable, path: Path) -> bool:
    """Load and adopt `path`; an invalid file is logged and the running config kept."""
    try:
        await host.reload(load_config(path))
    except ConfigError as exc:
        log.error("config reload rejected, keeping the running config: %s", exc)
        return False
    log.info("config reloaded from %s", path)
    return True


class ConfigFile:
    """The file, and the version of it last adopted (by modification time)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen = path.stat().st_mtime_ns

    def changed(self) -> bool:
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:  # being replaced: read it next time
            return False
        if mtime == self._seen:
            return False
        self._seen = mtime
        return True

    async def follow(self, host: Reloadable, interval_s: float) -> None:
        """Every `interval_s`, adopt the file if it changed; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if self.changed():
                    await reload_from(host, self.path)
            except Exception:
                log.exception("reading the config failed; keeping the running config")
