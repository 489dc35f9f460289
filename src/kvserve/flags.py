"""The command-line flags several commands share, each defined once.

`kvserve serve`, `kvserve profile` and `kvserve generate` run the engine;
`kvserve simulate` runs the same scheduler and admission controller on a
virtual clock. They take the same engine, KV cache and admission flags, from
the groups below, with one default each: the defaults of the frozen configs
in kvserve/config.py (`CacheConfig`, `SchedulerConfig`, `AdmissionConfig`)
and `DEFAULT_KV_CACHE_MEMORY`. `kvserve ray` and `kvserve simulate` take
the autoscaling policy's flags (fleet.autoscale.AutoscaleConfig) from one
group too. Only `admission_config` and `autoscale_config` map flags to a
config here; flags -> `EngineConfig` is engine/cli.py's `engine_config`
(the engine side, where torch may be imported).

Torch-free and server-free: the simulator and planner import it.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol

from kvserve.config import (DEFAULT_KV_CACHE_MEMORY, KV_CACHE_DTYPE_CHOICES, PREFILL_WEIGHTS_CHOICES,
                            QUANTIZATION_CHOICES, AdmissionConfig, CacheConfig, SchedulerConfig)
from kvserve.fleet.autoscale import AutoscaleConfig


class ArgumentTarget(Protocol):
    """An ArgumentParser or one of its argument groups."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action: ...


# The configs' own defaults are the flags' defaults (num_blocks has none:
# it comes from --kv-cache-memory).
_CACHE = CacheConfig(num_blocks=1)
_SCHEDULER = SchedulerConfig()
_ADMISSION = AdmissionConfig()
DTYPES = ("float32", "bfloat16")
DEFAULT_DTYPE = "float32"


def add_model_arguments(group: ArgumentTarget) -> None:
    """The model an engine loads and where it runs."""
    group.add_argument("--model", default=None,
                       help="a *.gguf file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default=DEFAULT_DTYPE, choices=DTYPES,
                       help="weight and activation dtype (and the KV cache's, unless --kv-cache-dtype)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                       help="the KV cache's element type: auto = bfloat16 where the weights are computed "
                            "quantized on CPU, else --dtype; bfloat16 with float32 activations holds twice the "
                            "tokens in the same --kv-cache-memory and reads half the bytes per decoded token "
                            "(K/V rounded to bfloat16 when written); int8 = each head's K or V row of a token as "
                            "int8 with a float32 scale (1.88x bfloat16's tokens for the default model, its large "
                            "decode steps ~1.1x faster; the native CPU kernels only: a quantized model on CPU)")
    group.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                       help="what the weights are computed in: auto = a GGUF's own Q8_0/Q4_0/Q4_1 blocks, kept "
                            "quantized in memory (CPU kernels; other files: --dtype); none = dequantized to "
                            "--dtype (the float path); q8_0/q4_0/q4_1 = every matrix requantized to that type "
                            "at load (Q4 keeps the embedding table in Q8_0). A speculative draft model is computed the same way")
    group.add_argument("--prefill-weights", default="auto", choices=PREFILL_WEIGHTS_CHOICES,
                       help="what a quantized model computes prompt positions on: auto = a bfloat16 copy of each "
                            "layer's matrices on the AMX-BF16 tiles, and the prompt's attention on them too, where "
                            "the CPU has them and the copy takes at most 1 GiB (prefill 1.6-2.3x faster; +2 bytes per "
                            "layer weight resident, reported at start-up), else the quantized kernels; bf16 = that "
                            "copy whatever its size, or refuse to start; none = the quantized kernels and row-by-row "
                            "attention, as decode. A step's matmuls take the copy for all its rows, generated ones "
                            "too, where it has 32 rows or more, and none under that (too few to pay for streaming "
                            "the copy); --batch-invariant changes that rule")
    group.add_argument("--batch-invariant", action="store_true",
                       help="a request's tokens the same alone or in any batch: with the bfloat16 copy above, its "
                            "prompt positions always take the copy and its generated tokens never do, however "
                            "many rows a step has (slower under load: decode rows stream the quantized weights "
                            "beside a prompt's chunk, and small prompt chunks stream the copy)")
    group.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


