"""What each request of a load test asks for, in token counts only.

A workload is a weighted mix of length classes (each a prompt-length and an
output-length distribution), a tenant mix, a priority mix, a feature mix
(plain requests, structured outputs, tool calls: `REQUEST_FEATURES`), optional
shared-prefix groups (to exercise prefix caching) and a share of requests the
client cancels after a delay. `generate_requests` turns it into a seeded list
of `RequestSpec`s. Prompt TEXT is synthesized later, only by the HTTP client
(`bench/prompts.py`), so the simulator can use the same specs with no
tokenizer.

Length distribution strings (for `--workload "prompt=...;output=..."`):
  fixed:128
  uniform:min=64,max=512
  normal:mean=256,std=64[,min=1,max=4096]
  lognormal:median=256,sigma=0.8[,min=1,max=4096]
  table:128=3,512=1            (value=weight pairs)
A joint empirical table is a CSV file with columns prompt_tokens,
output_tokens[,weight]: `--workload table:lengths.csv`.
"""

from __future__ import annotations

import bisect
import csv
import dataclasses
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.gc_pause import cyclic_gc_paused


# What a request asks for beyond its lengths: "plain" text, "json" (a
# response_format json_schema) or "tools" (a named tool call, chat only).
REQUEST_FEATURES = ("plain", "json", "tools")


@dataclass(frozen=True)
class PrefixGroup:
    """Requests of one group start with the same `prefix_tokens` tokens."""

    group_id: int
    prefix_tokens: int


@dataclass(frozen=True)
class RequestSpec:
    """One request of a load test. prompt_tokens includes any shared prefix."""

    index: int
    prompt_tokens: int
    output_tokens: int
    tenant: str = "default"
    priority: int = 0
    prefix_group: PrefixGroup | None = None
    cancel_after_s: float | None = None
    feature: str = "plain"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts; `sample` always returns an int >= 1."""

    kind: str
    params: tuple[tuple[str, float], ...] = ()
    # Empirical tables: values and their weights.
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _SAMPLERS:
            raise ValueError(f"unknown length distribution {self.kind!r}; "
                             f"use one of {sorted(_SAMPLERS)}")
        # The params as a dict, built once (sample() reads several per
        # request); not a field, so equality and hashing are unchanged.
        object.__setattr__(self, "_params", dict(self.params))
        object.__setattr__(self, "_bounds", (self.param("min", 1.0), self.param("max", math.inf)))

    def param(self, name: str, default: float | None = None) -> float:
        value = self._params.get(name, default)
        if value is None:
            raise ValueError(f"length distribution {self.kind!r} needs {name}=")
        return value

    def sample(self, rng: random.Random) -> int:
        raw = _SAMPLERS[self.kind](self, rng)
        lo, hi = self._bounds
        return max(1, int(round(min(max(raw, lo), hi))))


def _fixed(dist: LengthDist, rng: random.Random) -> float:
    return dist.param("value")


def _uniform(dist: LengthDist, rng: random.Random) -> float:
    return rng.randint(int(dist.param("min")), int(dist.param("max")))


def _normal(dist: LengthDist, rng: random.Random) -> float:
    return rng.gauss(dist.param("mean"), dist.param("std"))


def _lognormal(dist: LengthDist, rng: random.Random) -> float:
    return rng.lognormvariate(math.log(dist.param("median")), dist.param("sigma"))


def _table(dist: LengthDist, rng: random.Random) -> float:
    return rng.choices(dist.values, weights=dist.weights)[0]


_SAMPLERS = {"fixed": _fixed, "uniform": _uniform, "normal": _normal,
             "lognormal": _lognormal, "table": _table}


@dataclass(frozen=True)
class LengthClass:
    """A joint (prompt, output) length class with its share of the mix."""

    name: str
    weight: float
    prompt: LengthDist
    output: LengthDist


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that decides what the requests ask for (not when they come).

    prefix_share: fraction of requests that belong to one of
      `num_prefix_groups` groups sharing a `prefix_tokens`-token prefix.
    cancel_rate: fraction of requests the client abandons after a delay drawn
      uniformly from `cancel_after_s` (seconds after sending).
    features: the weighted mix of REQUEST_FEATURES.
    """

    classes: tuple[LengthClass, ...]
    tenants: tuple[tuple[str, float], ...] = (("default", 1.0),)
    priorities: tuple[tuple[int, float], ...] = ((0, 1.0),)
    num_prefix_groups: int = 0
    prefix_tokens: int = 0
    prefix_share: float = 0.0
    cancel_rate: float = 0.0
    cancel_after_s: tuple[float, float] = (0.5, 2.0)
    features: tuple[tuple[str, float], ...] = (("plain", 1.0),)

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a workload needs at least one length class")
        unknown = [f for f, _ in self.features if f not in REQUEST_FEATURES]
        if unknown:
            raise ValueError(f"unknown request features {unknown}; use {', '.join(REQUEST_FEATURES)}")
        for label, mix in (("length class", [c.weight for c in self.classes]),
                           ("tenant", [w for _, w in self.tenants]),
                           ("priority", [w for _, w in self.priorities]),
                           ("feature", [w for _, w in self.features])):
            if not mix or min(mix) < 0 or sum(mix) <= 0:
                raise ValueError(f"{label} weights must be >= 0 with a positive sum, got {mix}")
        if not 0.0 <= self.prefix_share <= 1.0 or not 0.0 <= self.cancel_rate <= 1.0:
            raise ValueError("prefix_share and cancel_rate must be in [0, 1]")
        if self.prefix_share > 0 and (self.num_prefix_groups < 1 or self.prefix_tokens < 1):
            raise ValueError("prefix_share > 0 needs num_prefix_groups >= 1 and prefix_tokens >= 1")
        lo, hi = self.cancel_after_s
        if not 0.0 <= lo <= hi:
            raise ValueError(f"cancel_after_s must be 0 <= low <= high, got {self.cancel_after_s}")


