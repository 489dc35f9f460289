"""Amount per second over busy time: the drain rates admission measures
(KV blocks and requests released) and the rate of admissions the retry
budget earns from.

Pure Python; time comes from the caller.
"""

from __future__ import annotations

import math
from typing import Final

# A rate measured over less busy time than this is noise.
MIN_MEASURED_BUSY_S: Final = 0.05


class BusyRate:
    """Amount per second, an exponentially weighted average over busy time.

    Time only counts while the system is busy, so an idle minute does not
    decay the estimate to zero and make the next burst look unservable.
    """

    def __init__(self, tau_s: float) -> None:
        self.tau_s = tau_s
        self._sum = 0.0
        self._busy_s = 0.0
        self._last: float | None = None
        self._busy = False
        self._seen = False

    def advance(self, now: float, busy: bool) -> None:
        """Move to `now`; `busy` says whether the coming interval is busy."""
        if self._last is not None and self._busy:
            dt = max(0.0, now - self._last)
            self._sum *= math.exp(-dt / self.tau_s)
            self._busy_s += dt
        self._last = now
        self._busy = busy

    def add(self, amount: float) -> None:
        self._sum += amount
        self._seen = True

    def rate(self, now: float) -> float | None:
        """Per-second rate, or None before anything was measured."""
        if not self._seen or self._last is None:
            return None
        dt = max(0.0, now - self._last) if self._busy else 0.0
        busy_s = self._busy_s + dt
        if busy_s < MIN_MEASURED_BUSY_S:
            return None
        total = self._sum * math.exp(-dt / self.tau_s)
        # Bias correction: early on the window is shorter than tau.
        return total / (self.tau_s * (1.0 - math.exp(-busy_s / self.tau_s)))
