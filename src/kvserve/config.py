"""Frozen configuration dataclasses, validated once at construction.

Sizes accept human strings ("2GiB", "512MiB", "1.5GB") through `parse_size`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
# The KV cache an engine gets unless told otherwise: `kvserve serve`,
# `profile`, `generate`, `EngineConfig` and `LLM` (kvserve/flags.py).
DEFAULT_KV_CACHE_MEMORY = "1GiB"
# What the weights are computed in (`--quantization`, model/quantized.py):
# auto = a GGUF's own quantized blocks, none = the float path, else one type.
QUANTIZATION_CHOICES = ("auto", "none", "q8_0", "q4_0", "q4_1")
# What a quantized model computes prompt positions on (`--prefill-weights`,
# model/quantized.py): auto = bfloat16 prompt tiles where the CPU has
# AMX-BF16, bf16 = those or refuse, none = the quantized kernels as decode.
PREFILL_WEIGHTS_CHOICES = ("auto", "bf16", "none")
# The KV cache's element type (`--kv-cache-dtype`, vLLM's flag): auto =
# bfloat16 for a model computed on quantized weights on CPU, else the
# activations' `--dtype` (runner/model_runner.auto_kv_cache_dtype); int8 =
# each head's K or V row of a token as int8 with a float32 scale (the native
# CPU attention only: model_facts/memory.kv_element_bytes).
KV_CACHE_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "int8")
# "auto" takes the prompt tiles only up to this many bytes: a small model's
# copy is cheap (the default model's: 0.2 GiB), an 8B model's (~14 GiB) is
# not what an operator expects by default (`--prefill-weights bf16` asks).
PROMPT_TILES_AUTO_MAX_BYTES = 1 << 30


def parse_size(value: str | int | float) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB", "4096" or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {value!r}: use a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB, e.g. '2GiB')")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` token slots each."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the waiting-queue policy.

    max_num_batched_tokens: token budget of one forward pass (prefill chunks
      plus one token per decoding sequence).
    max_num_seqs: most sequences in one step (the running batch cap).
    max_model_len: longest sequence (prompt + output) in tokens.
    aging_s_per_priority: a waiting request gains one priority class of
      urgency for each this many seconds it waits, so nothing starves.
    max_loras: most distinct LoRA adapters among running requests (the
      runner's resident slots); None: no limit (no adapters served).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    aging_s_per_priority: float = 10.0
    max_loras: int | None = None

    def __post_init__(self) -> None:
        _check(self.max_num_batched_tokens >= 1,
               f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(self.aging_s_per_priority > 0,
               f"aging_s_per_priority must be > 0, got {self.aging_s_per_priority}")
        _check(self.max_loras is None or self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")


@dataclass(frozen=True)
class AdmissionConfig:
    """The front door's promise and limits (see admission/controller.py).

    Times are seconds, sizes are tokens unless named otherwise.
    max_queue_wait_s: a request whose expected wait for KV / a batch slot is
      above this is refused (429 + Retry-After) instead of queued; while it
      is below ttft_slo_s, so is an interactive one (priority <= 0) whose
      wait plus its own prompt's expected prefill would pass ttft_slo_s.
      1.5 s by default, three quarters of the default TTFT target (the rest
      for the estimate's error and a short prompt's prefill): at 1.0 s the
      default model refused 3-5% of Poisson arrivals at 3-3.5 req/s whose admitted TTFT
      p99 was 1.2-1.3 s, and capacity at the MLPerf-server promise was 2.75
      req/s; at 1.5 s it is 3.75 req/s with TTFT p99 0.43-0.99 s and no
      refusal (vs_peers.py --points sweep, 2026-12-02).
    deferred_max_queue_wait_s: the same limit for deferred classes (priority
      > 0, e.g. service_tier "flex"), which accept a longer wait.
    queue_timeout_s: a request admitted but not started within this is aborted
      (503); a request's own deadline can make it shorter.
    max_queue_len: most admitted requests waiting to start.
    default_max_tokens: cap used when a request omits max_tokens (echoed back);
      require_max_tokens refuses such requests instead.
    ttft_slo_s / tpot_slo_s: the promise; tpot_slo_s also caps the running
      batch so the measured decode step time stays inside it.
    retry_budget: retry tokens earned per admission (0.1 = retries may be at
      most ~10% of admissions); retry_budget_burst: the bucket's size.
    degrade_wait_s: above this expected queueing (the wait beyond the
      measured latency of being scheduled at all), cap max_tokens to
      degrade_max_tokens instead of refusing (None disables degradation).
    drain_window_s: time constant of the measured drain rate (EWMA).
    """

    max_queue_wait_s: float = 1.5
    deferred_max_queue_wait_s: float = 8.0
    queue_timeout_s: float = 30.0
    max_queue_len: int = 256
    default_max_tokens: int = 256
    require_max_tokens: bool = False
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.1
    retry_budget: float = 0.1
    retry_budget_burst: float = 5.0
    degrade_wait_s: float | None = None
    degrade_max_tokens: int = 64
    drain_window_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_queue_wait_s", "deferred_max_queue_wait_s", "queue_timeout_s",
                     "ttft_slo_s", "tpot_slo_s", "drain_window_s"):
            value = getattr(self, name)
            _check(value > 0, f"{name} must be > 0 seconds, got {value}")
        _check(self.max_queue_len >= 1, f"max_queue_len must be >= 1, got {self.max_queue_len}")
        _check(self.default_max_tokens >= 1,
               f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        _check(self.retry_budget >= 0, f"retry_budget must be >= 0, got {self.retry_budget}")
        _check(self.retry_budget_burst >= 1,
               f"retry_budget_burst must be >= 1, got {self.retry_budget_burst}")
        _check(self.degrade_wait_s is None or self.degrade_wait_s >= 0,
               f"degrade_wait_s must be >= 0 or None, got {self.degrade_wait_s}")
        _check(self.degrade_max_tokens >= 1,
               f"degrade_max_tokens must be >= 1, got {self.degrade_max_tokens}")

    def max_wait_s(self, priority: int) -> float:
        """A class's queue-wait limit: deferred classes (priority > 0) wait
        longer (a replica's admission and the gateway's fleet refusal)."""
        return self.deferred_max_queue_wait_s if priority > 0 else self.max_queue_wait_s


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP face: where it listens and how it treats slow or leaving clients.

    stream_stall_timeout_s: a connection whose reader takes no response bytes
      for this long while some are waiting is aborted (and its request with
      it), so a silent client cannot hold a running slot and its KV.
    shutdown_grace_s: on SIGTERM, in-flight requests get this long to finish
      before they are aborted.
    max_body_bytes: larger request bodies get 413.
    warm_up: before /ready, time engine steps on throwaway requests so the
      admission controller's step-time fit exists before the first request.
    auth_metrics_and_docs: with API keys, /metrics and the API docs
      (/openapi.json, /docs, /redoc) need a key too; off by default, so
      scrapers and schema tools work unchanged. /health and /ready never do.
    max_n: the most choices (`n`) one request may ask for; each is an engine
      request of its own, admitted and charged as such.
    otlp_traces_endpoint: where request traces go (OTLP; None: no tracing,
      no cost).
    request_log / log_prompts: one JSON line per finished request on the
      `kvserve.requests` logger; with log_prompts, its prompt and output text.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "kvserve"
    api_keys_path: str | None = None
    stream_stall_timeout_s: float = 30.0
    shutdown_grace_s: float = 30.0
    max_body_bytes: int = 4 * 2**20
    warm_up: bool = True
    auth_metrics_and_docs: bool = False
    max_n: int = 8
    otlp_traces_endpoint: str | None = None
    request_log: bool = False
    log_prompts: bool = False

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}")
        _check(bool(self.served_model_name), "served_model_name must not be empty")
        _check(self.stream_stall_timeout_s > 0,
               f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}")
        _check(self.shutdown_grace_s >= 0,
               f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        _check(self.max_body_bytes >= 1024,
               f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        _check(self.max_n >= 1, f"max_n must be >= 1, got {self.max_n}")


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, under vLLM's `speculative_config` keys.

    method: "ngram" (prompt lookup: the tokens that followed the latest
      earlier occurrence of the request's last n tokens, n from
      prompt_lookup_max down to prompt_lookup_min, in its prompt and output)
      or "draft_model" (`model`: a smaller model with the target's vocabulary).
    num_speculative_tokens: draft tokens proposed per request per step (k);
      each speculating request asks the step for 1 + k tokens.
    min_acceptance_rate: the acceptance a request needs to speculate at
      batch 1; in a step decoding b sequences it needs
      b m / (b m + 1 - m) (m this rate), the break-even of a step costing
      about W + n r for n rows: a draft costs a row r and brings its
      request's rate in tokens, which pays from b r / (W + b r) (k cancels);
      m = r / (W + r). Below it a request only probes with one draft: the
      first `probe_interval_steps` steps after its last verification, the
      wait doubling after each failed probe, up to 16x (0 disables the rule;
      scheduler/speculation.py).
    disable_by_batch_size: no request speculates in a step that decodes more
      than this many sequences (vLLM's key; None: no limit).
    The defaults are measured on the default model on a CPU with k = 4
    (benchmarks/speculative.py, output tokens per process CPU second over
    speculation off; docs/performance.md). Verifying 4 drafts of one
    sequence costs ~2x a decode step, so W ~ 3 r and m = 0.25: the bar is
    0.25, 0.40, 0.57, 0.73, 0.84 at batch 1, 2, 4, 8, 16. It keeps chat (an
    answer that does not repeat its prompt, acceptance 0.30-0.40) from
    speculating from batch 2, where the batch-1 bar alone lost 0.94x, 0.92x,
    0.87x at 2, 4, 8, and a copying answer (0.83) speculating up to batch 8:
    measured, the copying answer 1.56x, 1.18x, 1.12x at batch 2, 4, 8 (the
    batch-1 cut-off: 1.04x, 0.98x, 1.05x) and chat 0.97-1.01x; so no
    batch-size limit by default.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.25
    probe_interval_steps: int = 16

    def __post_init__(self) -> None:
        _check(self.method in SPECULATIVE_METHODS,
               f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        _check(1 <= self.num_speculative_tokens <= 16,
               f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
               f"and {self.prompt_lookup_max}")
        _check(self.method != "draft_model" or bool(self.model),
               'method "draft_model" needs "model": the draft model\'s path')
        _check(self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
               f"disable_by_batch_size must be >= 1 or null, got {self.disable_by_batch_size}")
        _check(0.0 <= self.min_acceptance_rate < 1.0,
               f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate}")
        _check(self.probe_interval_steps >= 1,
               f"probe_interval_steps must be >= 1, got {self.probe_interval_steps}")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from JSON text (`--speculative-config`), a dict
        (`LLM(speculative_config=)`), a config, or None. Unknown keys are an
        error naming them, so a typo is not silently ignored."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _check(not unknown, f"unknown speculative config keys {unknown}; known: {sorted(known)}")
        try:
            return cls(**value)
        except TypeError as e:
            raise ValueError(f"bad speculative config: {e}") from None