def generate_requests(spec: WorkloadSpec, num_requests: int, seed: int = 0) -> list[RequestSpec]:
    """`num_requests` seeded request specs; the same seed gives the same list."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    with cyclic_gc_paused():  # an hour's 180k specs: ~25% faster
        return list(itertools.islice(iter_requests(spec, seed), num_requests))


def iter_requests(spec: WorkloadSpec, seed: int = 0) -> Iterator[RequestSpec]:
    """The same seeded specs as `generate_requests`, without end (for runs
    bounded by time, not count)."""
    # One RNG per random source, so changing e.g. the tenant mix does not
    # reshuffle the lengths of an otherwise identical run.
    rng_len = random.Random(f"{seed}:lengths")
    rng_mix = random.Random(f"{seed}:classes")
    rng_feature = random.Random(f"{seed}:features")
    mixes = _Mixes(spec)
    for i in itertools.count():
        request = _one_request(spec, mixes, i, rng_len, rng_mix)
        if len(spec.features) > 1:
            request = dataclasses.replace(request, feature=mixes.features.draw(rng_feature))
        elif spec.features[0][0] != "plain":
            request = dataclasses.replace(request, feature=spec.features[0][0])
        yield request


class _Mixes:
    """A workload's weighted choices, each drawn as random.choices(population,
    weights)[0] draws it: one rng.random() scaled by the total weight,
    bisected into the cumulative weights (computed once, not per request)."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.classes = _WeightedChoice(spec.classes, [c.weight for c in spec.classes])
        self.tenants = _WeightedChoice([t for t, _ in spec.tenants], [w for _, w in spec.tenants])
        self.priorities = _WeightedChoice([p for p, _ in spec.priorities], [w for _, w in spec.priorities])
        self.features = _WeightedChoice([f for f, _ in spec.features], [w for _, w in spec.features])


class _WeightedChoice:
    def __init__(self, population, weights) -> None:
        self.population = list(population)
        self.cum_weights = list(itertools.accumulate(weights))
        self.total = self.cum_weights[-1] + 0.0
        if not self.total > 0.0 or not math.isfinite(self.total):
            raise ValueError(f"weights must sum to a finite number > 0, got {list(weights)}")

    def draw(self, rng: random.Random):
        # random.choices' own arithmetic (tests/test_bench_workload.py pins it).
        return self.population[bisect.bisect(self.cum_weights, rng.random() * self.total,
                                             0, len(self.population) - 1)]


