"""What a router knows about one backend, and the expected wait it derives.

A backend is seen the way a gateway in front of real servers sees it: the
numbers a vLLM-compatible `/metrics` exposes (running, waiting, KV usage,
the cache's size, kvserve's running cap) plus a drain rate measured from
the finished-request counter. The gateway fills these from scrapes, the
simulator from its replicas; both hand them to the same `Router` and the
same `expected_wait_s`, so the simulated fleet routes as the live one does.

Pure Python, clock injected (times are arguments), no HTTP.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from kvserve.admission.busy_rate import BusyRate

# Time constant of the measured drain (seconds of busy time), as the
# admission controller's default drain window.
DRAIN_WINDOW_S = 10.0


class BackendLoad(Protocol):
    """The router's view of one backend; None = not known (a backend that
    does not export it)."""

    @property
    def name(self) -> str: ...  # stable identity: the hash ring is built on it
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...  # fraction of KV blocks held by requests, 0..1
    @property
    def num_kv_blocks(self) -> int | None: ...
    @property
    def block_size(self) -> int | None: ...  # tokens per KV block
    @property
    def running_cap(self) -> int | None: ...  # most sequences it runs at once now
    @property
    def drain_rps(self) -> float | None: ...  # requests finished per busy second


class BackendState(NamedTuple):
    """A snapshot of a BackendLoad (traces, tests, a scrape)."""

    name: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks: int | None = None
    block_size: int | None = None
    running_cap: int | None = None
    drain_rps: float | None = None


def snapshot(backend: BackendLoad) -> BackendState:
    return BackendState(backend.name, backend.num_running, backend.num_waiting, backend.kv_usage,
                        backend.num_kv_blocks, backend.block_size, backend.running_cap, backend.drain_rps)


def blocks_needed(backend: BackendLoad, num_tokens: int) -> int | None:
    """KV blocks `num_tokens` (prompt + max_tokens) claim there; None when
    the backend does not say its block size."""
    block_size = backend.block_size
    if block_size is None or block_size < 1:
        return None
    return -(-max(0, num_tokens) // block_size)


def free_blocks(backend: BackendLoad) -> int | None:
    total = backend.num_kv_blocks
    if total is None:
        return None
    return max(0, math.floor(total * (1.0 - min(1.0, max(0.0, backend.kv_usage))) + 1e-9))


def expected_wait_s(backend: BackendLoad, num_tokens: int = 0) -> float:
    """Seconds until a new request of `num_tokens` (prompt + max_tokens)
    could start there: the requests ahead of it for a batch slot, and the
    KV blocks it lacks, each drained at the measured rate. Unknown drain:
    zero within one batch worth of queue, unbounded beyond (as the
    admission controller's cold start)."""
    return max(_slot_wait_s(backend), _kv_wait_s(backend, num_tokens, backend.drain_rps))


def kv_binds(backend: BackendLoad, num_tokens: int = 0) -> bool:
    """Whether the KV blocks it lacks, rather than a batch slot, are what
    the request would wait for there (the reason a refusal names)."""
    return _kv_wait_s(backend, num_tokens, backend.drain_rps) > _slot_wait_s(backend)


def _slot_wait_s(backend: BackendLoad) -> float:
    cap = backend.running_cap
    if cap is None:  # a queue at all means the batch is full
        ahead = backend.num_waiting + 1 if backend.num_waiting else 0
        allowance = max(1, backend.num_running)
    else:
        ahead = backend.num_running + backend.num_waiting + 1 - cap
        allowance = max(1, cap)
    return _drain_time_s(ahead, backend.drain_rps, allowance)


def _kv_wait_s(backend: BackendLoad, num_tokens: int, rate_rps: float | None) -> float:
    """The blocks it lacks, drained as finishing requests free theirs (the
    running requests' mean holding)."""
    need, free = blocks_needed(backend, num_tokens), free_blocks(backend)
    total = backend.num_kv_blocks
    if need is None or free is None or total is None or need <= free:
        return 0.0
    if need > total:
        return math.inf
    used = total - free
    per_request = used / max(1, backend.num_running + backend.num_waiting)
    requests = math.ceil((need - free) / per_request) if per_request > 0 else 1
    return _drain_time_s(requests, rate_rps, max(1, backend.num_running))


def _drain_time_s(ahead: int, rate_rps: float | None, cold_allowance: int) -> float:
    if ahead <= 0:
        return 0.0
    if rate_rps is None:
        return 0.0 if ahead <= cold_allowance else math.inf
    return ahead / rate_rps if rate_rps > 0 else math.inf


class DrainMeter:
    """Requests finished per busy second, from a cumulative finished count
    sampled now and then: a gateway's scrape of `vllm:request_success_total`,
    or the simulator at each finish. Idle time does not decay it (BusyRate),
    so a quiet minute does not make the next burst look unservable."""

    def __init__(self, window_s: float = DRAIN_WINDOW_S) -> None:
        self._rate = BusyRate(window_s)
        self._total: float | None = None

    def observe(self, now_s: float, finished_total: float, busy: bool) -> None:
        """The count at `now_s`; `busy`: requests are in the backend now (the
        interval until the next observation counts as busy time)."""
        self._rate.advance(now_s, busy)
        if self._total is not None and finished_total > self._total:
            self._rate.add(finished_total - self._total)
        self._total = finished_total  # a smaller count is a restarted backend: count from it

    def rate_rps(self, now_s: float) -> float | None:
        return self._rate.rate(now_s)
