"""`kvserve simulate`: the real scheduler and admission controller on a
virtual clock, with a hardware cost model in place of the GPU.

Takes `kvserve bench`'s workload / arrival / SLO flags, `kvserve serve`'s
KV cache, batching and admission flags (kvserve/flags.py) and `kvserve
plan`'s model flags, each the same definition as there, and writes the same
report.json as `kvserve bench`.

    kvserve simulate --preset llama-3.1-8b --hardware h100 --rate 20 --num-requests 2000
    kvserve simulate --model m.gguf --hardware profile.json --rate 2 --out sim-out
    kvserve simulate --preset llama-3.1-8b --replicas 2,3,4,6 --price-per-hour 4 --breach-price 0.05 ...

With several --replicas sizes (and --price-per-hour, --breach-price) it runs
the same workload on each and prints the headroom decision (sim/headroom.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvserve import compiled, flags
from kvserve.bench import cli as bench_cli
from kvserve.bench.report import SLO, build_report, format_table, parse_slo, write_report
from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig, parse_size
from kvserve.model_facts.memory import blocks_in, kv_element_bytes, num_kv_blocks
from kvserve.plan import kv_math
from kvserve.plan.cli import add_model_arguments, draft_footprint, weight_bytes_of
from kvserve.plan.hardware import HardwareProfile
from kvserve.plan.presets import ModelSpec, resolve_model
from kvserve.plan.roofline import RooflineCostModel
from kvserve.sim.cost_model import CostModel, LinearCostModel, resolve_hardware, with_step_jitter
from kvserve.fleet.router import ROUTERS
from kvserve.sim.headroom import FleetRun, format_decision, headroom_decision
from kvserve.sim.failures import describe as describe_failures
from kvserve.sim.failures import failure_section, parse_loss, parse_slowdown
from kvserve.sim.simulator import AutoscaleConfig, SimConfig, SimResult, Simulator
from kvserve.sim.speculation import SimSpeculation

# Above this many requests a run keeps (first, last) token times per request
# instead of every token (memory), and report.json keeps every k-th request's
# row, at most this many (file size; enough for its plots).
EXACT_EVENTS_MAX_REQUESTS = 20_000
_NO_EFFECT = "accepted as `kvserve serve` takes it; no effect on a simulation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    # The very same flag definitions as `kvserve bench` and `kvserve serve`
    # (kvserve/flags.py), so they never drift.
    bench_cli.add_workload_arguments(parser.add_argument_group("workload and arrivals"))
    bench_cli.add_judgement_arguments(parser.add_argument_group("judgement and output"))
    engine = parser.add_argument_group("model and engine")
    flags.add_kv_cache_arguments(
        engine, kv_cache_memory_default=None,
        kv_cache_memory_default_text="the cache of the engine a profile JSON measured, else the "
                                     "hardware's memory (--memory) less weights and --reserve")
    flags.add_batching_arguments(engine)
    flags.add_runtime_arguments(engine, no_effect_note=_NO_EFFECT)
    flags.add_admission_arguments(parser.add_argument_group("admission (the promise)"))
    parser.set_defaults(out="sim-out", spawn=False)
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--hardware", default="h100",
                     help="accelerator preset (h100, h200, a100, l4) for a roofline cost model, or a "
                          "profile JSON from `kvserve profile` (a fitted model of this machine)")
    sim.add_argument("--memory", default=None,
                     help="device memory for sizing the KV cache when --kv-cache-memory is not given "
                          "(default: the hardware preset's), e.g. 80GB")
    sim.add_argument("--reserve", default="10%",
                     help="memory kept back from the KV cache: a percentage ('10%%') or a size")
    sim.add_argument("--compute-efficiency", type=float, default=0.5,
                     help="roofline: achieved fraction of peak FLOP/s (0..1)")
    sim.add_argument("--bandwidth-efficiency", type=float, default=0.8,
                     help="roofline: achieved fraction of peak memory bandwidth (0..1)")
    sim.add_argument("--step-overhead-ms", type=float, default=2.0,
                     help="roofline: fixed time per engine step (launches, scheduling), milliseconds")
    sim.add_argument("--frontend-latency-ms", type=float, default=0.0,
                     help="time a client sees beyond the engine per request (HTTP, parsing, streaming), "
                          "added to TTFT and E2E; kvserve bench's TTFT minus the server's "
                          "vllm:time_to_first_token_seconds measures it")
    sim.add_argument("--step-jitter", choices=("profile", "none"), default="profile",
                     help="profile: multiply each step's time by a ratio drawn from the spread `kvserve "
                          "profile` measured (each repeat over its median; seeded by --seed) and by the "
                          "machine's speed at that moment, replayed from the speed drift it measured, so "
                          "tails carry the machine's variation; none: every step takes the model's time. "
                          "Roofline presets have no measured jitter")
    sim.add_argument("--jitter-seed", type=int, default=None,
                     help="seed of the step jitter draws (default: --seed); other seeds give other "
                          "realizations of the same workload, for the spread of a simulated tail")
    sim.add_argument("--replicas", type=replica_counts, default=(1,),
                     help="replicas behind the router at start; a list (2,3,4,6) runs the same workload "
                          "on each size and prints the headroom decision (needs --price-per-hour, then "
                          "the price of one replica-hour, and --breach-price)")
    sim.add_argument("--breach-price", type=float, default=None,
                     help="price of one breached request (refused, timed out, failed or outside the SLO), "
                          "in --price-per-hour's currency: with it, report.json has `headroom_decision`")
    sim.add_argument("--router", choices=ROUTERS, default="least-queue",
                     help="how requests are spread across replicas: the gateway's policies "
                          "(kvserve.fleet.router; least-queue is least-loaded)")
    sim.add_argument("--no-admission", action="store_true",
                     help="send every request straight to the scheduler (the no-front-door baseline)")
    sim.add_argument("--no-fleet-door", action="store_true",
                     help="replicas behind a plain load balancer instead of kvserve gateway: no refusal "
                          "for the whole fleet, a replica's 429 goes to the client (default: more than one "
                          "replica runs behind the gateway's front door, kvserve.fleet.door)")
    sim.add_argument("--autoscale-max-replicas", type=int, default=None,
                     help="autoscale by kvserve's policy (fleet.autoscale, as kvserve ray), up to this many "
                          "replicas")
    sim.add_argument("--autoscale-interval", type=float, default=10.0,
                     help="seconds between autoscaling checks")
    flags.add_autoscale_arguments(sim)
    sim.add_argument("--cold-start", type=float, default=60.0,
                     help="seconds from scale-out to serving for a cold replica (load weights, warm up)")
    sim.add_argument("--warm-pool", type=int, default=0,
                     help="replicas held asleep from the start (the warm pool): woken before any new one is "
                          "started, serving after --warm-start")
    sim.add_argument("--warm-start", type=float, default=0.0,
                     help="seconds from wake-up to serving for a warm-pool replica")
    sim.add_argument("--fail-replica", type=parse_loss, action="append", default=[], metavar="INDEX@SECONDS",
                     help="failure scenario: replica INDEX (0-based, of the --replicas started with) is lost at "
                          "SECONDS: its requests not yet streaming go to another replica, streaming ones fail; "
                          "the report compares the run with the same workload without failures (repeatable)")
    sim.add_argument("--slow-replica", type=parse_slowdown, action="append", default=[],
                     metavar="INDEX:FACTOR[@SECONDS]",
                     help="failure scenario: replica INDEX's steps take FACTOR (> 1) x as long, from SECONDS "
                          "(default: throughout); the router sees its stats as they are (repeatable)")
    flags.add_speculative_arguments(sim)
    flags.add_simulated_speculation_arguments(sim)


def replica_counts(text: str) -> tuple[int, ...]:
    """'4' or '2,3,4,6' -> the fleet sizes, each >= 1, without repeats."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected replica counts like 4 or 2,3,4,6, got {text!r}") from None
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"replica counts must be distinct integers >= 1, got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        bench_cli.validate_args(args)
        if args.concurrency is not None:
            raise ValueError("simulate runs open-loop arrivals and traces; --concurrency "
                             "(closed loop) is not simulated")
        spec = resolve_model(args.preset, args.model)
        cost_model, num_blocks = cost_model_and_num_blocks(args, spec)
        config = sim_config(args, spec, num_blocks)
        if (config.losses or config.slowdowns) and (args.sweep or len(args.replicas) > 1):
            raise ValueError("failure scenarios (--fail-replica, --slow-replica) run one fleet size at one rate: "
                             "drop --sweep and give one --replicas")
        if args.sweep:
            return _run_sweep(args, config, cost_model, slo)
        if len(args.replicas) > 1 or args.breach_price is not None:
            return _run_headroom(args, config, cost_model, slo)
        report = simulate_once(args, config, cost_model, slo, args.rate, Path(args.out))
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvserve simulate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(_format_simulation(report["config"]["simulation"]))
    print(f"wrote {Path(args.out) / 'report.json'} and report.html")
    return 0


