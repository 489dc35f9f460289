"""`kvserve profile`: time real engine steps on this machine and fit the
simulator's linear cost model to them.

First a sweep over tokens per step: one fresh prompt of each size, alone,
timed in its prefill step. That measures the curve of step time over the
tokens passing through the weights, which on a CPU is far from a line (one
token is a cheap matrix-vector product; 8 rows can cost more than 24). Then,
for each context length, `batch` requests are prefilled (untimed) and timed
while decoding (after a few untimed decode steps: the steady state a served
decode step mostly runs in), which separates the cost of the context read
from the tokens; then a fresh prompt of each prefill size joins the batch
and that mixed step is timed. Each timed step's shape comes from the batch
the step ran (`StepResult.scheduled`), so the fit sees exactly what the
simulator will ask about. Steps are whole `EngineCore.step()` calls (schedule, forward pass,
sampling, update, detokenize), the same unit the server's loop runs.

Each grid point is timed `--repeats` times and the fit takes the median;
every repeat over that median is kept as the machine's step jitter, which
`kvserve simulate` applies to its steps (`--step-jitter`).

Last, the serving loop: a few requests, one at a time, run through the
server's own AsyncEngine thread with an event loop reading every stream and
encoding each output as an SSE chunk, as the server's streaming does. The
time a decode step takes there beyond what the fitted model gives the same
step (the engine thread handing the outputs to the event loop, and waiting
for the GIL while the event loop works, inside the step too) is the
profile's serving overhead per step, which `kvserve simulate` charges to
every step.

    kvserve profile --kv-cache-memory 1GiB --out profile.json
    kvserve simulate --model M --hardware profile.json ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from kvserve.engine.cli import add_engine_arguments, engine_config, set_torch_threads
from kvserve.sim.cost_model import SpeedDrift, StepShape, chunk_shape, fit_linear_cost_model, profile_json

if TYPE_CHECKING:  # imported when profiling starts, so `--help` does not load torch
    from kvserve.engine.core import EngineCore


# The sweep's sizes: every one up to 64, every 4th up to 128, sparse above.
# A step's time over its rows is a staircase, not a line: the kernels work
# in blocks of rows, and a size just past a block pays for the whole next
# one. Measured on the AMX Xeon (default model, one thread), a prompt step
# of 33 tokens took 26.9 ms against 24.6 at 32, 65 took 33.4 against 30.3
# at 64, and 17 and 25 jumped alike; a curve through 16, 24, 32, 48 and 64
# alone read 60 of the 89 sizes from 8 to 96 more than 5% low (1.07x on
# average), and `kvserve simulate` a 16-64 token workload's TTFT p50 8-9%
# low at 0.5 and 1 req/s (5-6% with this sweep, on the same live runs:
# docs/performance.md). Where one block of rows is a large share of the step, every
# size is a knot (~5 s more profiling at 5 repeats); above, a stair is a
# few percent of the step, and knots 4 apart or sparser follow it.
DEFAULT_SWEEP_TOKENS = (*range(1, 65), *range(68, 129, 4), 160, 192, 224, 256, 320, 384, 448, 512)
# Fewer repeats say nothing of the spread: the median of two is one of them.
MIN_JITTER_REPEATS = 3
# Decode-only shapes are timed after this many untimed decode steps of the
# same batch. A decode step that follows prompt steps runs slower for a few
# steps (the caches refill with the decode path's data): measured here,
# batch-1 decode steps each a prompt step after averaged 8% over steps that
# follow decode steps, the 1st 7% over the 15th. A served decode step mostly
# follows decode steps, and the linear model has no term for what ran
# before a step, so the profile times the steady state.
DECODE_SETTLE_STEPS = 8
# The serving loop's requests: a short workload's prompt and output, about.
SERVING_LOOP_REQUESTS = 6
SERVING_LOOP_PROMPT_TOKENS = 48
SERVING_LOOP_NEW_TOKENS = 24
# The speed drift: how long its trace runs, the bin each factor averages
# (about ten batch-1 decode steps: a slow stretch on this project's CPU
# lasts 50-200 ms, a slow spell a second or more) and the blocks a
# simulation replays.
DRIFT_SECONDS = 12.0
DRIFT_BIN_S = 0.05
DRIFT_BLOCK_S = 2.0


class TimedSteps(NamedTuple):
    samples: list[tuple[StepShape, float]]  # (shape, median seconds) per grid point
    jitter: list[float]  # every repeat over its grid point's median (3+ repeats)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `kvserve serve`'s own engine flags: profile the engine you will simulate.
    add_engine_arguments(parser.add_argument_group("model and engine (as kvserve serve)"))
    parser.add_argument("--tokens", type=_ints, default=_ints(",".join(map(str, DEFAULT_SWEEP_TOKENS))),
                        help="tokens per step of the sweep (one fresh prompt of each size; sizes above "
                             "--max-num-batched-tokens are skipped): the knots of the fitted token curve")
    parser.add_argument("--prefill-tokens", type=_ints, default=_ints("0,32,128,384"),
                        help="prompt sizes (tokens) joining the batch in timed mixed steps")
    parser.add_argument("--decode-batch", type=_ints, default=_ints("0,1,4,16"),
                        help="decoding sequences per timed step")
    parser.add_argument("--context", type=_ints, default=_ints("64,256,768"),
                        help="context length (tokens) of the decoding sequences")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed steps per grid point: the fit takes their median, and their spread "
                             "around it is the step jitter `kvserve simulate` applies (3 or more)")
    parser.add_argument("--time-budget", type=float, default=300.0,
                        help="stop measuring after this many seconds and fit what was timed")
    parser.add_argument("--serving-loop-requests", type=int, default=SERVING_LOOP_REQUESTS,
                        help="requests (one at a time, batch-1 decode) run last through the server's async "
                             "engine loop with an event loop streaming their outputs: the mean time a served "
                             "step takes beyond the fitted step (the outputs' handoff to the event loop, "
                             "the GIL the two threads share) is the profile's serving overhead, which "
                             "`kvserve simulate` adds to every step; 0 skips it (no overhead)")
    parser.add_argument("--drift-seconds", type=float, default=DRIFT_SECONDS,
                        help="seconds of back-to-back batch-1 decode steps timed last: the machine's speed "
                             f"over time (each {DRIFT_BIN_S:g} s's mean step over the whole trace's), which "
                             "`kvserve simulate` replays so that a request decoding in a slow stretch is slow "
                             "throughout, as it is live; 0 skips it")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens")
    parser.add_argument("--out", default="profile.json", help="where to write the profile JSON")


class _StepTimer:
    """Times `EngineCore.step()` and keeps the shape of the batch it ran."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.samples: list[tuple[StepShape, float]] = []
        self.jitter: list[float] = []  # each repeat over its grid point's median

    def _timed_step(self) -> tuple[StepShape, float]:
        start = time.perf_counter()
        result = self.core.step()
        return chunk_shape(result.scheduled.chunks), time.perf_counter() - start

    def step(self, timed: bool) -> None:
        shape, elapsed = self._timed_step()
        if timed and shape.num_tokens:
            self.samples.append((shape, elapsed))

    def step_median(self, repeats: int, before_each=None, after_each=None) -> None:
        """Time `repeats` steps of (nearly) one shape and keep their median:
        on a shared machine a single step can take 10x its usual time, and
        one such outlier would drag a least-squares fit. The spread is not
        thrown away: with 3 or more repeats, each one over the median joins
        `jitter`."""
        measured = []
        for _ in range(repeats):
            joining = before_each() if before_each else None
            measured.append(self._timed_step())
            if after_each:
                after_each(joining)
        measured = [m for m in measured if m[0].num_tokens]
        if measured:
            times = sorted(t for _, t in measured)
            shape = measured[len(measured) // 2][0]
            median = times[len(times) // 2]
            self.samples.append((shape, median))
            if len(times) >= MIN_JITTER_REPEATS and median > 0:
                self.jitter.extend(t / median for _, t in measured)


def _new_request(core: EngineCore, rng: random.Random, num_tokens: int, max_tokens: int):
    from kvserve.contract import SamplingParams

    vocab = core.model_config.vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(num_tokens)]  # unique: no prefix hits
    return core.new_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _add(core: EngineCore, rng: random.Random, num_tokens: int, max_tokens: int):
    request = _new_request(core, rng, num_tokens, max_tokens)
    core.add_request(request)
    return request


@dataclass(frozen=True)
class ProfileGrid:
    prefill_tokens: tuple[int, ...] = (0, 32, 128, 384)
    decode_batch: tuple[int, ...] = (0, 1, 4, 16)
    context: tuple[int, ...] = (64, 256, 768)
    repeats: int = 3
    time_budget_s: float = 300.0
    seed: int = 0
    tokens: tuple[int, ...] = ()  # the sweep; () skips it (no token curve)

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.time_budget_s <= 0:
            raise ValueError("repeats must be >= 1 and the time budget > 0 seconds")
        if any(n < 1 for n in self.tokens):
            raise ValueError(f"sweep token counts must be >= 1, got {list(self.tokens)}")


def swept_tokens(samples: list[tuple[StepShape, float]], grid: ProfileGrid) -> tuple[int, ...]:
    """The sweep's token counts that were timed (the budget or the engine's
    limits may have cut some): the knots of the fitted token curve."""
    timed = {s.num_tokens for s, _ in samples if s.num_decode_seqs == 0}
    return tuple(sorted(n for n in set(grid.tokens) if n in timed))


def time_engine_steps(core: EngineCore, grid: ProfileGrid) -> TimedSteps:
    """(shape, seconds) of timed `core.step()` calls over the grid, and the
    repeats' spread. The core must be idle; it is left idle."""
    timer = _StepTimer(core)
    rng = random.Random(grid.seed)
    _add(core, rng, 16, 2)  # warm-up: first-call allocations are not a step's cost
    while core.has_unfinished():
        timer.step(timed=False)
    deadline = time.perf_counter() + grid.time_budget_s
    _measure_token_sweep(core, timer, rng, grid, deadline)
    for context in grid.context:
        if context + 1 >= core.max_model_len:
            raise ValueError(f"context {context} does not fit the model's {core.max_model_len} tokens")
        _measure_context(core, timer, rng, context, grid, deadline)
    return TimedSteps(timer.samples, timer.jitter)


def _measure_token_sweep(core: EngineCore, timer: _StepTimer, rng: random.Random, grid: ProfileGrid,
                         deadline: float) -> None:
    """One fresh prompt of each sweep size alone in its prefill step. Sizes
    the engine would split into chunks (over its token budget) or cannot
    hold are skipped: such a step would not have the size asked for."""
    limit = min(core.config.max_num_batched_tokens, core.max_model_len - 1)
    for num_tokens in sorted(set(grid.tokens)):
        if num_tokens > limit or time.perf_counter() > deadline:
            continue
        timer.step_median(grid.repeats, lambda n=num_tokens: _add(core, rng, n, 1),
                          lambda joining: core.abort(joining.request_id))


def _measure_context(core: EngineCore, timer: _StepTimer, rng: random.Random, context: int,
                     grid: ProfileGrid, deadline: float) -> None:
    """Fill the largest batch once, then measure it and shrink it by aborting.
    Each batch's decode-only steps are timed after DECODE_SETTLE_STEPS
    untimed ones; then a fresh prompt of each prefill size joins it."""
    batches = sorted(grid.decode_batch, reverse=True)
    running = [_add(core, rng, context, 10**6) for _ in range(batches[0])]
    while any(r.num_output_tokens == 0 for r in running) and time.perf_counter() < deadline:
        timer.step(timed=False)
    for batch in batches:
        for request in running[batch:]:
            core.abort(request.request_id)
        running = running[:batch]
        if batch:
            for _ in range(DECODE_SETTLE_STEPS):
                timer.step(timed=False)
            timer.step_median(grid.repeats)
        for prefill in grid.prefill_tokens:
            if prefill == 0 or time.perf_counter() > deadline:
                continue
            timer.step_median(grid.repeats, lambda p=prefill: _add(core, rng, p, 1),
                              lambda joining: core.abort(joining.request_id))
        if time.perf_counter() > deadline:
            break
    for request in running:
        core.abort(request.request_id)


def _lone_decode(step) -> bool:
    """A batch-1 decode-only step (a StepShape or a StepReport): what the
    serving loop and the speed drift time, and the same filter on both of
    the loop's records keeps its shapes and step times in step."""
    return step.num_decode_seqs == 1 and step.num_prefill_tokens == 0


class ServingLoopTiming(NamedTuple):
    overhead_per_step_s: float  # mean period over the steps' predicted (else measured) time, >= 0
    mean_step_s: float  # EngineCore.step() of the same steps, as timed in the loop
    num_steps: int
    mean_period_s: float = 0.0  # a request's time between consecutive tokens, mean
    predicted_step_s: float | None = None  # the step model's time for the same steps, mean


def time_serving_loop(core: EngineCore, rng: random.Random, num_requests: int = SERVING_LOOP_REQUESTS,
                      prompt_tokens: int = SERVING_LOOP_PROMPT_TOKENS,
                      new_tokens: int = SERVING_LOOP_NEW_TOKENS,
                      step_model: Callable[[StepShape], float] | None = None) -> ServingLoopTiming:
    """Batch-1 decode through AsyncEngine, requests one after another, each
    stream read on an event loop (uvloop when installed, as the server
    runs). The event loop does what the server's does per step besides
    HTTP: each stream's outputs encoded as SSE chunks, the step's metrics
    recorded. The overhead is the mean time between consecutive tokens of
    a request minus the mean time `step_model` (the profile's fitted steps)
    gives the same decode steps, so it holds both the handoff between steps
    and the step's own slowdown beside a busy event loop (the two threads
    share the GIL): on the 2026-12-07 EPYC the loop's steps ran 0.96-1.14x
    the fitted ones (1.04x on average), which charging only the handoff
    left out, and the validation's simulated TPOT p50 read 8.5% low on
    average, 5% after. Without `step_model`, minus the loop's own
    `EngineCore.step()` times. The core must be idle; it is left idle."""
    from kvserve.engine.async_engine import AsyncEngine, Finished
    from kvserve.metrics import ServerMetrics

    decode_step_s: list[float] = []
    decode_shapes: list[StepShape] = []
    periods_s: list[float] = []
    # The event loop records each step's metrics as the server's does
    # (Serving._on_step): part of its work per step.
    metrics = ServerMetrics("profile", 1.0, 0.1, core.max_model_len)

    def on_scheduled(scheduled) -> None:  # engine thread: the step's exact shape
        shape = chunk_shape(scheduled.chunks)
        if _lone_decode(shape):
            decode_shapes.append(shape)

    def on_step(report) -> None:
        if _lone_decode(report):
            decode_step_s.append(report.step_s)
        for done in report.finished:
            metrics.record_finished(done.timestamps, done.num_prompt_tokens, done.num_output_tokens,
                                    done.finish_reason)
        metrics.record_step_report(report)

    async def serve_one(engine: AsyncEngine) -> None:
        request = _new_request(core, rng, prompt_tokens, new_tokens)
        stream = engine.add(request)
        while not isinstance(item := await stream.next(), Finished):
            _sse_chunk(request.request_id, item)
        stamps = item.timestamps.token_times
        periods_s.extend(b - a for a, b in zip(stamps, stamps[1:]))

    async def serve_all() -> None:
        engine = AsyncEngine(core, on_step=on_step, on_scheduled=on_scheduled)
        engine.start()
        try:
            for _ in range(num_requests):
                await serve_one(engine)
        finally:
            await engine.stop()

    _event_loop_runner()(serve_all())
    # One step per period: the requests ran alone, so each decode step
    # gave one request's next token.
    num_steps = min(len(periods_s), len(decode_step_s))
    if num_steps == 0:
        raise ValueError("the serving loop timed no decode steps (new tokens must be >= 2)")
    mean_step_s = sum(decode_step_s) / len(decode_step_s)
    mean_period_s = sum(periods_s) / len(periods_s)
    predicted_s = None
    if step_model is not None and decode_shapes:
        predicted_s = sum(step_model(shape) for shape in decode_shapes) / len(decode_shapes)
    overhead_s = max(0.0, mean_period_s - (mean_step_s if predicted_s is None else predicted_s))
    return ServingLoopTiming(overhead_s, mean_step_s, num_steps, mean_period_s, predicted_s)


def time_speed_drift(core: EngineCore, rng: random.Random, seconds: float, bin_s: float = DRIFT_BIN_S,
                     block_s: float = DRIFT_BLOCK_S) -> SpeedDrift | None:
    """The machine's speed over `seconds`: batch-1 decode steps back to back
    (the serving loop's requests, one after another), each bin's mean
    over the trace's. The step's context grows by a request's new tokens
    (48 to 72), ~2% of its time here: small beside the drift it measures.
    The core must be idle; it is left idle."""
    steps: list[tuple[float, float]] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        request = _add(core, rng, SERVING_LOOP_PROMPT_TOKENS, SERVING_LOOP_NEW_TOKENS)
        while core.has_unfinished():
            if time.perf_counter() >= deadline:  # the trace is `seconds` long, not a request more
                core.abort(request.request_id)
                break
            start = time.perf_counter()
            result = core.step()
            elapsed = time.perf_counter() - start
            shape = chunk_shape(result.scheduled.chunks)
            if _lone_decode(shape):
                steps.append((start, elapsed))
    return SpeedDrift.of_steps(steps, bin_s, block_s)


def _event_loop_runner():
    """What runs the server's event loop: uvloop's when installed (uvicorn
    picks it then), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run
    return uvloop.run


def _sse_chunk(request_id: str, output) -> bytes:
    """The event loop's work per output, as the server's streaming does it:
    one OpenAI completion chunk as an SSE event."""
    chunk = {"id": request_id, "object": "text_completion", "model": "profile",
             "choices": [{"index": 0, "text": output.new_text, "logprobs": None,
                          "finish_reason": output.finish_reason}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def run(args: argparse.Namespace) -> int:
    try:
        document = profile(args)
    except (ValueError, OSError) as exc:
        print(f"kvserve profile: error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(document, indent=1))
    c, fit, curve = document["coefficients"], document["fit"], document["token_curve"]
    print(f"fitted {fit['num_samples']} steps: r2={fit['r2']:.3f}, mean |error| {fit['mean_abs_rel_error']:.1%}")
    if curve:
        print("  step_s = curve(tokens per step)"
              f" + {c['per_decode_seq_s'] * 1e6:.1f} us/decode seq"
              f" + {c['per_kv_token_read_s'] * 1e9:.1f} ns/KV token read"
              f" + {c['per_attention_pair_s'] * 1e9:.3f} ns/attention pair\n  curve: "
              + ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(curve["tokens"], curve["step_s"])))
    else:
        print(f"  step_s = {c['intercept_s'] * 1e3:.2f} ms"
              f" + {c['per_prefill_token_s'] * 1e6:.1f} us/prefill token"
              f" + {c['per_decode_seq_s'] * 1e6:.1f} us/decode seq"
              f" + {c['per_kv_token_read_s'] * 1e9:.1f} ns/KV token read"
              f" + {c['per_attention_pair_s'] * 1e9:.3f} ns/attention pair")
    print(f"  + {c['per_prefill_step_s'] * 1e3:.2f} ms a step with prompt rows"
          f" + {c['per_decode_step_s'] * 1e3:.2f} ms a step with decode rows")
    loop = document["serving_loop"]
    if loop["num_steps"]:
        fitted = f", fitted {loop['predicted_step_s'] * 1e3:.2f} ms" if loop.get("predicted_step_s") else ""
        print(f"  + {loop['overhead_per_step_s'] * 1e3:.2f} ms/step serving loop overhead (batch-1 decode "
              f"through the async engine: {loop['num_steps']} steps of {loop['mean_step_s'] * 1e3:.2f} ms"
              f"{fitted}, a token every {loop['mean_period_s'] * 1e3:.2f} ms)")
    jitter = document["step_jitter"]
    if jitter:
        print(f"  step jitter (each repeat over its median, {jitter['num_ratios']} steps): p90 {jitter['p90']:.2f}x,"
              f" p99 {jitter['p99']:.2f}x, mean {jitter['mean']:.2f}x")
    drift = document["speed_drift"]
    if drift:
        print(f"  speed drift ({drift['num_bins']} bins of {drift['bin_s']:g} s): p10 {drift['p10']:.2f}x,"
              f" p90 {drift['p90']:.2f}x, max {drift['max']:.2f}x, mean {drift['mean']:.2f}x")
    print(f"wrote {args.out}")
    return 0


def profile(args: argparse.Namespace) -> dict:
    from kvserve.engine.core import EngineCore
    from kvserve.model.loader import load_model

    grid = ProfileGrid(tuple(args.prefill_tokens), tuple(args.decode_batch), tuple(args.context),
                       args.repeats, args.time_budget, args.seed, tuple(args.tokens))
    if args.serving_loop_requests < 0:
        raise ValueError(f"--serving-loop-requests must be >= 0, got {args.serving_loop_requests}")
    if not args.drift_seconds >= 0:
        raise ValueError(f"--drift-seconds must be >= 0, got {args.drift_seconds}")
    set_torch_threads(args.torch_threads)
    loaded = load_model(args.model, quantization=args.quantization)
    config = engine_config(args)
    core = EngineCore(loaded.config, loaded.weights, loaded.tokenizer, config)
    samples, jitter = time_engine_steps(core, grid)
    from kvserve.runner.model_runner import kv_bytes_per_block

    engine = {"kv_cache_memory_bytes": config.kv_cache_memory_bytes, "num_blocks": core.runner.num_blocks,
              "kv_bytes_per_block": kv_bytes_per_block(loaded.config, args.block_size, core.runner.kv_dtype),
              "block_size": args.block_size, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    model, stats = fit_linear_cost_model(samples, source="kvserve profile", engine=engine,
                                         token_knots=swept_tokens(samples, grid))
    loop = ServingLoopTiming(0.0, 0.0, 0)
    if args.serving_loop_requests:  # against the fitted steps: what serving adds to them
        loop = time_serving_loop(core, random.Random(grid.seed + 1), args.serving_loop_requests,
                                 step_model=model.step_time_s)
    drift = time_speed_drift(core, random.Random(grid.seed + 2), args.drift_seconds) if args.drift_seconds else None
    model = replace(model, step_jitter=tuple(jitter), serving_overhead_s=loop.overhead_per_step_s,
                    speed_drift=drift)
    about = {"model": loaded.source, "dtype": args.dtype, "device": str(core.runner.device),
             "measured_at_unix_s": time.time()}
    return profile_json(model, stats, engine, about, samples,
                        {"num_steps": loop.num_steps, "mean_step_s": loop.mean_step_s,
                         "mean_period_s": loop.mean_period_s, "predicted_step_s": loop.predicted_step_s})
