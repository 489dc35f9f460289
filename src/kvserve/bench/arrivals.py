"""When requests are sent: seeded arrival offsets in seconds from run start.

Open-loop processes (the offsets do not depend on the server's answers):
  constant                      one request every 1/rate s
  poisson                       exponential gaps, mean 1/rate
  gamma:burstiness=B            gamma gaps, mean 1/rate, CV^2 = B (shape = 1/B);
                                B = 1 is Poisson, B > 1 burstier, B < 1 smoother
  diurnal:period=P,amplitude=A  Poisson with rate(t) = rate * (1 + A sin(2 pi t / P))
  diurnal:period=P,curve=M1/M2/..
                                Poisson with rate(t) = rate * a curve of multipliers
                                spread evenly over each period (linear in between)
  step:rates=R1/R2/..,step=S    Poisson at rate R1 for S s, then R2, ... (last holds)
  ramp:start=R0,end=R1,duration=D
                                Poisson with rate rising linearly R0 -> R1 over D s
  trace                         the trace file's own timestamps (--trace)
Closed loop (`closed`, with --concurrency N) keeps N requests in flight and is a
mode of the runner, not an offset list.

Every generator owns a seeded `random.Random`; the same seed gives the same
offsets. Time-varying rates are drawn by thinning (Lewis & Shedler), which is
exact for a non-homogeneous Poisson process.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvserve.bench.workload import parse_kv

KINDS = ("constant", "poisson", "gamma", "diurnal", "step", "ramp", "trace", "closed")


@dataclass(frozen=True)
class ArrivalSpec:
    """An arrival process. rate_per_s is the mean (or base) rate; params are
    the process's own (burstiness, period, amplitude, start, end, ...)."""

    kind: str
    rate_per_s: float | None = None
    params: tuple[tuple[str, float], ...] = ()
    step_rates_per_s: tuple[float, ...] = ()
    curve: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r}; use one of {KINDS}")
        if self.kind in ("constant", "poisson", "gamma", "diurnal") and not (
                self.rate_per_s and self.rate_per_s > 0):
            raise ValueError(f"arrival {self.kind!r} needs --rate > 0 (requests/s)")
        if self.kind == "gamma" and self.param("burstiness", 1.0) <= 0:
            raise ValueError("gamma burstiness must be > 0")
        if self.kind == "diurnal" and not 0 <= self.param("amplitude", 0.5) <= 1:
            raise ValueError("diurnal amplitude must be in [0, 1]")
        if self.curve and (min(self.curve) < 0 or max(self.curve) <= 0):
            raise ValueError("diurnal curve multipliers must be >= 0 with one > 0")
        if self.kind == "step" and (not self.step_rates_per_s or min(self.step_rates_per_s) < 0
                                    or self.param("step", 0) <= 0):
            raise ValueError("step needs rates=R1/R2/... (>= 0) and step=SECONDS > 0")
        if self.kind == "ramp" and (self.param("duration", 0) <= 0 or min(
                self.param("start", 0), self.param("end", 0)) < 0):
            raise ValueError("ramp needs start=R0,end=R1 (>= 0, requests/s) and duration=SECONDS > 0")

    def param(self, name: str, default: float | None = None) -> float:
        value = dict(self.params).get(name, default)
        if value is None:
            raise ValueError(f"arrival {self.kind!r} needs {name}=")
        return value

    @property
    def is_open_loop(self) -> bool:
        return self.kind not in ("closed", "trace")


def parse_arrival(text: str, rate_per_s: float | None = None) -> ArrivalSpec:
    """'poisson', 'gamma:burstiness=4', 'ramp:start=1,end=10,duration=60', ...

    `rate_per_s` (from --rate) fills in the mean rate; a `rate=` inside the
    string wins. ramp without duration= uses 60 s.
    """
    kind, _, rest = text.strip().partition(":")
    lists: dict[str, tuple[float, ...]] = {"rates": (), "curve": ()}
    items = []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, _, value = item.partition("=")
        if key in lists:
            try:
                lists[key] = tuple(float(r) for r in value.split("/"))
            except ValueError:
                raise ValueError(f"{key} must be numbers separated by '/', got {item!r}") from None
        else:
            items.append(item)
    params = parse_kv(",".join(items))
    rate = params.pop("rate", rate_per_s)
    if kind == "ramp":
        params.setdefault("duration", 60.0)
    return ArrivalSpec(kind, rate, tuple(sorted(params.items())), lists["rates"], lists["curve"])