def cost_model_and_num_blocks(args: argparse.Namespace, spec: ModelSpec) -> tuple[CostModel, int]:
    """The cost model and the KV cache blocks of one replica: from
    --kv-cache-memory, else the profiled engine's cache (a profile JSON), else
    the hardware's memory less weights and reserve (a preset). A draft model
    (--speculative-config, method draft_model) takes its weights out of the
    memory and its KV out of each block, as `kvserve serve` and `plan` do;
    its compute is --spec-proposer-cost-ms."""
    hardware = resolve_hardware(args.hardware)
    weights = weight_bytes_of(spec, args.dtype)
    if isinstance(hardware, LinearCostModel):
        return hardware, _profiled_num_blocks(args, spec, dict(hardware.engine))
    model = RooflineCostModel(spec.config, hardware, weights / max(1, spec.config.num_parameters()),
                              kv_element_bytes(args.kv_dtype, spec.config.head_dim), args.compute_efficiency,
                              args.bandwidth_efficiency, args.step_overhead_ms / 1000.0)
    draft = draft_footprint(args.speculative_config, args.dtype, args.kv_dtype)
    kv_bytes = parse_size(args.kv_cache_memory) if args.kv_cache_memory else \
        _kv_bytes_from_memory(args, hardware, weights + (0 if draft is None else draft.weight_bytes))
    draft_bytes_per_block = 0 if draft is None else draft.kv_bytes_per_token * args.block_size
    return model, num_kv_blocks(kv_bytes, spec.config, args.block_size, kv_element_bytes(args.kv_dtype, spec.config.head_dim),
                                draft_bytes_per_block)


