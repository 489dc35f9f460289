"""`kvserve bench`: load-test any OpenAI-compatible server against an SLO.

Writes DIR/report.json (schema: docs/bench.md) and DIR/report.html, and
prints a table. With --sweep, runs a bounded capacity search instead and
writes DIR/sweep.json plus one report per rate under DIR/rate_<R>/.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from kvserve.bench.arrivals import ArrivalSpec, arrival_offsets, parse_arrival
from kvserve.bench.capacity import ResourceMeter, per_unit, startup_summary, task_summary
from kvserve.bench.client import ClientConfig, run_load, run_sync
from kvserve.bench.prompts import PromptBuilder, load_tokenizer
from kvserve.bench.report import SLO, build_report, format_table, parse_slo, write_report
from kvserve.bench.sweep import run_sweep_to_dir
from kvserve.bench.workload import (RequestSpec, WorkloadSpec, generate_requests, iter_requests,
                                    load_trace, parse_length_classes, parse_weights,
                                    requests_from_trace)

DEFAULT_NUM_REQUESTS = 100
SPAWN_NUM_REQUESTS = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # `kvserve simulate` adds the workload and judgement groups through the
    # same public functions, so both commands take identical flags.
    _target_arguments(parser.add_argument_group("target server"))
    add_workload_arguments(parser.add_argument_group("workload and arrivals"))
    _client_arguments(parser.add_argument_group("client behaviour"))
    add_judgement_arguments(parser.add_argument_group("judgement and output"))


def _target_arguments(target) -> None:
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server root URL (a trailing /v1 is accepted)")
    target.add_argument("--model", default=None,
                        help="model name to send; default: the first id of GET /v1/models")
    target.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="POST /v1/completions or /v1/chat/completions (streamed)")
    target.add_argument("--spawn", action="store_true",
                        help="start `kvserve serve` (default model) on a free 127.0.0.1 port, "
                             "run against it, stop it after")
    target.add_argument("--spawn-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for the spawned `kvserve serve` (repeatable)")
    target.add_argument("--spawn-timeout", type=float, default=300.0,
                        help="seconds to wait for the spawned server's GET /ready")
    target.add_argument("--server-pid", type=int, default=None,
                        help="pid of the server process (on this machine) whose CPU use the report "
                             "states; --spawn knows its own")
    # Read from the environment only at run time, so --help never prints a key.
    target.add_argument("--api-key", default=None,
                        help="API key for every request (Authorization: Bearer); "
                             "default $OPENAI_API_KEY")
    target.add_argument("--api-keys", default=None,
                        help="per-tenant keys: 'tenant=key,...' or a file of tenant=key lines")


def add_workload_arguments(load) -> None:
    load.add_argument("--workload", default=None,
                      help="length mix: chat | rag | codegen | mixed | short, "
                           "'prompt=DIST;output=DIST' (DIST: fixed:N, uniform:min=A,max=B, "
                           "normal:mean=M,std=S, lognormal:median=M,sigma=S, table:V=W,...; "
                           "optional min=,max= bounds) or table:FILE.csv; tokens. "
                           "Default chat (short with --spawn)")
    load.add_argument("--arrival", default=None,
                      help="arrival process: constant | poisson | gamma:burstiness=B | "
                           "diurnal:period=S,amplitude=A | diurnal:period=S,curve=M1/M2/.. | "
                           "step:rates=R1/R2/..,step=S | "
                           "ramp:start=R0,end=R1,duration=S | closed (needs --concurrency); "
                           "rates in requests/s, times in s. Default poisson "
                           "(closed with --concurrency)")
    load.add_argument("--rate", type=float, default=1.0,
                      help="mean arrival rate, requests/s (open-loop processes)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: keep this many requests in flight")
    load.add_argument("--num-requests", type=int, default=None,
                      help=f"number of requests (default {DEFAULT_NUM_REQUESTS}, "
                           f"{SPAWN_NUM_REQUESTS} with --spawn, unless --duration or --trace)")
    load.add_argument("--duration", type=float, default=None,
                      help="stop sending after this many seconds")
    load.add_argument("--trace", default=None,
                      help="replay a JSONL/CSV trace (timestamp s, input_tokens, "
                           "output_tokens[, tenant, priority]) with its own timing")
    load.add_argument("--tenants", default=None,
                      help="tenant mix 'name:weight,...' (keys from --api-keys)")
    load.add_argument("--priorities", default=None,
                      help="priority mix 'priority:weight,...' (lower = more urgent); "
                           "sent as body `priority`")
    load.add_argument("--features", default=None,
                      help="request feature mix 'feature:weight,...' of plain, json (a json_schema "
                           "response_format) and tools (a named tool call; chat endpoint); the report "
                           "splits by it (by_feature)")
    load.add_argument("--prefix-groups", type=int, default=0,
                      help="number of shared-prefix groups (exercises prefix caching)")
    load.add_argument("--prefix-tokens", type=int, default=0,
                      help="shared prefix length of each group, tokens")
    load.add_argument("--prefix-share", type=float, default=0.0,
                      help="fraction of requests that belong to a prefix group (0..1)")
    load.add_argument("--cancel-rate", type=float, default=0.0,
                      help="fraction of requests the client cancels (disconnects) (0..1)")
    load.add_argument("--cancel-after", default="0.5,2.0",
                      help="'LOW,HIGH': cancel delay drawn uniformly, seconds after sending")
    load.add_argument("--seed", type=int, default=0, help="seed of every random source")
    load.add_argument("--tokenizer", default=None,
                      help="local tokenizer.json, .gguf file or model folder for exact prompt lengths; "
                           "default: one common word per token (approximation, docs/bench.md)")


def _client_arguments(client) -> None:
    client.add_argument("--timeout", type=float, default=300.0,
                        help="per-request limit from first send to end, seconds")
    client.add_argument("--retries", type=int, default=0,
                        help="max retries per request on 429/503 (honours Retry-After); 0 = off")
    client.add_argument("--retry-budget", type=float, default=0.2,
                        help="client retry budget: retries <= this x requests + 5")
    client.add_argument("--no-vllm-extensions", action="store_true",
                        help="do not send ignore_eos / min_tokens (for strict OpenAI servers)")
    client.add_argument("--logprobs", action="store_true",
                        help="request logprobs so multi-token chunks are counted exactly")
    client.add_argument("--metrics-interval", type=float, default=1.0,
                        help="seconds between scrapes of the server's /metrics")
    client.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    client.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_judgement_arguments(judge) -> None:
    judge.add_argument("--slo", default="mlperf-server",
                       help="mlperf-server (TTFT<=2s, TPOT<=0.1s at p99) | mlperf-interactive "
                            "(0.5s, 0.03s) | 'ttft=S,tpot=S[,e2e=S][,p=99]' (seconds)")
    judge.add_argument("--price-per-hour", type=float, default=None,
                       help="price of the serving hardware per hour (any currency) for cost fields")
    judge.add_argument("--watts", type=float, default=None,
                       help="power of the serving hardware (watts) for the energy figures where no RAPL "
                            "counter is readable")
    judge.add_argument("--task-size", type=int, default=None,
                       help="requests per task (consecutive indexes, e.g. the turns of a conversation): "
                            "a task succeeds when all of its requests do; the report states cost and "
                            "energy per successful task")
    judge.add_argument("--out", default="bench-out", help="output directory")
    judge.add_argument("--sweep", action="store_true",
                       help="capacity search on --arrival's rate (default poisson) instead of one run")
    judge.add_argument("--sweep-start-rate", type=float, default=1.0,
                       help="first rate of the search, requests/s")
    judge.add_argument("--sweep-max-runs", type=int, default=8, help="most runs of the search")
    judge.add_argument("--sweep-tolerance", type=float, default=0.1,
                       help="stop bisecting when the interval is this fraction of its low end")


@dataclass(frozen=True)
class Plan:
    """Everything one run needs, resolved from the flags."""

    specs: list[RequestSpec] | Iterator[RequestSpec]  # an iterator: closed loop by duration
    offsets_s: list[float] | None
    concurrency: int | None
    duration_s: float | None
    arrival: ArrivalSpec | None


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        validate_args(args)
        builder = _prompt_builder(args)
        plan = None if args.sweep else plan_requests(args, args.rate)
        with _server(args) as server:
            config = _client_config(args, server.base_url)
            if args.sweep:
                return _run_sweep(args, config, builder, slo, server)
            report = _run_once(args, config, builder, slo, plan, Path(args.out), server)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"kvserve bench: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    for warning in report["client"].get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {Path(args.out) / 'report.json'} and report.html")
    return 0


def validate_args(args: argparse.Namespace) -> None:
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.duration is not None and args.duration <= 0:
        raise ValueError("--duration must be > 0 seconds")
    if args.concurrency is not None and args.arrival not in (None, "closed"):
        raise ValueError("--concurrency selects the closed loop; drop --arrival or use closed")
    if args.arrival == "closed" and args.concurrency is None:
        raise ValueError("--arrival closed needs --concurrency N")
    if args.sweep and (args.concurrency is not None or args.trace):
        raise ValueError("--sweep searches an open-loop rate: no --concurrency or --trace")
    if args.features and "tools" in args.features and args.endpoint != "chat":
        raise ValueError("--features with tools needs --endpoint chat (completions take no tools)")


def _client_config(args: argparse.Namespace, base_url: str) -> ClientConfig:
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    config = ClientConfig(
        base_url=base_url, model=args.model, endpoint=args.endpoint, timeout_s=args.timeout,
        max_retries=args.retries, retry_budget_ratio=args.retry_budget, api_key=api_key,
        api_keys=_api_keys(args.api_keys), send_priority=args.priorities is not None,
        vllm_extensions=not args.no_vllm_extensions, request_logprobs=args.logprobs,
        metrics_interval_s=args.metrics_interval, scrape_metrics=not args.no_metrics,
        progress=not args.no_progress, seed=args.seed)
    if config.model is None:
        config = replace(config, model=_first_model(config.root_url, api_key))
    return config


def _api_keys(text: str | None) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    source = Path(text).read_text() if Path(text).is_file() else text.replace(",", "\n")
    pairs = []
    for line in filter(None, (s.strip() for s in source.splitlines())):
        tenant, sep, key = line.partition("=")
        if not sep or not key:
            raise ValueError(f"--api-keys entries must be tenant=key, got {line!r}")
        pairs.append((tenant.strip(), key.strip()))
    return tuple(pairs)


VERSION_HEADERS = ("x-kvserve-model-revision", "x-kvserve-tokenizer-hash", "x-kvserve-chat-template-hash",
                   "server")


def server_versions(root_url: str, api_key: str | None) -> dict[str, str]:
    """The versions a server states on GET /v1/models (kvserve's version
    headers; any server's `server` header); {} when it states none."""
    request = urllib.request.Request(root_url + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return {name: resp.headers[name] for name in VERSION_HEADERS if resp.headers.get(name)}
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _first_model(root_url: str, api_key: str | None) -> str | None:
    request = urllib.request.Request(root_url + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            data = json.load(resp).get("data") or []
        return data[0]["id"] if data else None
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return None  # the server may not list models; send no model name


def _prompt_builder(args: argparse.Namespace) -> PromptBuilder:
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    return PromptBuilder(tokenizer, seed=args.seed)


def _workload(args: argparse.Namespace) -> WorkloadSpec:
    default = "short" if args.spawn else "chat"
    cancel = tuple(float(x) for x in args.cancel_after.split(","))
    if len(cancel) != 2:
        raise ValueError("--cancel-after must be 'LOW,HIGH' seconds")
    return WorkloadSpec(
        classes=parse_length_classes(args.workload or default),
        tenants=parse_weights(args.tenants) if args.tenants else (("default", 1.0),),
        priorities=parse_weights(args.priorities, int) if args.priorities else ((0, 1.0),),
        num_prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens,
        prefix_share=args.prefix_share, cancel_rate=args.cancel_rate, cancel_after_s=cancel,
        features=parse_weights(args.features) if args.features else (("plain", 1.0),))


def plan_requests(args: argparse.Namespace, rate_per_s: float) -> Plan:
    """Specs and their send schedule for one run at `rate_per_s`."""
    workload = _workload(args)
    num = args.num_requests
    if num is None and args.duration is None and not args.trace:
        num = SPAWN_NUM_REQUESTS if args.spawn else DEFAULT_NUM_REQUESTS
    if args.trace:
        rows = load_trace(args.trace)[:num]
        specs = requests_from_trace(rows, workload.cancel_rate, workload.cancel_after_s, args.seed)
        start = rows[0].timestamp_s if rows else 0.0
        offsets = [r.timestamp_s - start for r in rows]
        if args.duration is not None:
            offsets = [o for o in offsets if o < args.duration]
        return Plan(specs[:len(offsets)], offsets, None, args.duration, None)
    if args.concurrency is not None:
        # A duration-bounded closed loop draws specs until the time is up.
        specs = (generate_requests(workload, num, args.seed) if num is not None
                 else iter_requests(workload, args.seed))
        return Plan(specs, None, args.concurrency, args.duration, None)
    arrival = parse_arrival(args.arrival or "poisson", rate_per_s)
    offsets = arrival_offsets(arrival, num, args.duration, args.seed)
    return Plan(generate_requests(workload, len(offsets), args.seed), offsets, None,
                args.duration, arrival)


def _run_once(args: argparse.Namespace, config: ClientConfig, builder: PromptBuilder,
              slo: SLO, plan: Plan, out_dir: Path, server: "Target") -> dict:
    meter = ResourceMeter(server.pid if server.pid is not None else args.server_pid, args.watts)
    meter.start()
    result = run_sync(run_load(config, plan.specs, builder.build, plan.offsets_s,
                                  plan.concurrency, plan.duration_s))
    resources = meter.stop()
    run_config = {k: v for k, v in vars(args).items() if k != "api_key" and k != "api_keys"}
    run_config.update(base_url=config.base_url, model=config.model,
                      server_versions=server_versions(config.root_url, config.api_key),
                      arrival=plan.arrival.__dict__ if plan.arrival else None,
                      exact_prompt_lengths=builder.exact,
                      wall_start_unix_s=result.wall_start_unix_s)
    run_config["arrival"] = jsonable(run_config["arrival"])
    report = build_report(result.records, slo, price_per_hour=args.price_per_hour,
                          metrics_samples=result.metrics_samples, config=run_config,
                          client_stats=result.client_stats)
    add_capacity_sections(report, result.records, slo, args.task_size, resources, server.time_to_ready_s)
    write_report(report, out_dir)
    return report


def add_capacity_sections(report: dict, records, slo: SLO, task_size: int | None, resources: dict | None,
                          time_to_ready_s: float | None) -> None:
    """report.json's resources, tasks, per-unit cost and energy, and startup
    sections (bench/capacity.py); simulate adds the same."""
    tasks = task_summary(records, task_size, slo) if task_size else None
    report["resources"] = resources
    report["tasks"] = tasks
    report["per_unit"] = per_unit(report["summary"], resources, tasks)
    report["startup"] = startup_summary(records, time_to_ready_s)


def jsonable(value):
    return json.loads(json.dumps(value, default=str))


def _run_sweep(args: argparse.Namespace, config: ClientConfig, builder: PromptBuilder,
               slo: SLO, server: "Target") -> int:
    out = Path(args.out)

    def run_at(rate: float) -> dict:
        print(f"--- rate {rate:.3g} req/s", file=sys.stderr)
        # Each rate its own prompts (prefix groups shared): the runs do not hit each other's cached prompts.
        return _run_once(args, config, builder.for_run(f"rate {rate:.4g}"), slo, plan_requests(args, rate),
                         out / f"rate_{rate:.4g}", server)

    run_sweep_to_dir(run_at, out, slo.name, args.sweep_start_rate, args.sweep_max_runs,
                     args.sweep_tolerance)
    return 0


# --- --spawn -------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for spawning a local server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Target:
    """The server a run measures: its URL and, when this run started it, its
    pid and how long it took to become ready (a cold start)."""

    base_url: str
    pid: int | None = None
    time_to_ready_s: float | None = None


@contextmanager
def _server(args: argparse.Namespace):
    """Yields the Target; with --spawn, a `kvserve serve` started here."""
    if not args.spawn:
        yield Target(args.base_url)
        return
    port = free_port()
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *args.spawn_arg]
    print(f"spawning: {' '.join(command)}", file=sys.stderr)
    started = time.monotonic()
    process = subprocess.Popen(command)
    try:
        wait_ready(f"http://127.0.0.1:{port}", process, args.spawn_timeout)
        yield Target(f"http://127.0.0.1:{port}", process.pid, time.monotonic() - started)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /ready of a spawned server; RuntimeError if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"spawned server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/ready", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"spawned server not ready after {timeout_s:.0f} s")
