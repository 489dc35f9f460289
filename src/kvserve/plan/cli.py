"""`kvserve plan`: capacity in KV memory and context lengths, with queueing.

    kvserve plan --preset llama-3.1-8b --memory 80GiB --context-lengths 1024,4096,8192
    kvserve plan --model model.gguf --memory 2GiB --rate 5 --shift 800:6000 --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from kvserve import flags
from kvserve.config import PREFILL_WEIGHTS_CHOICES, PROMPT_TILES_AUTO_MAX_BYTES, SpeculativeConfig, parse_size
from kvserve.cpu_features import amx_bf16_available
from kvserve.model_facts.memory import dtype_bytes, kv_element_bytes, prompt_tile_bytes, weight_bytes
from kvserve.plan import kv_math, queueing
from kvserve.plan.hardware import HARDWARE, HardwareProfile, hardware_preset
from kvserve.plan.presets import PRESETS, ModelSpec, read_model_spec, resolve_model
from kvserve.plan.roofline import RooflineCostModel, StepShape

QUEUEING_NOTE = ("thinking tool: Kingman (G/G/1) and Allen-Cunneen (G/G/c) assume FCFS, "
                 "stationary arrivals and load-independent service times; batching breaks the "
                 "last one. Use them for headroom and variance, `kvserve simulate` for numbers.")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """--preset / --model and dtypes: shared with `kvserve simulate`."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", help=f"named architecture: {', '.join(PRESETS)}")
    group.add_argument("--model", help="model folder (config.json) or .gguf file; only the "
                       "config and weight-file sizes are read")
    parser.add_argument("--dtype", default=None,
                        help="weight dtype (bytes per parameter): bfloat16, float16, float32, fp8, "
                        "int8, q8_0, q4_1, int4. Default: the file size for --model, else bfloat16")
    parser.add_argument("--kv-dtype", default="bfloat16",
                        help="KV cache element dtype (bfloat16 = 2 bytes per element; int8 = 1 plus a float32 "
                        "scale per head_dim values, as `kvserve serve --kv-cache-dtype int8` holds it; `kvserve "
                        "serve` holds its KV cache in its --kv-cache-dtype: auto = bfloat16 for quantized weights "
                        "on CPU, else its --dtype)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    flags.add_block_size_argument(parser)
    parser.add_argument("--prefill-weights", default="auto", choices=PREFILL_WEIGHTS_CHOICES,
                        help="as `kvserve serve`'s: whether a quantized GGUF's layers also hold a bfloat16 copy "
                             "for prompt positions (2 bytes per layer weight, counted as weights); auto = as "
                             "`kvserve serve` would on this machine (where its CPU has AMX-BF16)")
    parser.add_argument("--memory", default=None,
                        help="device memory per device, e.g. 80GiB or 80GB; default: the "
                        "--hardware preset's memory")
    parser.add_argument("--num-devices", type=int, default=1,
                        help="devices one replica spans (tensor parallel): memory adds up, "
                        "weights are stored once across them")
    parser.add_argument("--reserve", default="10%",
                        help="memory kept back for activations, workspace and runtime context: "
                        "a percentage of memory ('10%%') or a size ('4GiB')")
    parser.add_argument("--reserve-fraction", type=float, default=None,
                        help="the reserve as a fraction of memory (0.1 = 10%%); overrides --reserve")
    parser.add_argument("--context-lengths", default="1024,4096,8192,32768",
                        help="rows of the concurrency table: total tokens per sequence (N) or "
                        "PROMPT:OUTPUT tokens, comma separated")
    parser.add_argument("--prompt-tokens", type=int, default=800,
                        help="mean prompt length in tokens for the rate and replica estimate")
    parser.add_argument("--output-tokens", type=int, default=256,
                        help="mean output length in tokens for the rate, replica and shift rows")
    parser.add_argument("--shift", default=None,
                        help="context-length shift FROM:TO in mean prompt tokens, e.g. 800:6000")
    parser.add_argument("--rate", type=float, default=None, help="target request rate in requests/s")
    parser.add_argument("--mean-service-s", type=float, default=None,
                        help="mean request service time in seconds (prefill + decode); default: "
                        "a roofline estimate on --hardware")
    parser.add_argument("--hardware", default=None,
                        help=f"accelerator for service-time estimates: {', '.join(HARDWARE)} "
                        "(default h100 when needed)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="scheduler cap on sequences per replica (batch slots)")
    parser.add_argument("--headroom", type=float, default=0.75,
                        help="target utilization ceiling per replica (0.7-0.8 typical)")
    parser.add_argument("--arrival-cv", type=float, default=1.0,
                        help="coefficient of variation of inter-arrival times (1 = Poisson)")
    parser.add_argument("--service-cv", type=float, default=1.0,
                        help="coefficient of variation of service times (LLM traffic is often > 1)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding as `kvserve serve --speculative-config` takes it; with "
                        '{"method": "draft_model", "model": PATH, ...} the draft model\'s weights (its file\'s '
                        "bytes, or --dtype) and its KV cache (as many blocks as the target's, in --kv-dtype) "
                        "come out of the memory too; prompt lookup (ngram) needs none")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


@dataclass(frozen=True)
class DraftFootprint:
    """A speculative draft model's share of the memory: its resident weights
    and its KV bytes per token (its cache holds as many blocks as the
    target's, runner/draft_model.py, so each target token costs both)."""

    spec: ModelSpec
    weight_bytes: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class Capacity:
    spec: ModelSpec
    budget: kv_math.MemoryBudget  # its weight_bytes: the target's and the draft's
    kv_bytes_per_token: int  # the target's and the draft's
    kv_capacity_tokens: int
    block_size: int
    draft: DraftFootprint | None = None

    @property
    def target_weight_bytes(self) -> int:
        return self.budget.weight_bytes - (0 if self.draft is None else self.draft.weight_bytes)


def draft_footprint(speculative_config: str | None, dtype: str | None, kv_dtype: str) -> DraftFootprint | None:
    """The draft model of a `--speculative-config` (method draft_model),
    its weights counted as a target's are (file bytes unless `dtype`); None
    for prompt lookup or no speculation."""
    config = SpeculativeConfig.parse(speculative_config)
    if config is None or config.method != "draft_model":
        return None
    assert config.model is not None
    spec = read_model_spec(Path(config.model))
    return DraftFootprint(spec, weight_bytes_of(spec, dtype),
                          spec.config.kv_bytes_per_token(kv_element_bytes(kv_dtype, spec.config.head_dim)))


def weight_bytes_of(spec: ModelSpec, dtype: str | None) -> int:
    """Exact file bytes for a model on disk unless a dtype is named."""
    if dtype is None and spec.weight_file_bytes is not None:
        return spec.weight_file_bytes
    return weight_bytes(spec.config, dtype_bytes(dtype or "bfloat16"))


def _prompt_tiles_bytes(args: argparse.Namespace, spec: ModelSpec) -> int:
    """The bfloat16 prompt tiles a server would hold beside a quantized file
    at its own bytes (`--prefill-weights`; `kvserve simulate` plans none)."""
    choice = getattr(args, "prefill_weights", "none")
    if args.dtype is not None or not spec.quantized or choice == "none":
        return 0
    tile_bytes = prompt_tile_bytes(spec.config)
    if choice == "auto" and (not amx_bf16_available() or tile_bytes > PROMPT_TILES_AUTO_MAX_BYTES):
        return 0
    return tile_bytes


def capacity(args: argparse.Namespace, spec: ModelSpec, memory_bytes: int) -> Capacity:
    reserve_fraction, reserve_bytes = _reserve(args, memory_bytes)
    draft = draft_footprint(args.speculative_config, args.dtype, args.kv_dtype)
    weights = (weight_bytes_of(spec, args.dtype) + _prompt_tiles_bytes(args, spec)
               + (0 if draft is None else draft.weight_bytes))
    budget = kv_math.memory_budget(memory_bytes, weights, reserve_fraction, reserve_bytes)
    per_token = spec.config.kv_bytes_per_token(kv_element_bytes(args.kv_dtype, spec.config.head_dim)) + (
        0 if draft is None else draft.kv_bytes_per_token)
    tokens = kv_math.kv_capacity_tokens(budget.kv_bytes, per_token, args.block_size)
    return Capacity(spec, budget, per_token, tokens, args.block_size, draft)


def _reserve(args: argparse.Namespace, memory_bytes: int) -> tuple[float, int]:
    if args.reserve_fraction is not None:
        return args.reserve_fraction, 0
    return kv_math.parse_reserve(args.reserve)


def _memory_bytes(args: argparse.Namespace) -> int:
    if args.num_devices < 1:
        raise ValueError(f"--num-devices must be >= 1, got {args.num_devices}")
    if args.memory is not None:
        per_device = parse_size(args.memory)
    elif args.hardware is not None:
        per_device = _hardware(args).memory_bytes
    else:
        raise ValueError("give --memory (e.g. 80GiB) or --hardware (h100, h200, a100, l4)")
    return per_device * args.num_devices


def _hardware(args: argparse.Namespace) -> HardwareProfile:
    return hardware_preset(args.hardware or "h100")


def service_time_estimate_s(args: argparse.Namespace, cap: Capacity, ctx: kv_math.ContextLength,
                            batch: int) -> float:
    """Roofline estimate: prefill the prompt alone, then `output` decode steps
    at `batch` sequences of this context. Optimistic (no queueing inside)."""
    model = RooflineCostModel(cap.spec.config, _hardware(args),
                              cap.target_weight_bytes / max(1, cap.spec.config.num_parameters()),
                              kv_element_bytes(args.kv_dtype, cap.spec.config.head_dim))
    p = ctx.prompt_tokens
    prefill_s = model.step_time_s(StepShape(p, 0, p, p * (p + 1) // 2))
    held = int(ctx.mean_held_tokens)
    decode_step_s = model.step_time_s(StepShape(0, batch, batch * held, batch * held))
    return prefill_s + ctx.output_tokens * decode_step_s


def build_plan(args: argparse.Namespace) -> dict:
    spec = resolve_model(args.preset, args.model)
    cap = capacity(args, spec, _memory_bytes(args))
    contexts = kv_math.parse_context_lengths(args.context_lengths)
    table = kv_math.concurrency_table(cap.kv_capacity_tokens, cap.kv_bytes_per_token, contexts,
                                      cap.block_size)
    plan = {
        "model": {"name": spec.name, "layers": spec.config.num_hidden_layers,
                  "kv_heads": spec.config.num_key_value_heads, "head_dim": spec.config.head_dim,
                  "parameters": spec.config.num_parameters()},
        "memory_bytes": cap.budget.memory_bytes, "num_devices": args.num_devices,
        "weight_bytes": cap.budget.weight_bytes, "prompt_tile_bytes": _prompt_tiles_bytes(args, spec),
        "reserve_bytes": cap.budget.reserve_bytes, "kv_cache_bytes": cap.budget.kv_bytes, "fits": cap.budget.fits,
        "kv_bytes_per_token": cap.kv_bytes_per_token, "block_size": cap.block_size,
        "kv_capacity_tokens": cap.kv_capacity_tokens, "draft_model": _draft_json(cap.draft),
        "max_concurrency": [_row_json(r) for r in table],
        "context_shift": None, "queueing": None, "replicas": None,
        "float_fallback": _float_fallback_json(args, spec, contexts),
    }
    if not cap.budget.fits:
        return plan
    plan["context_shift"] = _shift_json(args, cap) if args.shift else None
    plan["queueing"], plan["replicas"] = _queueing_json(args, cap)
    return plan


def _draft_json(draft: DraftFootprint | None) -> dict | None:
    """The draft model's share, already inside weight_bytes and kv_bytes_per_token."""
    if draft is None:
        return None
    return {"name": draft.spec.name, "parameters": draft.spec.config.num_parameters(),
            "weight_bytes": draft.weight_bytes, "kv_bytes_per_token": draft.kv_bytes_per_token}


def _float_fallback_json(args: argparse.Namespace, spec: ModelSpec, contexts) -> dict | None:
    """For a model file planned at its own bytes: the same memory with the
    weights dequantized to float32 (`kvserve serve --quantization none`, or a
    file whose types the kernels cannot compute on): the capacity a fallback
    to the unquantized weights costs (an int8 KV cache, which only the
    quantized kernels read, in bfloat16 there). None when a dtype was named
    or the model is a preset."""
    if args.dtype is not None or spec.weight_file_bytes is None:
        return None
    kv_dtype = "bfloat16" if args.kv_dtype.strip().lower() == "int8" else args.kv_dtype
    fallback = argparse.Namespace(**{**vars(args), "dtype": "float32", "kv_dtype": kv_dtype})
    cap = capacity(fallback, spec, _memory_bytes(args))
    table = kv_math.concurrency_table(cap.kv_capacity_tokens, cap.kv_bytes_per_token, contexts,
                                      cap.block_size)
    return {"dtype": "float32", "kv_dtype": kv_dtype, "weight_bytes": cap.budget.weight_bytes,
            "kv_cache_bytes": cap.budget.kv_bytes,
            "kv_capacity_tokens": cap.kv_capacity_tokens, "fits": cap.budget.fits,
            "max_concurrency": [_row_json(r) for r in table]}


def _row_json(row: kv_math.ConcurrencyRow) -> dict:
    return {"prompt_tokens": row.context.prompt_tokens, "output_tokens": row.context.output_tokens,
            "total_tokens": row.context.total_tokens,
            "kv_bytes_per_sequence": row.kv_bytes_per_sequence,
            "max_concurrency": row.max_concurrency}


def _slots(args: argparse.Namespace, cap: Capacity, ctx: kv_math.ContextLength) -> int:
    fit = kv_math.max_concurrency(cap.kv_capacity_tokens, ctx.total_tokens, cap.block_size)
    return max(1, min(args.max_num_seqs, fit))


def _mean_service_s(args: argparse.Namespace, cap: Capacity,
                    ctx: kv_math.ContextLength) -> tuple[float, str]:
    if args.mean_service_s is not None:
        if args.mean_service_s <= 0:
            raise ValueError(f"--mean-service-s must be > 0, got {args.mean_service_s}")
        return args.mean_service_s, "given"
    estimate = service_time_estimate_s(args, cap, ctx, _slots(args, cap, ctx))
    return estimate, f"roofline estimate on {_hardware(args).name} at a full batch"


def _shift_json(args: argparse.Namespace, cap: Capacity) -> dict:
    try:
        before_p, after_p = (int(x) for x in args.shift.split(":"))
    except ValueError:
        raise ValueError(f"bad --shift {args.shift!r}: use FROM:TO prompt tokens, e.g. 800:6000") from None
    before = kv_math.ContextLength(before_p, args.output_tokens)
    after = kv_math.ContextLength(after_p, args.output_tokens)
    service_before = service_after = None
    if args.rate is not None:
        service_before, _ = _mean_service_s(args, cap, before)
        # The roofline's ratio carries a given service time to the new length.
        ratio = (service_time_estimate_s(args, cap, after, _slots(args, cap, after))
                 / service_time_estimate_s(args, cap, before, _slots(args, cap, before)))
        service_after = service_before * ratio
    shift = kv_math.context_shift(cap.kv_capacity_tokens, cap.kv_bytes_per_token, before, after,
                                  args.rate, service_before, service_after, cap.block_size)
    return {"before": _row_json(shift.before), "after": _row_json(shift.after),
            "concurrency_ratio": shift.concurrency_ratio, "rate_per_s": args.rate,
            "service_s_before": service_before, "service_s_after": service_after,
            "kv_demand_tokens_before": shift.kv_demand_tokens_before,
            "kv_demand_tokens_after": shift.kv_demand_tokens_after,
            "kv_capacity_tokens": cap.kv_capacity_tokens}


def _queueing_json(args: argparse.Namespace, cap: Capacity) -> tuple[dict, dict | None]:
    ctx = kv_math.ContextLength(args.prompt_tokens, args.output_tokens)
    service_s, source = _mean_service_s(args, cap, ctx)
    curve = queueing.wait_curve(service_s, args.arrival_cv, args.service_cv)
    slots = _slots(args, cap, ctx)
    kingman = {"note": QUEUEING_NOTE, "mean_service_s": service_s, "mean_service_source": source,
               "arrival_cv": args.arrival_cv, "service_cv": args.service_cv, "slots": slots,
               "kingman_wait_s": [
                   {"utilization": u, "wait_s": w, "wait_in_service_times": w / service_s,
                    "replica_wait_s": queueing.allen_cunneen_wait_s(slots, u, service_s, args.arrival_cv,
                                                                    args.service_cv)}
                   for u, w in curve]}
    if args.rate is None:
        return kingman, None
    rp = queueing.replicas_for_rate(args.rate, service_s, _slots(args, cap, ctx), args.headroom,
                                    args.arrival_cv, args.service_cv)
    replicas = {"rate_per_s": rp.rate_per_s, "headroom": rp.headroom,
                "prompt_tokens": ctx.prompt_tokens, "output_tokens": ctx.output_tokens,
                "mean_service_s": rp.mean_service_s, "slots_per_replica": rp.slots_per_replica,
                "capacity_per_replica_per_s": rp.capacity_per_replica_per_s,
                "num_replicas": rp.num_replicas, "utilization": rp.utilization,
                "queue_wait_s_allen_cunneen": rp.queue_wait_s}
    return kingman, replicas


def run(args: argparse.Namespace) -> int:
    try:
        plan = build_plan(args)
    except ValueError as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    if not plan["fits"]:
        print("kvserve plan: weights + reserve exceed memory: nothing left for the KV cache "
              "(use more --memory / --num-devices or a smaller --dtype)", file=sys.stderr)
        return 1
    return 0


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:,.2f} GiB"


def format_plan(plan: dict) -> str:
    m = plan["model"]
    lines = [f"model {m['name']}: {m['parameters'] / 1e9:.3g}B params, {m['layers']} layers, "
             f"{m['kv_heads']} KV heads x {m['head_dim']} head dim",
             f"memory          {_gib(plan['memory_bytes'])} on {plan['num_devices']} device(s)",
             f"weights         {_gib(plan['weight_bytes'])}{_draft_share(plan, 'weight_bytes', _gib)}"
             + (f" (of which bfloat16 prompt tiles {_gib(plan['prompt_tile_bytes'])})"
                if plan.get("prompt_tile_bytes") else ""),
             f"reserve         {_gib(plan['reserve_bytes'])} (activations, workspace, runtime)",
             f"KV cache        {_gib(plan['kv_cache_bytes'])}",
             f"KV per token    {plan['kv_bytes_per_token']:,} bytes"
             f"{_draft_share(plan, 'kv_bytes_per_token', lambda n: f'{n:,} bytes')}",
             f"KV capacity     {plan['kv_capacity_tokens']:,} tokens "
             f"(blocks of {plan['block_size']})", "",
             f"{'prompt':>8} {'output':>8} {'total':>8} {'KV/seq':>12} {'max concurrent':>15}"]
    for row in plan["max_concurrency"]:
        lines.append(f"{row['prompt_tokens']:>8} {row['output_tokens']:>8} {row['total_tokens']:>8} "
                     f"{_gib(row['kv_bytes_per_sequence']):>12} {row['max_concurrency']:>15,}")
    lines += _format_fallback(plan)
    lines += _format_shift(plan["context_shift"]) + _format_queueing(plan["queueing"], plan["replicas"])
    return "\n".join(lines)


def _draft_share(plan: dict, key: str, show) -> str:
    draft = plan["draft_model"]
    return "" if draft is None else f" (draft model {draft['name']}: {show(draft[key])} of it)"


def _format_fallback(plan: dict) -> list[str]:
    fallback = plan.get("float_fallback")
    if not fallback:
        return []
    lines = ["", f"float fallback (weights dequantized to float32, --quantization none): weights "
             f"{_gib(fallback['weight_bytes'])}, KV capacity {fallback['kv_capacity_tokens']:,} tokens "
             f"in {fallback['kv_dtype']}",
             f"{'total':>8} {'file weights':>14} {'float32':>10}"]
    for ours, theirs in zip(plan["max_concurrency"], fallback["max_concurrency"]):
        lines.append(f"{ours['total_tokens']:>8} {ours['max_concurrency']:>14,} {theirs['max_concurrency']:>10,}")
    return lines


def _format_shift(shift: dict | None) -> list[str]:
    if not shift:
        return []
    b, a = shift["before"], shift["after"]
    lines = ["", f"context shift: prompt {b['prompt_tokens']} -> {a['prompt_tokens']} tokens "
             f"(output {b['output_tokens']})",
             f"  max concurrent {b['max_concurrency']:,} -> {a['max_concurrency']:,} "
             f"(x{shift['concurrency_ratio']:.3f})"]
    if shift["kv_demand_tokens_before"] is not None:
        cap = shift["kv_capacity_tokens"]
        lines.append(f"  at {shift['rate_per_s']} req/s, KV in use (Little's law) "
                     f"{shift['kv_demand_tokens_before']:,.0f} -> {shift['kv_demand_tokens_after']:,.0f} "
                     f"tokens = {shift['kv_demand_tokens_before'] / cap:.0%} -> "
                     f"{shift['kv_demand_tokens_after'] / cap:.0%} of one replica's cache")
    return lines


def _format_queueing(q: dict | None, replicas: dict | None) -> list[str]:
    if not q:
        return []
    lines = ["", f"queueing ({q['note']})",
             f"  mean service {q['mean_service_s']:.3f} s ({q['mean_service_source']}), "
             f"ca={q['arrival_cv']}, cs={q['service_cv']}",
             f"  {'utilization':>11}  {'Kingman G/G/1 wait':>22}  {'replica wait, ' + str(q['slots']) + ' slots':>22}"]
    for point in q["kingman_wait_s"]:
        lines.append(f"  {point['utilization']:>11.0%}  {point['wait_s']:>9.3f} s "
                     f"({point['wait_in_service_times']:>5.2f} x S)  {point['replica_wait_s']:>20.4f} s")
    if replicas:
        lines += ["", f"replicas for {replicas['rate_per_s']} req/s at <= {replicas['headroom']:.0%} "
                  f"utilization: {replicas['num_replicas']} "
                  f"({replicas['slots_per_replica']} slots x {replicas['mean_service_s']:.3f} s service "
                  f"= {replicas['capacity_per_replica_per_s']:.2f} req/s each; utilization "
                  f"{replicas['utilization']:.0%}, Allen-Cunneen wait "
                  f"{replicas['queue_wait_s_allen_cunneen'] * 1000:.1f} ms)"]
    return lines