def _profiled_num_blocks(args: argparse.Namespace, spec: ModelSpec, engine: dict) -> int:
    """Blocks of the engine a profile measured: its own count, or
    --kv-cache-memory in its KV bytes per block (the profiled engine's dtype,
    not --kv-dtype)."""
    if args.kv_cache_memory is None:
        if "num_blocks" not in engine:
            raise ValueError("this profile records no KV cache size: give --kv-cache-memory")
        return int(engine["num_blocks"])
    kv_bytes = parse_size(args.kv_cache_memory)
    if "kv_bytes_per_block" not in engine:
        return num_kv_blocks(kv_bytes, spec.config, args.block_size, kv_element_bytes(args.kv_dtype, spec.config.head_dim))
    num_blocks = blocks_in(kv_bytes, int(engine["kv_bytes_per_block"]))
    if num_blocks < 1:
        raise ValueError(f"a KV cache of {kv_bytes} bytes holds no block of the profiled engine "
                         f"({engine['kv_bytes_per_block']} bytes)")
    return num_blocks


def _kv_bytes_from_memory(args: argparse.Namespace, hardware: HardwareProfile, weights: int) -> int:
    memory = parse_size(args.memory) if args.memory else hardware.memory_bytes
    fraction, extra = kv_math.parse_reserve(args.reserve)
    budget = kv_math.memory_budget(memory, weights, fraction, extra)
    if not budget.fits:
        raise ValueError(f"weights ({weights / 2**30:.1f} GiB) and reserve exceed {hardware.name}'s "
                         f"memory ({memory / 2**30:.1f} GiB); see `kvserve plan`")
    return budget.kv_bytes


def sim_config(args: argparse.Namespace, spec: ModelSpec, num_blocks: int) -> SimConfig:
    max_model_len = min(spec.config.max_position_embeddings,
                        args.max_model_len or spec.config.max_position_embeddings)
    autoscale = None
    if args.autoscale_max_replicas is not None:
        if args.autoscale_max_replicas < 1:
            raise ValueError(f"--autoscale-max-replicas must be >= 1, got {args.autoscale_max_replicas}")
        # min_replicas is the simulated fleet's own (AutoscaleConfig.policy)
        policy = flags.autoscale_config(args, 1, args.autoscale_max_replicas)
        autoscale = AutoscaleConfig(policy, args.autoscale_interval, args.cold_start, args.warm_pool,
                                    args.warm_start)
    admission = None if args.no_admission else flags.admission_config(args)
    return SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, max_model_len=max_model_len),
        cache=CacheConfig(num_blocks=num_blocks, block_size=args.block_size,
                          enable_prefix_caching=not args.no_prefix_caching),
        admission=admission, num_replicas=args.replicas[0], router=args.router, autoscale=autoscale,
        frontend_latency_s=args.frontend_latency_ms / 1000.0, speculation=sim_speculation(args),
        losses=tuple(args.fail_replica), slowdowns=tuple(args.slow_replica),
        front_door=False if args.no_fleet_door else None)