def add_block_size_argument(group: ArgumentTarget) -> None:
    group.add_argument("--block-size", type=int, default=_CACHE.block_size,
                       help="KV cache block size (tokens per block)")


def add_kv_cache_arguments(group: ArgumentTarget, *, kv_cache_memory_default: str | None = DEFAULT_KV_CACHE_MEMORY,
                           kv_cache_memory_default_text: str | None = None) -> None:
    """The paged KV cache. `kv_cache_memory_default_text` says what a
    command does without --kv-cache-memory when it has no fixed default."""
    help_text = ("KV cache size in bytes with a unit (e.g. 512MiB, 2GiB); with a speculative draft model, "
                 "both models' caches (as many blocks each, split by bytes per block)")
    if kv_cache_memory_default_text is not None:
        help_text += f"; default: {kv_cache_memory_default_text}"
    group.add_argument("--kv-cache-memory", default=kv_cache_memory_default, help=help_text)
    add_block_size_argument(group)
    group.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")


def add_batching_arguments(group: ArgumentTarget) -> None:
    """What one engine step may hold."""
    group.add_argument("--max-num-seqs", type=int, default=_SCHEDULER.max_num_seqs,
                       help="most sequences in one engine step (sequences); admission may lower it")
    group.add_argument("--max-num-batched-tokens", type=int, default=_SCHEDULER.max_num_batched_tokens,
                       help="token budget of one forward pass (tokens)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (tokens; default: the model's context)")


def add_runtime_arguments(group: ArgumentTarget, *, no_effect_note: str | None = None) -> None:
    """How the forward pass runs on this machine. `no_effect_note` marks
    them as accepted without effect (a simulation takes serve's flags as they are)."""
    note = f" ({no_effect_note})" if no_effect_note else ""
    group.add_argument("--enforce-eager", action="store_true",
                       help="run decode steps eagerly instead of replaying CUDA graphs (graphs are used on "
                            "CUDA only; they cut a small model's decode step to its kernels' time)" + note)
    group.add_argument("--torch-threads", type=int, default=None,
                       help="torch intra-op CPU threads (default: torch's choice); on a small shared CPU, "
                            "1 avoids oversubscription with the HTTP thread" + note)


def add_speculative_arguments(group: ArgumentTarget) -> None:
    """Speculative decoding (config.SpeculativeConfig), as vLLM's JSON."""
    group.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding as JSON with vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (prompt lookup in the request\'s own tokens) or '
             '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model with the '
             'same vocabulary). When not to speculate: a request speculates in a step decoding b sequences '
             'while its measured acceptance rate (EWMA of accepted / proposed drafts) is at least '
             'b m / (b m + 1 - m), m = "min_acceptance_rate" (default 0.25): the break-even where a step of n '
             'rows costs about W + n r and a draft costs a row and brings the rate in tokens; on a CPU '
             '4 drafts cost ~2x a batch-1 decode step (W ~ 3 r), so the bar is 0.25, 0.40, 0.57, 0.73, 0.84 at '
             'batch 1, 2, 4, 8, 16 (chat answers accept 0.30-0.40, answers that copy the prompt ~0.83). Below '
             'it, a probe of one draft "probe_interval_steps" (default 16) steps after its last verification, '
             'the wait doubling after each failed probe (up to 16x) and reset by one that recovers the rate. '
             'No request speculates in a step decoding more than "disable_by_batch_size" sequences (default '
             'null: no limit), nor one with a grammar, penalties or logit_bias')


def add_simulated_speculation_arguments(group: ArgumentTarget) -> None:
    """What a simulation knows of speculation instead of a proposer (sim/speculation.SimSpeculation):
    `kvserve simulate` and `kvserve serve --simulate`."""
    group.add_argument("--spec-acceptance-rate", type=float, default=None,
                       help="simulate speculative decoding (--speculative-config's k and policy; ngram by "
                            "default): each draft is accepted with this probability (0..1) given the ones "
                            "before it were; kvserve bench's server acceptance figures measure it")
    group.add_argument("--spec-proposer-cost-ms", type=float, default=0.0,
                       help="with --spec-acceptance-rate: proposer time per draft position per step "
                            "(milliseconds; a draft model's decode step, ~0 for prompt lookup)")


