"""Backends as the gateway sees them: a live view per backend built from
scrapes of its `/metrics` (vLLM's names) and `/ready`, the requests the
gateway has in flight there, and a circuit breaker that ejects it when it
fails.

A view is a `fleet.backend_state.BackendLoad`, so the router reads it
directly. Between scrapes it counts what the gateway sent since the last
one as running (and their projected KV as used), so a burst routed within
one scrape interval still spreads. Pure Python, clock injected; the HTTP
of scraping lives in `gateway.scrape`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.fleet.backend_state import DrainMeter, blocks_needed
from kvserve.gateway.config import BackendConfig, BreakerConfig

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)
# Weight of one scrape interval's prefix hit rate in the backend's running one.
PREFIX_HIT_WEIGHT = 0.3


class CircuitBreaker:
    """closed -> open after N consecutive failures -> half-open once the
    cool-down has passed (one probe: the next scrape) -> closed on its
    success, open again on its failure. Only a closed backend gets traffic."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self.num_ejections = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self._opened_at >= self.config.cool_down_s:
            self._state = HALF_OPEN
        return self._state

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    def record_success(self) -> None:
        if self.state == OPEN:
            return  # a late answer from before the ejection proves nothing; wait for the probe
        self._state, self._failures = CLOSED, 0

    def record_failure(self) -> None:
        state = self.state
        self._failures += 1
        if state == HALF_OPEN or (state == CLOSED and self._failures >= self.config.failures):
            if state == CLOSED:
                self.num_ejections += 1
            self._state, self._opened_at = OPEN, self.clock()


