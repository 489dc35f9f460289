"""The load generator: asyncio + aiohttp streams against any OpenAI-compatible server.

Each request is timed with `time.perf_counter` relative to the run start:
scheduled (the arrival process's offset), sent (first attempt), headers
(response start of the final attempt), every SSE chunk that carried tokens
with its token count, and end. The records go to `report.build_report`.

Token counting per chunk (documented in docs/bench.md):
- the number of entries in the chunk's logprobs (`logprobs.tokens` for
  completions, `logprobs.content` for chat) when the server returns them;
- otherwise 1 per chunk with non-empty text;
- when the server honours `stream_options.include_usage` and its
  `completion_tokens` differs from the chunk count, the chunk counts are
  rescaled proportionally to the usage total (exact for servers that send one
  token per chunk or report logprobs; an approximation otherwise).

Retries (only with ClientConfig.max_retries > 0): 429 and 503 answers are
retried after max(Retry-After x U(1, 1.1), jittered exponential backoff),
never earlier than Retry-After, while a client-side retry budget allows it
(retries <= retry_budget_ratio x first attempts + retry_budget_min). Retries
carry `x-stainless-retry-count` and `x-kvserve-retry` headers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import aiohttp

from kvserve.bench.report import MetricsSample, RequestRecord
from kvserve.bench.workload import RequestSpec
from kvserve.latency import summarize

RETRYABLE_STATUS = (429, 503)
LAG_WARN_S = 0.005
# The response headers that name what shaped an answer (kvserve's; another
# server sends none and the record keeps only its system_fingerprint).
VERSION_HEADER_PREFIX = "x-kvserve-"
VERSION_HEADERS = ("model-revision", "tokenizer-hash", "chat-template-hash", "adapter-id",
                   "structured-output-hash", "tool-schema-hash")
# Requests of the "json" and "tools" features (bench.workload.REQUEST_FEATURES):
# small bounded shapes, so any model's answer closes within a few dozen tokens.
BENCH_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
                "properties": {"answer": {"type": "string", "maxLength": 48},
                               "confidence": {"enum": ["low", "medium", "high"]}}}
BENCH_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a term up",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["term"],
                   "properties": {"term": {"type": "string", "maxLength": 32}}}}}


@dataclass(frozen=True)
class ClientConfig:
    """How requests are sent. Times in seconds.

    api_keys: tenant -> API key (Authorization: Bearer); `api_key` for the rest.
    send_priority: put `priority` in the body (vLLM's extension; vLLM rejects
      nonzero priority unless its priority scheduling is on).
    vllm_extensions: send `ignore_eos` and `min_tokens` so outputs have the
      planned length on servers that support them.
    """

    base_url: str
    model: str | None = None
    endpoint: str = "completions"
    timeout_s: float = 300.0
    max_retries: int = 0
    retry_budget_ratio: float = 0.2
    retry_budget_min: int = 5
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 30.0
    api_key: str | None = None
    api_keys: tuple[tuple[str, str], ...] = ()
    send_priority: bool = False
    vllm_extensions: bool = True
    request_logprobs: bool = False
    metrics_interval_s: float = 1.0
    scrape_metrics: bool = True
    progress: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.metrics_interval_s <= 0:
            raise ValueError("timeout_s and metrics_interval_s must be > 0, max_retries >= 0")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    @property
    def root_url(self) -> str:
        """The server root (a trailing /v1 is dropped: both spellings are common)."""
        root = self.base_url.rstrip("/")
        return root[:-3] if root.endswith("/v1") else root

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.root_url + path


class RetryBudget:
    """Client-side cap on retries, so a struggling server is not flooded."""

    def __init__(self, ratio: float, minimum: int) -> None:
        self._ratio, self._minimum = ratio, minimum
        self.first_attempts = 0
        self.retries = 0

    def record_first_attempt(self) -> None:
        self.first_attempts += 1

    def can_retry(self) -> bool:
        return self.retries < self._minimum + self._ratio * self.first_attempts

    def retry(self) -> None:
        self.retries += 1


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    metrics_samples: list[MetricsSample]
    client_stats: dict
    wall_start_unix_s: float


@dataclass
class _Attempt:
    """Mutable state of one request while it runs (survives a timeout)."""

    sent_s: float | None = None
    last_sent_s: float | None = None
    headers_s: float | None = None
    events: list[tuple[float, int]] = field(default_factory=list)
    usage_tokens: int | None = None
    status: int | None = None
    reason: str | None = None
    error: str | None = None
    retries: int = 0
    versions: dict[str, str] = field(default_factory=dict)


# --- one request ---------------------------------------------------------------

class LoadClient:
    """Sends requests on a schedule and scrapes server metrics meanwhile."""

    def __init__(self, config: ClientConfig, session: aiohttp.ClientSession) -> None:
        self.config = config
        self._session = session
        self._t0 = time.perf_counter()
        self.budget = RetryBudget(config.retry_budget_ratio, config.retry_budget_min)
        self._rng = random.Random(f"{config.seed}:retry-jitter")
        self._keys = dict(config.api_keys)
        self.records: list[RequestRecord] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def start_clock(self) -> None:
        """Make now() count from here: the run's time zero."""
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _body(self, spec: RequestSpec, prompt: str) -> dict:
        body: dict = {"max_tokens": spec.output_tokens, "stream": True,
                      "stream_options": {"include_usage": True}, "temperature": 0.0}
        if self.config.model:
            body["model"] = self.config.model
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if spec.feature != "plain":
            body.update(_feature_fields(spec.feature, self.config.endpoint))
        elif self.config.vllm_extensions:
            # The planned length; a constrained answer ends where its shape closes.
            body.update(ignore_eos=True, min_tokens=spec.output_tokens)
        if self.config.send_priority:
            body["priority"] = spec.priority
        if self.config.request_logprobs:
            body["logprobs"] = True if self.config.endpoint == "chat" else 1
        return body

    def _headers(self, spec: RequestSpec, retry: int) -> dict:
        headers = {"X-Request-Id": f"bench-{spec.index}"}
        key = self._keys.get(spec.tenant, self.config.api_key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        if retry:
            headers["x-stainless-retry-count"] = str(retry)
            headers["x-kvserve-retry"] = str(retry)
        return headers

    async def execute(self, spec: RequestSpec, prompt: str, scheduled_s: float) -> RequestRecord:
        """Send one request (with retries), return its record; never raises."""
        state = _Attempt()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        limit_s, limit_kind = self.config.timeout_s, "timed_out"
        if spec.cancel_after_s is not None and spec.cancel_after_s < limit_s:
            limit_s, limit_kind = spec.cancel_after_s, "cancelled"
        limit = asyncio.timeout(limit_s)
        try:
            async with limit:
                outcome = await self._attempts(spec, prompt, state)
        except TimeoutError as exc:
            # Our own limit, or a socket timeout inside aiohttp (an error).
            outcome = limit_kind if limit.expired() else "error"
            state.error = None if limit.expired() else f"timeout: {exc}"
        except Exception as exc:  # a malformed answer must not end the whole run
            outcome, state.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        record = self._record(spec, state, scheduled_s, outcome)
        self.records.append(record)
        return record

    async def _attempts(self, spec: RequestSpec, prompt: str, state: _Attempt) -> str:
        body = self._body(spec, prompt)
        self.budget.record_first_attempt()
        while True:
            state.last_sent_s = self.now()
            if state.sent_s is None:
                state.sent_s = state.last_sent_s
            retry_after = await self._attempt(spec, body, state)
            if state.status == 200:
                return "success"
            if not self._should_retry(state):
                return "rejected" if state.status in RETRYABLE_STATUS else "error"
            self.budget.retry()
            state.retries += 1
            await asyncio.sleep(self._retry_delay_s(retry_after, state.retries))

    def _should_retry(self, state: _Attempt) -> bool:
        return (state.status in RETRYABLE_STATUS and state.retries < self.config.max_retries
                and self.budget.can_retry())

    def _retry_delay_s(self, retry_after_s: float | None, attempt: int) -> float:
        backoff = min(self.config.backoff_cap_s,
                      self.config.backoff_base_s * 2 ** (attempt - 1)) * self._rng.uniform(0.5, 1.5)
        if retry_after_s is None:
            return backoff
        # Never before Retry-After; a little jitter above it so rejected
        # clients do not return in one synchronized wave.
        return max(retry_after_s * self._rng.uniform(1.0, 1.1), backoff)

    async def _attempt(self, spec: RequestSpec, body: dict, state: _Attempt) -> float | None:
        """One HTTP exchange; returns Retry-After seconds of a refusal, if any."""
        state.events, state.usage_tokens, state.reason = [], None, None
        headers = self._headers(spec, state.retries)
        async with self._session.post(self.config.url, json=body, headers=headers) as resp:
            state.headers_s = self.now()
            state.status = resp.status
            state.versions = _version_headers(resp.headers)
            if resp.status != 200:
                state.reason, state.error = _error_reason(resp.status, await resp.read())
                return _retry_after_s(resp.headers.get("Retry-After"))
            try:
                await self._read_stream(resp, state)
            except BaseException:
                resp.close()  # abandon the stream: the server sees a disconnect
                raise
        return None

    async def _read_stream(self, resp: aiohttp.ClientResponse, state: _Attempt) -> None:
        # Read whatever bytes arrived and split lines here: one await per
        # network read instead of one per SSE line keeps the loop light at
        # hundreds of streams. A chunk is timed when its bytes arrive.
        chat = self.config.endpoint == "chat"
        pending = b""
        async for data in resp.content.iter_any():
            arrived_s = self.now()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if self._handle_line(line, arrived_s, chat, state):
                    return

    def _handle_line(self, line: bytes, arrived_s: float, chat: bool, state: _Attempt) -> bool:
        """Record one SSE line; True at the end of the stream."""
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            state.status = 500
            state.reason, state.error = _error_reason(500, data)
            return True
        if "system_fingerprint" not in state.versions and chunk.get("system_fingerprint"):
            state.versions["system_fingerprint"] = chunk["system_fingerprint"]
        count = _chunk_tokens(chunk, chat)
        if count:
            state.events.append((arrived_s, count))
        usage = chunk.get("usage") or {}
        if usage.get("completion_tokens") is not None:
            state.usage_tokens = int(usage["completion_tokens"])
        return False

    def _record(self, spec: RequestSpec, state: _Attempt, scheduled_s: float,
                outcome: str) -> RequestRecord:
        events = _reconcile(state.events, state.usage_tokens) if outcome == "success" else state.events
        return RequestRecord(
            index=spec.index, outcome=outcome, scheduled_s=scheduled_s, sent_s=state.sent_s,
            headers_s=state.headers_s, token_events=tuple(events),
            end_s=self.now(), status_code=state.status,
            reject_reason=state.reason if outcome == "rejected" else None,
            tenant=spec.tenant, priority=spec.priority, prompt_tokens=spec.prompt_tokens,
            output_tokens=sum(n for _, n in events), expected_output_tokens=spec.output_tokens,
            retries=state.retries, last_sent_s=state.last_sent_s,
            error=state.error if outcome == "error" else None, feature=spec.feature,
            versions=tuple(state.versions.items()))


def _feature_fields(feature: str, endpoint: str) -> dict:
    """The body fields of a request feature: a json_schema response format, or
    a named tool call (chat only: completions take no tools)."""
    if feature == "json":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": BENCH_SCHEMA}}}
    if endpoint != "chat":
        raise ValueError(f"request feature {feature!r} needs the chat endpoint")
    return {"tools": [BENCH_TOOL], "tool_choice": {"type": "function", "function": {"name": "lookup"}}}


def _version_headers(headers) -> dict[str, str]:
    out = {}
    for name in VERSION_HEADERS:
        value = headers.get(VERSION_HEADER_PREFIX + name)
        if value:
            out[name] = value
    return out


def _chunk_tokens(chunk: dict, chat: bool) -> int:
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    logprobs = choice.get("logprobs") or {}
    listed = logprobs.get("content") if chat else logprobs.get("tokens")
    if listed:
        return len(listed)
    if not chat:
        return 1 if choice.get("text") else 0
    delta = choice.get("delta") or {}
    return 1 if delta.get("content") or delta.get("tool_calls") else 0


def _reconcile(events: list[tuple[float, int]], usage_tokens: int | None) -> list[tuple[float, int]]:
    """Rescale chunk token counts to the server's usage total (largest remainder)."""
    counted = sum(n for _, n in events)
    if usage_tokens is None or counted == 0 or usage_tokens == counted:
        return events
    scale = usage_tokens / counted
    raw = [n * scale for _, n in events]
    counts = [int(x) for x in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: raw[i] - counts[i], reverse=True)
    for i in by_remainder[:usage_tokens - sum(counts)]:
        counts[i] += 1
    return [(t, c) for (t, _), c in zip(events, counts) if c > 0]


def _error_reason(status: int, payload: bytes) -> tuple[str | None, str]:
    """(reason code, message) from an OpenAI-shaped error body, if any."""
    try:
        error = json.loads(payload).get("error") or {}
    except (ValueError, AttributeError):
        return None, f"HTTP {status}: {payload[:200]!r}"
    if not isinstance(error, dict):
        return None, f"HTTP {status}: {error}"
    code = error.get("code") or error.get("type")
    return (str(code) if code is not None else None), f"HTTP {status}: {error.get('message', '')}"


def _retry_after_s(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP-date: fall back to backoff


# --- the run -------------------------------------------------------------------

def run_sync(coro):
    """Run a coroutine on uvloop when installed (a lighter event loop keeps
    the send schedule at hundreds of streams), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# The loop's timers have ~1 ms granularity. Sleeping to SPIN_S before the
# target and then yielding until it trades a little CPU for sub-ms sends.
SPIN_S = float(os.environ.get("KVSERVE_BENCH_SPIN_S", "0.0015"))


@contextmanager
def _young_gc_only() -> Iterator[None]:
    """No full (generation 2) garbage collections during the run: one walks
    every live object and, at hundreds of streams, stalls the loop for tens
    of ms (measured: 106 ms), which the send schedule would feel. Young
    generations still collect short-lived cycles; objects from before the
    run are frozen out of collection."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold[0], threshold[1], 2**30)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


async def _sleep_until(client: LoadClient, target_s: float) -> None:
    delay = target_s - client.now()
    if delay > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while client.now() < target_s:
        await asyncio.sleep(0)


async def _open_loop(client: LoadClient, specs: Sequence[RequestSpec], prompts: Sequence[str],
                     offsets_s: Sequence[float]) -> None:
    tasks = []
    for spec, prompt, offset in zip(specs, prompts, offsets_s):
        await _sleep_until(client, offset)
        tasks.append(asyncio.create_task(client.execute(spec, prompt, offset)))
    await asyncio.gather(*tasks)


async def _closed_loop(client: LoadClient, specs: Iterable[RequestSpec],
                       prompt_for: Callable[[RequestSpec], str], concurrency: int,
                       duration_s: float | None) -> None:
    queue = iter(specs)

    async def worker() -> None:
        while True:
            # The decision to send is the request's scheduled time: it lies
            # inside the duration even when a loaded machine sends it after.
            scheduled_s = client.now()
            if duration_s is not None and scheduled_s >= duration_s:
                return
            spec = next(queue, None)
            if spec is None:
                return
            await client.execute(spec, prompt_for(spec), scheduled_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_load(config: ClientConfig, specs: Sequence[RequestSpec] | Iterable[RequestSpec],
                   prompt_for: Callable[[RequestSpec], str],
                   offsets_s: Sequence[float] | None = None, concurrency: int | None = None,
                   duration_s: float | None = None) -> RunResult:
    """Drive the server: open loop at `offsets_s` (one per spec), or closed
    loop keeping `concurrency` requests in flight (until the specs, which may
    be an endless iterator, run out or `duration_s` passes). Open-loop
    prompts are all built before the clock starts, so synthesis never delays
    a send."""
    if (offsets_s is None) == (concurrency is None):
        raise ValueError("give exactly one of offsets_s (open loop) or concurrency (closed loop)")
    if offsets_s is not None and len(offsets_s) != len(specs):
        raise ValueError(f"need one offset per spec, got {len(offsets_s)} for {len(specs)}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    prompts = [prompt_for(s) for s in specs] if offsets_s is not None else None
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on connections
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = LoadClient(config, session)
        samples: list[MetricsSample] = []
        scraper = MetricsScraper(session, config.root_url + "/metrics", client.now)
        if config.scrape_metrics:
            await scraper.scrape_into(samples)
        # The run starts after the baseline scrape, so it costs no schedule lag.
        wall_start = time.time()
        client.start_clock()
        samples[:] = [dataclasses.replace(s, t_s=0.0) for s in samples]
        background = [asyncio.create_task(scraper.loop(samples, config.metrics_interval_s))
                      ] if config.scrape_metrics and scraper.available else []
        total = len(specs) if isinstance(specs, Sequence) else None  # iterator: unknown
        if config.progress:
            background.append(asyncio.create_task(_progress(client, total)))
        try:
            with _young_gc_only():
                if offsets_s is not None:
                    await _open_loop(client, specs, prompts, offsets_s)
                else:
                    await _closed_loop(client, specs, prompt_for, concurrency, duration_s)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
        if config.progress:
            _print_progress(client, total, final=True, redraw=sys.stderr.isatty())
        if config.scrape_metrics and scraper.available:
            await scraper.scrape_into(samples)
    records = sorted(client.records, key=lambda r: r.index)
    return RunResult(records, samples, _client_stats(client, records), wall_start)


def _client_stats(client: LoadClient, records: Sequence[RequestRecord]) -> dict:
    lags = [r.sent_s - r.scheduled_s for r in records
            if r.sent_s is not None and r.scheduled_s is not None]
    lag = summarize(lags)
    warnings = []
    if lag["p99"] is not None and lag["p99"] > LAG_WARN_S:
        warnings.append(f"client fell behind its schedule: p99 send lag "
                        f"{lag['p99'] * 1000:.1f} ms > {LAG_WARN_S * 1000:.0f} ms; "
                        "the offered load is lower than asked (run fewer streams per process)")
    return {"schedule_lag_s": lag, "max_in_flight": client.max_in_flight,
            "retries": client.budget.retries, "warnings": warnings}


# Progress on a terminal redraws one line; into a file or a CI log it prints
# a whole line this often instead of carriage returns.
PROGRESS_TTY_PERIOD_S = 0.5
PROGRESS_LOG_PERIOD_S = 5.0


def _print_progress(client: LoadClient, total: int | None, final: bool = False,
                    redraw: bool = True) -> None:
    done = len(client.records)
    width = 30
    filled = int(width * done / total) if total else width
    bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}" if total else f"{done}"
    failed = sum(r.outcome != "success" for r in client.records)
    line = f"{bar} done, {client.in_flight} in flight, {failed} not successful, {client.now():.1f} s"
    sys.stderr.write(f"\r{line}" + ("\n" if final else "") if redraw else line + "\n")
    sys.stderr.flush()


async def _progress(client: LoadClient, total: int | None) -> None:
    redraw = sys.stderr.isatty()
    while True:
        _print_progress(client, total, redraw=redraw)
        await asyncio.sleep(PROGRESS_TTY_PERIOD_S if redraw else PROGRESS_LOG_PERIOD_S)


# --- server metrics --------------------------------------------------------------

_GAUGE_NAMES = {
    "vllm:kv_cache_usage_perc": "kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",  # vLLM before 0.10
    "vllm:num_requests_running": "num_requests_running",
    "vllm:num_requests_waiting": "num_requests_waiting",
    "vllm:num_preemptions_total": "num_preemptions",
    "vllm:num_preemptions": "num_preemptions",
}
_QUEUE_HIST = "vllm:request_queue_time_seconds"
# Counters kept for the report: vLLM's names (`vllm:`) and kvserve's own
# (`kvserve_`: admission decisions, cancellations, SLO verdicts; metrics.py).
SERVER_COUNTER_PREFIXES = ("vllm:", "kvserve_")


class MetricsScraper:
    """Periodic GET /metrics; absent metrics are simply absent."""

    def __init__(self, session: aiohttp.ClientSession, url: str, now) -> None:
        self._session, self._url, self._now = session, url, now
        self.available = True
        self._num_ok = 0

    async def scrape_into(self, samples: list[MetricsSample]) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=5)
            async with self._session.get(self._url, timeout=timeout) as resp:
                text = await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            text = None
        if text is None:
            # No /metrics at all: stop asking. A later failure is one lost sample.
            self.available = self._num_ok > 0
            return
        try:
            sample = parse_metrics(text, self._now())
        except ValueError:  # not Prometheus text: treat as absent
            self.available = self._num_ok > 0
            return
        self._num_ok += 1
        samples.append(sample)

    async def loop(self, samples: list[MetricsSample], interval_s: float) -> None:
        while self.available:
            await asyncio.sleep(interval_s)
            await self.scrape_into(samples)


def parse_metrics(text: str, t_s: float) -> MetricsSample:
    """A MetricsSample from Prometheus text exposition (sums over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    gauges: dict[str, float] = {}
    buckets: dict[float, float] = {}
    hist = {"sum": None, "count": None}
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name in _GAUGE_NAMES:
                key = _GAUGE_NAMES[name]
                gauges[key] = gauges.get(key, 0.0) + value
            if name == _QUEUE_HIST + "_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
            elif name in (_QUEUE_HIST + "_sum", _QUEUE_HIST + "_count"):
                part = name.rsplit("_", 1)[1]
                hist[part] = (hist[part] or 0.0) + value
            if family.type == "counter" and name.startswith(SERVER_COUNTER_PREFIXES) \
                    and not name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                counters[f"{name}{{{labels}}}" if labels else name] = value
    return MetricsSample(t_s, gauges, tuple(sorted(buckets.items())), hist["sum"],
                         hist["count"], counters)