def sim_speculation(args: argparse.Namespace, seed: int | None = None) -> SimSpeculation | None:
    """--spec-acceptance-rate and friends -> the simulated speculation (None:
    off); seed: its draws' (default --seed). `kvserve simulate` and `kvserve
    serve --simulate` both read it."""
    if args.spec_acceptance_rate is None:
        if args.speculative_config is not None:
            raise ValueError("--speculative-config in a simulation needs --spec-acceptance-rate")
        return None
    config = SpeculativeConfig.parse(args.speculative_config) or SpeculativeConfig()
    return SimSpeculation(args.spec_acceptance_rate, args.spec_proposer_cost_ms / 1000.0, config,
                          args.seed if seed is None else seed)


def report_rows_every(num_requests: int) -> int:
    """k such that every k-th of `num_requests` rows is at most
    EXACT_EVENTS_MAX_REQUESTS rows."""
    return max(1, math.ceil(num_requests / EXACT_EVENTS_MAX_REQUESTS))


def simulate_once(args: argparse.Namespace, config: SimConfig, cost_model: CostModel, slo: SLO,
                  rate_per_s: float, out_dir: Path, price_per_hour: float | None = None) -> dict:
    """One simulation written to out_dir; price_per_hour: the fleet's (default
    --price-per-hour). With failure scenarios, the same workload without them
    too (out_dir/baseline/), and the report's `failure_scenarios` compares the
    two."""
    plan = bench_cli.plan_requests(args, rate_per_s)
    exact = len(plan.specs) <= EXACT_EVENTS_MAX_REQUESTS
    config = replace(config, exact_token_events=exact)
    report, result = _simulate_and_report(args, config, cost_model, slo, plan, price_per_hour)
    if config.losses or config.slowdowns:
        baseline_config = replace(config, losses=(), slowdowns=())
        baseline, baseline_result = _simulate_and_report(args, baseline_config, cost_model, slo, plan,
                                                         price_per_hour)
        write_report(baseline, out_dir / "baseline")
        report["failure_scenarios"] = failure_section(
            config.losses, config.slowdowns, slo,
            (baseline["summary"], baseline_result.records, baseline_result.replicas, baseline_result.num_rerouted),
            (report["summary"], result.records, result.replicas, result.num_rerouted), len(plan.specs))
    write_report(report, out_dir)
    return report


def _simulate_and_report(args: argparse.Namespace, config: SimConfig, cost_model: CostModel, slo: SLO, plan,
                         price_per_hour: float | None) -> tuple[dict, SimResult]:
    # Fresh draws for every run: a sweep's rates (and a failure run and its
    # baseline) do not depend on each other.
    cost_model = with_step_jitter(cost_model, args.step_jitter,
                                  args.seed if args.jitter_seed is None else args.jitter_seed)
    wall_start = time.perf_counter()
    result = Simulator(config, cost_model).run(plan.specs, plan.offsets_s)
    wall_s = time.perf_counter() - wall_start
    exact = config.exact_token_events
    run_config = bench_cli.jsonable({k: v for k, v in vars(args).items()})
    run_config["simulation"] = {
        "cost_model": cost_model.describe(), "num_blocks": config.cache.num_blocks,
        "block_size": config.cache.block_size, "admission": config.admission is not None,
        "router": config.router, "replicas": result.replicas,
        "replica_timeline": [list(p) for p in result.replica_timeline],
        "num_steps": result.num_steps, "simulated_s": result.duration_s, "wall_s": wall_s,
        "exact_token_events": exact, "requests_sampled_every": 1, "requests_omitted": 0,
        "failures": describe_failures(config.losses, config.slowdowns), "num_rerouted": result.num_rerouted,
        "front_door": {"on": config.has_front_door(), "refused": result.num_door_refused,
                       "resent_on_429": result.num_door_resent},
        "core": compiled.status()["core"]}
    rows_every = report_rows_every(len(result.records))
    if rows_every > 1:
        run_config["simulation"]["requests_sampled_every"] = rows_every
        run_config["simulation"]["requests_omitted"] = len(result.records) - len(result.records[::rows_every])
    price = args.price_per_hour if price_per_hour is None else price_per_hour
    report = build_report(result.records, slo, price_per_hour=price, config=run_config, rows_every=rows_every)
    bench_cli.add_capacity_sections(report, result.records, slo, args.task_size,
                                    _stated_energy(args.watts, config.num_replicas, result.duration_s), None)
    return report, result