def _one_request(spec: WorkloadSpec, mixes: _Mixes, index: int, rng_len: random.Random,
                 rng_mix: random.Random) -> RequestSpec:
    cls = mixes.classes.draw(rng_mix)
    prompt_tokens = cls.prompt.sample(rng_len)
    output_tokens = cls.output.sample(rng_len)
    tenant = mixes.tenants.draw(rng_mix)
    priority = mixes.priorities.draw(rng_mix)
    group = None
    if spec.prefix_share > 0 and rng_mix.random() < spec.prefix_share:
        group = PrefixGroup(rng_mix.randrange(spec.num_prefix_groups), spec.prefix_tokens)
        # The prefix is part of the prompt; keep at least one token of its own.
        prompt_tokens = max(prompt_tokens, spec.prefix_tokens + 1)
    cancel_after = None
    if spec.cancel_rate > 0 and rng_mix.random() < spec.cancel_rate:
        cancel_after = rng_mix.uniform(*spec.cancel_after_s)
    return RequestSpec(index, prompt_tokens, output_tokens, tenant, priority, group, cancel_after)


# --- parsing -----------------------------------------------------------------

def parse_kv(text: str) -> dict[str, float]:
    """'a=1,b=2.5' -> {'a': 1.0, 'b': 2.5}; a clear error on anything else."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"expected key=number, got {item!r} in {text!r}") from None
    return out


def parse_length_dist(text: str) -> LengthDist:
    """Parse 'fixed:128', 'uniform:min=1,max=9', 'table:128=3,512=1', ..."""
    kind, _, rest = text.strip().partition(":")
    if kind not in _SAMPLERS:
        raise ValueError(f"unknown length distribution {kind!r} in {text!r}; "
                         f"use one of {sorted(_SAMPLERS)}")
    if kind == "fixed":
        try:
            return LengthDist("fixed", (("value", float(rest)),))
        except ValueError:
            raise ValueError(f"fixed length needs a number, e.g. fixed:128, got {text!r}") from None
    if kind == "table":
        table = parse_kv(rest)
        if not table:
            raise ValueError(f"table needs value=weight pairs, got {text!r}")
        return LengthDist("table", values=tuple(int(float(v)) for v in table),
                          weights=tuple(table.values()))
    params = parse_kv(rest)
    dist = LengthDist(kind, tuple(params.items()))
    dist.sample(random.Random(0))  # fail now on missing parameters, not mid-run
    return dist


def _lognormal_class(name: str, weight: float, prompt: tuple, output: tuple) -> LengthClass:
    def dist(median: float, sigma: float, lo: float, hi: float) -> LengthDist:
        return LengthDist("lognormal", (("median", median), ("sigma", sigma),
                                        ("min", lo), ("max", hi)))
    return LengthClass(name, weight, dist(*prompt), dist(*output))


# Shapes follow public chat / RAG / code traces qualitatively: chat is short
# in and out, RAG is long-prompt short-answer, codegen is long-answer.
NAMED_MIXES: dict[str, tuple[LengthClass, ...]] = {
    "chat": (_lognormal_class("chat", 1.0, (256, 0.8, 16, 2048), (192, 0.6, 8, 1024)),),
    "rag": (_lognormal_class("rag", 1.0, (1536, 0.4, 256, 4096), (96, 0.5, 16, 512)),),
    "codegen": (_lognormal_class("codegen", 1.0, (384, 0.6, 32, 2048), (768, 0.5, 128, 2048)),),
    "short": (LengthClass("short", 1.0, LengthDist("uniform", (("min", 16), ("max", 64))),
                          LengthDist("uniform", (("min", 8), ("max", 32)))),),
}
NAMED_MIXES["mixed"] = (
    _lognormal_class("chat", 0.6, (256, 0.8, 16, 2048), (192, 0.6, 8, 1024)),
    _lognormal_class("rag", 0.25, (1536, 0.4, 256, 4096), (96, 0.5, 16, 512)),
    _lognormal_class("codegen", 0.15, (384, 0.6, 32, 2048), (768, 0.5, 128, 2048)),
)


def parse_length_classes(text: str) -> tuple[LengthClass, ...]:
    """A named mix, 'prompt=DIST;output=DIST', or 'table:FILE.csv' (joint)."""
    text = text.strip()
    if text in NAMED_MIXES:
        return NAMED_MIXES[text]
    if text.startswith("table:") and Path(text[6:]).suffix == ".csv":
        return _joint_table(Path(text[6:]))
    parts = dict(p.split("=", 1) for p in text.split(";") if "=" in p)
    if set(parts) != {"prompt", "output"}:
        raise ValueError(f"unknown workload {text!r}: use one of {sorted(NAMED_MIXES)}, "
                         "'prompt=DIST;output=DIST' or 'table:FILE.csv'")
    return (LengthClass("custom", 1.0, parse_length_dist(parts["prompt"]),
                        parse_length_dist(parts["output"])),)


def _joint_table(path: Path) -> tuple[LengthClass, ...]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows or not {"prompt_tokens", "output_tokens"} <= set(rows[0]):
        raise ValueError(f"{path}: need CSV columns prompt_tokens,output_tokens[,weight]")
    return tuple(
        LengthClass(f"row{i}", float(row.get("weight") or 1.0),
                    LengthDist("fixed", (("value", float(row["prompt_tokens"])),)),
                    LengthDist("fixed", (("value", float(row["output_tokens"])),)))
        for i, row in enumerate(rows))


def parse_weights(text: str, cast=str) -> tuple[tuple, ...]:
    """'alice:3,bob:1' -> (('alice', 3.0), ('bob', 1.0)); weight defaults to 1."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, weight = item.partition(":")
        try:
            out.append((cast(name), float(weight) if weight else 1.0))
        except ValueError:
            raise ValueError(f"expected NAME[:WEIGHT], got {item!r} in {text!r}") from None
    if not out:
        raise ValueError(f"empty mix {text!r}")
    return tuple(out)