@dataclass(frozen=True)
class Scrape:
    """One backend's `/metrics`, as numbers (None: not exported)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    finished_total: float
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    running_cap: int | None = None
    num_kv_blocks: int | None = None
    block_size: int | None = None
    queue_time_sum_s: float | None = None
    queue_time_count: float | None = None


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> Scrape:
    """Prometheus text from a kvserve or vLLM server -> Scrape. Values of
    one name are summed over its label sets (all models of the server).
    ValueError when it lacks the gauges every such server exports."""
    sums: dict[str, float] = {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, raw = match.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        sums[name] = sums.get(name, 0.0) + value
        if name == "vllm:cache_config_info" and labels:
            info = dict(_LABEL.findall(labels))
    running, waiting = sums.get("vllm:num_requests_running"), sums.get("vllm:num_requests_waiting")
    usage = sums.get("vllm:kv_cache_usage_perc", sums.get("vllm:gpu_cache_usage_perc"))
    if running is None or waiting is None or usage is None:
        raise ValueError("not a vLLM-compatible /metrics: missing vllm:num_requests_running, "
                         "vllm:num_requests_waiting or vllm:kv_cache_usage_perc")
    cap = sums.get("kvserve_running_cap")
    return Scrape(
        num_running=int(running), num_waiting=int(waiting), kv_usage=min(1.0, max(0.0, usage)),
        finished_total=sums.get("vllm:request_success_total", 0.0),
        prefix_queries_total=sums.get("vllm:prefix_cache_queries_total"),
        prefix_hits_total=sums.get("vllm:prefix_cache_hits_total"),
        running_cap=int(cap) if cap is not None and cap >= 1 else None,  # 0: not set yet (no step measured)
        num_kv_blocks=_int_label(info, "num_gpu_blocks"), block_size=_int_label(info, "block_size"),
        queue_time_sum_s=sums.get("vllm:request_queue_time_seconds_sum"),
        queue_time_count=sums.get("vllm:request_queue_time_seconds_count"))


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(float(labels[name]))
    except (KeyError, ValueError):
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class Sent:
    """One request in flight at a backend, as the view counted it."""

    scrape_number: int
    num_tokens: int


class BackendView:
    """The gateway's live view of one backend (a fleet BackendLoad)."""

    def __init__(self, config: BackendConfig, breaker: BreakerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.name = config.name
        self.url = config.url
        self.clock = clock
        self.breaker = CircuitBreaker(breaker, clock)
        self.drain = DrainMeter()
        self.scrape: Scrape | None = None
        self.scraped_at: float | None = None
        self.ready = False
        self.models: tuple[str, ...] = ()  # the base models its /v1/models lists
        self.adapters: dict[str, str | None] = {}  # its LoRA adapters listed there: name -> parent model
        self.in_flight = 0  # requests the gateway has there now
        # Requests sent since the last scrape and not done: its numbers do not
        # show them yet. Each send is tagged with the scrape it followed.
        self._scrape_number = 0
        self._sent_since_scrape = 0
        self._sent_tokens_since_scrape = 0
        # The share of prompt tokens it found cached between scrapes (recent
        # intervals weigh most): the part of a sent request's tokens that is
        # expected to claim no new blocks there.
        self.prefix_hit_rate: float | None = None  # None until two scrapes with prompts between them
        self._prefix_counters: tuple[float, float] | None = None

    # ---- what the router reads -------------------------------------------
    @property
    def num_running(self) -> int:
        # Sent since the scrape: not in its numbers yet. Counted as running:
        # a queue is evidence of a full batch only where the backend shows one.
        return (self.scrape.num_running if self.scrape else 0) + self._sent_since_scrape

    @property
    def num_waiting(self) -> int:
        return self.scrape.num_waiting if self.scrape else 0

    @property
    def kv_usage(self) -> float:
        usage = self.scrape.kv_usage if self.scrape else 0.0
        # Requests sent since the scrape claim their tokens less what its
        # cache is finding: counted in full, two requests behind one shared
        # 2,048-token prompt looked like a full cache, and prefix-affinity
        # sent 37% of its requests away from their prefix (8% in the
        # simulator, whose views are exact).
        new_tokens = round(self._sent_tokens_since_scrape * (1.0 - (self.prefix_hit_rate or 0.0)))
        blocks, sent_blocks = self.num_kv_blocks, blocks_needed(self, new_tokens)
        if blocks and sent_blocks:
            usage += sent_blocks / blocks
        return min(1.0, usage)

    @property
    def num_kv_blocks(self) -> int | None:
        return (self.scrape.num_kv_blocks if self.scrape else None) or self.config.num_kv_blocks

    @property
    def block_size(self) -> int | None:
        return (self.scrape.block_size if self.scrape else None) or self.config.block_size

    @property
    def running_cap(self) -> int | None:
        return self.scrape.running_cap if self.scrape else None

    @property
    def drain_rps(self) -> float | None:
        return self.drain.rate_rps(self.clock())

    # ---- health ----------------------------------------------------------
    def eligible(self, stale_after_s: float) -> bool:
        """Gets traffic: breaker closed, ready, scraped recently."""
        fresh = self.scraped_at is not None and self.clock() - self.scraped_at <= stale_after_s
        return self.ready and fresh and self.breaker.closed

    def record_scrape(self, scrape: Scrape, ready: bool) -> None:
        now = self.clock()
        self.scrape, self.scraped_at, self.ready = scrape, now, ready
        self._scrape_number += 1
        self._sent_since_scrape = self._sent_tokens_since_scrape = 0
        self._observe_prefix_counters(scrape.prefix_hits_total, scrape.prefix_queries_total)
        self.drain.observe(now, scrape.finished_total, scrape.num_running + scrape.num_waiting + self.in_flight > 0)
        if ready:
            self.breaker.record_success()
        else:
            self.breaker.record_failure()

    def _observe_prefix_counters(self, hits: float | None, queries: float | None) -> None:
        if hits is None or queries is None:
            return
        if self._prefix_counters is not None:
            new_hits, new_queries = hits - self._prefix_counters[0], queries - self._prefix_counters[1]
            if new_queries > 0 and new_hits >= 0:  # a restarted backend's counters go back: skip that interval
                rate = min(1.0, new_hits / new_queries)
                self.prefix_hit_rate = rate if self.prefix_hit_rate is None else \
                    self.prefix_hit_rate + PREFIX_HIT_WEIGHT * (rate - self.prefix_hit_rate)
        self._prefix_counters = (hits, queries)

    def record_scrape_failure(self) -> None:
        self.ready = False
        self.breaker.record_failure()

    # ---- the gateway's own traffic ---------------------------------------
    def on_send(self, num_tokens: int) -> Sent:
        """A request the gateway sends there (prompt + max_tokens tokens);
        pass the ticket to on_done."""
        self.in_flight += 1
        self._sent_since_scrape += 1
        self._sent_tokens_since_scrape += num_tokens
        return Sent(self._scrape_number, num_tokens)

    def on_done(self, sent: Sent) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        if sent.scrape_number == self._scrape_number:  # no scrape saw it: stop counting it
            self._sent_since_scrape = max(0, self._sent_since_scrape - 1)
            self._sent_tokens_since_scrape = max(0, self._sent_tokens_since_scrape - sent.num_tokens)

    def mean_queue_time_s(self) -> float | None:
        s = self.scrape
        if s is None or not s.queue_time_count or s.queue_time_sum_s is None:
            return None
        return s.queue_time_sum_s / s.queue_time_count