def _stated_energy(watts_per_replica: float | None, num_replicas: int, duration_s: float) -> dict | None:
    """A simulation has no counters: energy is --watts per replica x simulated time."""
    if watts_per_replica is None:
        return None
    return {"wall_s": duration_s, "server_pid": None, "server_cpu_s": None, "server_cpu_utilization": None,
            "gpu_utilization": None, "energy_j": watts_per_replica * num_replicas * duration_s,
            "energy_source": f"stated {watts_per_replica:g} W per replica x {num_replicas}"}


def _run_sweep(args: argparse.Namespace, config: SimConfig, cost_model: CostModel, slo: SLO) -> int:
    from kvserve.bench.sweep import run_sweep_to_dir

    out = Path(args.out)

    def run_at(rate: float) -> dict:
        return simulate_once(args, config, cost_model, slo, rate, out / f"rate_{rate:.4g}")

    run_sweep_to_dir(run_at, out, slo.name, args.sweep_start_rate, args.sweep_max_runs,
                     args.sweep_tolerance, note="simulated; ")
    return 0


def _run_headroom(args: argparse.Namespace, config: SimConfig, cost_model: CostModel, slo: SLO) -> int:
    """The same workload on each fleet size (out/replicas_N/), then the
    decision: printed, and in out/report.json (the recommended size's report
    with `headroom_decision`)."""
    if args.price_per_hour is None or args.breach_price is None:
        raise ValueError("the headroom decision needs --price-per-hour (one replica-hour) and --breach-price")
    if args.autoscale_max_replicas is not None:
        raise ValueError("the headroom decision compares fixed fleet sizes: drop --autoscale-max-replicas")
    out = Path(args.out)
    reports, runs = {}, []
    for num_replicas in sorted(args.replicas):
        report = simulate_once(args, replace(config, num_replicas=num_replicas), cost_model, slo, args.rate,
                               out / f"replicas_{num_replicas}", args.price_per_hour * num_replicas)
        s = report["summary"]
        reports[num_replicas] = report
        runs.append(FleetRun(num_replicas, s["duration_s"], s["num_requests"] - s["outcomes"]["cancelled"],
                             s["num_good"] or 0))
        print(f"{num_replicas} replica(s): {_format_simulation(report['config']['simulation'])}")
    decision = headroom_decision(runs, args.price_per_hour, args.breach_price)
    best = dict(reports[decision["recommended_replicas"]], headroom_decision=decision)
    write_report(best, out)
    print(format_decision(decision))
    print(f"wrote {out / 'report.json'} (headroom_decision; the recommended size's report) and "
          f"{out}/replicas_N/ for each size")
    return 0


def _door_text(door: dict) -> str:
    if not door["on"]:
        return ""
    return f", front door: {door['refused']} refused there, {door['resent_on_429']} replicas' 429s sent on"


def _format_simulation(sim: dict) -> str:
    replicas = sim["replicas"]
    preemptions = sum(r["num_preemptions"] for r in replicas)
    hits = sum(r["prefix_cache_hits"] for r in replicas)
    queries = sum(r["prefix_cache_queries"] for r in replicas)
    kind = sim["cost_model"]["kind"]
    return (f"simulated {sim['simulated_s']:.1f} s on {len(replicas)} replica(s) "
            f"({kind} cost model, {sim['num_blocks']} KV blocks each, router {sim['router']}, "
            f"admission {'on' if sim['admission'] else 'off'}{_door_text(sim['front_door'])}) "
            f"in {sim['wall_s']:.1f} s wall "
            f"(core: {sim['core']}): "
            f"{sim['num_steps']} steps, {preemptions} preemptions, prefix hits "
            f"{hits / queries if queries else 0:.1%} of prompt tokens")
