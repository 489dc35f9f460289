"""Start-to-ready, broken down: the seconds each phase of a cold start (or
a wake) took, for the log and the `kvserve_startup_seconds{phase}` gauge.

Phases of a cold start, in order: `imports` (torch and the engine's
modules), `weight_load` (read and convert the weights), `kv_allocation`
(the engine built: the KV cache tensor allocated), `warm_up` (timed engine
steps before /ready; on CUDA the decode graphs of the batch sizes it runs
are captured within it). A wake from sleep records `wake_up` the same way.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

COLD_START_PHASES = ("imports", "weight_load", "kv_allocation", "warm_up")


class StartupPhases:
    """Seconds per named phase, measured with perf_counter."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, time.perf_counter() - start)

    def record(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @property
    def total_s(self) -> float:
        return sum(s for name, s in self.seconds.items() if name in COLD_START_PHASES)

    def summary(self) -> str:
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.seconds.items())
        return f"{self.total_s:.2f} s ({parts})"
