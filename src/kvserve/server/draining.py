"""`DrainingServer`: uvicorn's server with a graceful first SIGTERM, for any
app whose owner has `drain(grace_s)` and `config.shutdown_grace_s`: `kvserve
serve`'s Serving and `kvserve gateway`'s Gateway. Imports no engine."""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("kvserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM / SIGINT drains:
    stop admitting (503, /ready false), give in-flight requests the grace
    period, abort the rest, then exit. A second signal exits at once."""

    def __init__(self, config, serving) -> None:
        # serving: anything with async drain(grace_s) and config.shutdown_grace_s
        super().__init__(config)
        self.serving = serving
        self._drain_task = None

    def handle_exit(self, sig, frame) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after
        # exiting, and the default SIGTERM handler would make the exit code -15.
        if self._drain_task is not None:
            self.force_exit = True
            self.should_exit = True
            return
        self._drain_task = "starting"
        # Signal handlers run between bytecodes of the loop's thread; schedule
        # thread-safely so the selector wakes up.
        asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        log.info("shutting down: draining in-flight requests (grace %.1f s)", self.serving.config.shutdown_grace_s)
        try:
            await self.serving.drain(self.serving.config.shutdown_grace_s)
        finally:
            self.should_exit = True