# --- traces ------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRow:
    """One recorded request: when it came (seconds) and its token counts."""

    timestamp_s: float
    prompt_tokens: int
    output_tokens: int
    tenant: str = "default"
    priority: int = 0
    extra: dict = field(default_factory=dict, compare=False)


_TIME_KEYS = ("timestamp", "timestamp_s", "time", "arrival_time")
_INPUT_KEYS = ("input_tokens", "prompt_tokens", "input_length", "num_input_tokens")
_OUTPUT_KEYS = ("output_tokens", "completion_tokens", "output_length", "num_output_tokens")


def load_trace(path: str | Path) -> list[TraceRow]:
    """Rows of a JSONL or CSV trace, sorted by time.

    Columns: timestamp (seconds; also timestamp_ms), input_tokens (or
    prompt_tokens), output_tokens, optional tenant and priority.
    """
    path = Path(path)
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        raw = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".csv":
        with path.open(newline="") as handle:
            raw = list(csv.DictReader(handle))
    else:
        raise ValueError(f"{path}: trace must be .jsonl or .csv")
    rows = [_trace_row(path, i, item) for i, item in enumerate(raw)]
    return sorted(rows, key=lambda r: r.timestamp_s)


def _pick(item: dict, keys: tuple[str, ...]):
    return next((item[k] for k in keys if item.get(k) not in (None, "")), None)


def _trace_row(path: Path, line: int, item: dict) -> TraceRow:
    when = _pick(item, _TIME_KEYS)
    if when is None and item.get("timestamp_ms") not in (None, ""):
        when = float(item["timestamp_ms"]) / 1000.0
    prompt, output = _pick(item, _INPUT_KEYS), _pick(item, _OUTPUT_KEYS)
    if when is None or prompt is None or output is None:
        raise ValueError(f"{path} row {line}: need timestamp, input_tokens and output_tokens")
    return TraceRow(float(when), max(1, int(float(prompt))), max(1, int(float(output))),
                    str(item.get("tenant") or "default"), int(float(item.get("priority") or 0)))


def requests_from_trace(rows: list[TraceRow], cancel_rate: float = 0.0,
                        cancel_after_s: tuple[float, float] = (0.5, 2.0),
                        seed: int = 0) -> list[RequestSpec]:
    """Request specs that replay a trace's token counts, tenants and priorities."""
    rng = random.Random(f"{seed}:trace-cancel")
    specs = []
    for i, row in enumerate(rows):
        cancel = rng.uniform(*cancel_after_s) if cancel_rate and rng.random() < cancel_rate else None
        specs.append(RequestSpec(i, row.prompt_tokens, row.output_tokens, row.tenant,
                                 row.priority, None, cancel))
    return specs
