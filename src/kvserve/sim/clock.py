"""The simulation's time: a clock the event loop moves forward, handed to
the real scheduler and admission controller in place of `time.monotonic`."""

from __future__ import annotations


class VirtualClock:
    """The simulation's time in seconds; the event loop moves it forward.
    Called like `time.monotonic` by the scheduler and admission controller."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, t_s: float) -> None:
        if t_s < self.now_s:
            raise ValueError(f"virtual time cannot go back: {t_s} < {self.now_s}")
        self.now_s = t_s