def arrival_offsets(spec: ArrivalSpec, num_requests: int | None = None,
                    duration_s: float | None = None, seed: int = 0) -> list[float]:
    """Send offsets (seconds from run start, non-decreasing) of an open-loop
    process: the first `num_requests`, stopping before `duration_s`.
    At least one bound is required."""
    if not spec.is_open_loop:
        raise ValueError(f"arrival {spec.kind!r} has no generated offsets")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests or duration_s (or both)")
    if duration_s is None and _final_rate(spec) <= 0:
        raise ValueError(f"arrival {spec.kind!r} ends at rate 0: give a duration")
    horizon_s = math.inf if duration_s is None else duration_s
    out: list[float] = []
    for offset in _process(spec, random.Random(f"{seed}:arrivals:{spec.kind}"), horizon_s):
        if (num_requests is not None and len(out) >= num_requests) or (
                duration_s is not None and offset >= duration_s):
            break
        out.append(offset)
    return out


def _final_rate(spec: ArrivalSpec) -> float:
    if spec.kind == "step":
        return spec.step_rates_per_s[-1]
    if spec.kind == "ramp":
        return spec.param("end")
    return spec.rate_per_s or 0.0


def _process(spec: ArrivalSpec, rng: random.Random, horizon_s: float) -> Iterator[float]:
    if spec.kind == "constant":
        return (i / spec.rate_per_s for i in range(10**12))
    if spec.kind == "poisson":
        return _renewal(lambda: rng.expovariate(spec.rate_per_s))
    if spec.kind == "gamma":
        shape = 1.0 / spec.param("burstiness", 1.0)
        scale = 1.0 / (spec.rate_per_s * shape)
        return _renewal(lambda: rng.gammavariate(shape, scale))
    rate_at, max_rate = _rate_curve(spec)
    return _thinning(rate_at, max_rate, rng, horizon_s)


def _renewal(next_gap: Callable[[], float]) -> Iterator[float]:
    now = 0.0
    while True:
        now += next_gap()
        yield now


def _rate_curve(spec: ArrivalSpec) -> tuple[Callable[[float], float], float]:
    """rate(t) in requests/s and its upper bound, for thinning."""
    if spec.kind == "diurnal" and spec.curve:
        return _curve_rate(spec.rate_per_s, spec.curve, spec.param("period", 60.0))
    if spec.kind == "diurnal":
        base, amp = spec.rate_per_s, spec.param("amplitude", 0.5)
        period = spec.param("period", 60.0)
        return (lambda t: base * (1 + amp * math.sin(2 * math.pi * t / period))), base * (1 + amp)
    if spec.kind == "step":
        rates, step = spec.step_rates_per_s, spec.param("step")
        return (lambda t: rates[min(int(t // step), len(rates) - 1)]), max(rates)
    start, end, span = spec.param("start"), spec.param("end"), spec.param("duration")
    return (lambda t: start + (end - start) * min(t / span, 1.0)), max(start, end)


def _curve_rate(base: float, curve: tuple[float, ...],
                period_s: float) -> tuple[Callable[[float], float], float]:
    """rate(t) = base x multipliers at evenly spaced points of each period,
    linear in between and wrapping from the last point back to the first."""
    points = len(curve)

    def rate_at(t: float) -> float:
        pos = (t % period_s) / period_s * points
        i = int(pos) % points
        frac = pos - int(pos)
        return base * (curve[i] + (curve[(i + 1) % points] - curve[i]) * frac)

    return rate_at, base * max(curve)


def _thinning(rate_at: Callable[[float], float], max_rate: float,
              rng: random.Random, horizon_s: float) -> Iterator[float]:
    if max_rate <= 0:
        return
    now = 0.0
    while now < horizon_s:  # a rate of 0 for the rest of the run yields nothing
        now += rng.expovariate(max_rate)
        if rng.random() * max_rate <= rate_at(now):
            yield now
