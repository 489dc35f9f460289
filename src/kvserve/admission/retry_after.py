"""Retry-After a client can follow: each refused request gets its own time
to come back, and refused requests are staggered so they do not all return
in the same instant.

One Retry-After for a whole burst brings the burst back at once: a few get
in, the rest are refused again, and the server idles between the waves.
Instead each refusal takes the next free return slot: no earlier than its
own expected wait allows (`earliest_s`), and at least `spacing_s` after the
slot handed out before it, where the spacing is the time the measured drain
frees one request's worth of room. The slots are deterministic (no random
jitter): a burst of N refusals is told 1..N spacings, rounded up to whole
seconds (`Retry-After` is an integer), so about one spacing's worth of
clients comes back per slot.

Slots are moments in time, not reservations: a client that never comes back
holds nothing once its moment has passed.

Pure Python, clock injected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

from kvserve.admission.decision import whole_seconds

# No client is told to wait longer than this (a burst of thousands would
# otherwise be sent minutes away; by then the estimate means nothing).
MAX_RETRY_AFTER_S: Final = 60
# A request refused for its expected wait is told to come back when that
# wait would be this share of its class's limit: at exactly the limit it
# would be refused again about half the time.
RETURN_AT_LIMIT_SHARE: Final = 0.5


def earliest_return_s(wait_s: float, limit_s: float) -> float:
    """How soon a request refused for an expected wait of `wait_s` over its
    limit `limit_s` could come back and be admitted. Unbounded means nothing
    is measured yet: it will be within seconds."""
    return wait_s - RETURN_AT_LIMIT_SHARE * max(0.0, limit_s) if math.isfinite(wait_s) else 1.0


class ReturnSlots:
    """The times refused requests were told to come back (see the module
    docstring)."""

    def __init__(self, clock: Callable[[], float], max_retry_after_s: int = MAX_RETRY_AFTER_S) -> None:
        self.clock = clock
        self.max_retry_after_s = max_retry_after_s
        self._next_free_at = -math.inf  # the earliest moment no earlier refusal was sent back to

    def take(self, earliest_s: float, spacing_s: float) -> int:
        """Retry-After (whole seconds, 1 .. max) for a request refused now
        that could not get in for `earliest_s` seconds; the slot after it
        is `spacing_s` later."""
        now = self.clock()
        earliest_s = min(earliest_s, float(self.max_retry_after_s)) if math.isfinite(earliest_s) else 1.0
        at = min(max(now + max(0.0, earliest_s), self._next_free_at), now + self.max_retry_after_s)
        spacing_s = spacing_s if math.isfinite(spacing_s) and spacing_s > 0 else 0.0
        self._next_free_at = at + spacing_s
        return min(self.max_retry_after_s, whole_seconds(at - now))