def add_admission_arguments(group: ArgumentTarget) -> None:
    """The promise the front door defends and its limits (AdmissionConfig)."""
    a = _ADMISSION
    group.add_argument("--ttft-slo", type=float, default=a.ttft_slo_s, help="time-to-first-token target (seconds)")
    group.add_argument("--tpot-slo", type=float, default=a.tpot_slo_s,
                       help="time-per-output-token target (seconds); caps the running batch to keep it")
    group.add_argument("--max-queue-wait", type=float, default=a.max_queue_wait_s,
                       help="refuse (429 + Retry-After) when the expected queue wait exceeds this (seconds)")
    group.add_argument("--deferred-max-queue-wait", type=float, default=a.deferred_max_queue_wait_s,
                       help="the same limit for deferred classes: priority > 0 or service_tier=flex (seconds)")
    group.add_argument("--queue-timeout", type=float, default=a.queue_timeout_s,
                       help="abort with 503 an admitted request that has not started after this (seconds)")
    group.add_argument("--max-queue-len", type=int, default=a.max_queue_len,
                       help="most requests waiting to start (requests)")
    group.add_argument("--default-max-tokens", type=int, default=a.default_max_tokens,
                       help="max_tokens for requests that omit it, echoed in x-kvserve-max-tokens (tokens)")
    group.add_argument("--require-max-tokens", "--strict", action="store_true",
                       help="refuse (400) requests without max_tokens instead of applying the default")
    group.add_argument("--retry-budget", type=float, default=a.retry_budget,
                       help="retries allowed per admitted request (fraction; 0.1 = at most ~10%%)")
    group.add_argument("--degrade-wait", type=float, default=a.degrade_wait_s,
                       help="above this expected wait, cap max_tokens instead of refusing (seconds; off by default)")
    group.add_argument("--degrade-max-tokens", type=int, default=a.degrade_max_tokens,
                       help="the max_tokens cap applied when degrading (tokens)")


def admission_config(args: argparse.Namespace) -> AdmissionConfig:
    """The admission group's flags -> AdmissionConfig (validated there)."""
    return AdmissionConfig(
        max_queue_wait_s=args.max_queue_wait, deferred_max_queue_wait_s=args.deferred_max_queue_wait,
        queue_timeout_s=args.queue_timeout, max_queue_len=args.max_queue_len,
        default_max_tokens=args.default_max_tokens, require_max_tokens=args.require_max_tokens,
        ttft_slo_s=args.ttft_slo, tpot_slo_s=args.tpot_slo, retry_budget=args.retry_budget,
        degrade_wait_s=args.degrade_wait, degrade_max_tokens=args.degrade_max_tokens)


_AUTOSCALE = AutoscaleConfig()


def add_autoscale_arguments(group: ArgumentTarget) -> None:
    """The autoscaling policy's targets and timing (fleet.autoscale.AutoscaleConfig),
    for `kvserve ray` and `kvserve simulate`. Each also answers to its
    shorter name (`--queue-wait-target`: kvserve ray's, and the keys of a
    Ray Serve config file)."""
    a = _AUTOSCALE
    group.add_argument("--autoscale-queue-wait-target", "--queue-wait-target", type=float,
                       default=a.queue_wait_target_s, help="autoscaling: the p95 queue wait to hold (seconds)")
    group.add_argument("--autoscale-kv-target", "--kv-target", type=float, default=a.kv_target,
                       help="autoscaling: the mean KV usage to stay under (fraction)")
    group.add_argument("--autoscale-look-back", "--look-back", type=float, default=a.look_back_s,
                       help="autoscaling: the window of the queue-wait p95 (seconds)")
    group.add_argument("--autoscale-scale-down-delay", "--scale-down-delay", type=float,
                       default=a.scale_down_delay_s,
                       help="autoscaling: how long the fleet must look over-provisioned before a replica "
                            "drains and leaves (seconds)")


def autoscale_config(args: argparse.Namespace, min_replicas: int, max_replicas: int) -> AutoscaleConfig:
    """The autoscale group's flags and the fleet's bounds -> the policy's
    config (ValueError from its validation)."""
    return AutoscaleConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                           queue_wait_target_s=args.autoscale_queue_wait_target,
                           kv_target=args.autoscale_kv_target, look_back_s=args.autoscale_look_back,
                           scale_down_delay_s=args.autoscale_scale_down_delay)
