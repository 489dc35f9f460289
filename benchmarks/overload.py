"""Overload: does admission keep goodput from collapsing above capacity?

    python benchmarks/overload.py                      # spawns `kvserve serve` on a random model
    python benchmarks/overload.py --base-url http://127.0.0.1:8000 --model-name M

1. capacity: a closed loop of max-num-seqs clients (a full batch, no queue)
   for --capacity-s seconds; capacity = completed requests per second.
2. for each multiple of capacity in --rates: Poisson arrivals for --duration-s
   seconds, every request streamed with no retries; print goodput (requests
   per second inside TTFT <= --ttft-slo and TPOT <= --tpot-slo), p50 / p99
   TTFT and TPOT of admitted requests, and the share refused.
3. --compare-no-admission: the same rates against a server whose admission
   is opened up (no queue-wait limit, no queue bound), to show the collapse.
4. --compare-tracing: the same rates with request tracing off and on
   (`--otlp-traces-endpoint` to an OTLP/HTTP sink in this process that
   counts what it receives), alternating for --rounds rounds, side by side;
   JSON to benchmarks/results/overload_tracing.json.

Latencies use kvserve.latency (the one definition). Token times come from
per-token logprobs in the stream (logprobs=0), so they are exact. The client
runs in its own process; JSON goes to benchmarks/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp

from kvserve.bench.cli import free_port
from kvserve.latency import derive_latency, summarize

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "overload.json"
OPEN_ADMISSION = ["--max-queue-wait", "1000000", "--deferred-max-queue-wait", "1000000",
                  "--max-queue-len", "1000000", "--queue-timeout", "1000000"]


# ---- a random-weight model to serve (no downloads) ---------------------------

def random_model_folder(folder: Path, hidden: int, layers: int) -> Path:
    """A Llama with random weights and a 256-token byte-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=hidden // 32, num_key_value_heads=2,
                         max_position_embeddings=2048, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({}))
    return folder


def spawn_server(model: str, port: int, serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", "bench", *serve_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    import urllib.request
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


# ---- the client ----------------------------------------------------------------

async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """Stream one completion; raw times relative to send."""
    sent = time.perf_counter()
    events: list[tuple[float, int]] = []
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                payload = await resp.json(content_type=None)
                return {"status": resp.status, "reason": (payload.get("error") or {}).get("code")}
            if not body.get("stream"):
                payload = await resp.json()
                return {"status": 200, "ttft_s": None, "tpot_s": None,
                        "tokens": payload["usage"]["completion_tokens"]}
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("logprobs"):
                    events.append((time.perf_counter() - sent, len(chunk["choices"][0]["logprobs"]["tokens"])))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"status": 0, "reason": type(exc).__name__}
    lat = derive_latency(0.0, events, time.perf_counter() - sent)
    return {"status": 200, "ttft_s": lat.ttft_s, "tpot_s": lat.tpot_s, "tokens": lat.num_output_tokens}


def request_body(args, rng: random.Random) -> dict:
    prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.prompt_tokens))
    return {"model": args.model_name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0}


async def measure_capacity(args, url: str) -> float:
    rng = random.Random(1)
    done = 0
    deadline = time.perf_counter() + args.capacity_s

    async def worker(session):
        nonlocal done
        while time.perf_counter() < deadline:
            result = await one_request(session, url, request_body(args, rng))
            if result["status"] == 200:
                done += 1
            else:
                await asyncio.sleep(0.05)

    start = time.perf_counter()
    async with _session(args) as session:
        # One client per batch slot: the batch stays full and nobody queues.
        await asyncio.gather(*(worker(session) for _ in range(args.max_num_seqs)))
    return done / (time.perf_counter() - start)


async def run_rate(args, url: str, rate_per_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    async with _session(args) as session:
        start = time.perf_counter()
        t = rng.expovariate(rate_per_s)
        while t < args.duration_s:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, url, request_body(args, rng))))
            t += rng.expovariate(rate_per_s)
        done, pending = await asyncio.wait(tasks, timeout=args.drain_timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
    results = [t.result() for t in done]
    results += [{"status": 0, "reason": "client_timeout"}] * len(pending)
    return results


def _session(args) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=args.drain_timeout_s))


def summarize_rate(args, multiple: float, rate: float, results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    good = [r for r in ok if r["ttft_s"] is not None and r["ttft_s"] <= args.ttft_slo
            and (r["tpot_s"] is None or r["tpot_s"] <= args.tpot_slo)]
    ttft, tpot = summarize(r["ttft_s"] for r in ok), summarize(r["tpot_s"] for r in ok)
    reasons: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            key = f"{r['status']}:{r.get('reason')}"
            reasons[key] = reasons.get(key, 0) + 1
    return {"multiple": multiple, "rate_per_s": rate, "sent": len(results), "admitted": len(ok),
            "goodput_per_s": len(good) / args.duration_s, "refused_share": 1 - len(ok) / max(1, len(results)),
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "tpot_p50_s": tpot["p50"],
            "tpot_p99_s": tpot["p99"], "refusals": reasons,
            # The machine's 1-minute load at the end of the rate: on a shared
            # box a neighbour's burst explains an outlier row.
            "load_1min": os.getloadavg()[0]}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'x cap':>6} {'rate/s':>7} {'sent':>5} {'goodput/s':>9} {'refused':>8} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'load':>5}")

    def f(v, scale=1.0, unit=""):
        return "-" if v is None else f"{v * scale:.{3 if unit == 's' else 1}f}{unit}"
    for r in rows:
        print(f"{r['multiple']:>6.2f} {r['rate_per_s']:>7.2f} {r['sent']:>5} {r['goodput_per_s']:>9.2f} "
              f"{r['refused_share']:>8.1%} {f(r['ttft_p50_s'], unit='s'):>9} {f(r['ttft_p99_s'], unit='s'):>9} "
              f"{f(r['tpot_p50_s'], 1000, 'ms'):>9} {f(r['tpot_p99_s'], 1000, 'ms'):>9} {r['load_1min']:>5.2f}")
    best = max(r["goodput_per_s"] for r in rows)
    for r in rows:
        if r["multiple"] >= 2:
            print(f"  at {r['multiple']:.0f}x capacity goodput is {r['goodput_per_s'] / best:.0%} of the best")


def sweep(args, url: str, capacity: float) -> list[dict]:
    rows = []
    for i, multiple in enumerate(args.rates):
        rate = multiple * capacity
        results = asyncio.run(run_rate(args, url, rate, seed=100 + i))
        rows.append(summarize_rate(args, multiple, rate, results))
        time.sleep(args.pause_s)  # let the previous rate's stragglers drain
    return rows


def engine_overhead(args, model: str) -> dict:
    """Thread choice check: the same batch offline (LLM.generate, no HTTP) and
    through the spawned server (engine thread + HTTP on one process, client in
    this one). The gap is what the HTTP layer costs the engine."""
    from kvserve.contract import SamplingParams
    from kvserve.engine.llm import LLM

    rng = random.Random(7)
    bodies = [request_body(args, rng) for _ in range(4 * args.max_num_seqs)]
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    llm = LLM(model=model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(bodies[0]["prompt"], params)  # warm-up
    start = time.perf_counter()
    llm.generate([b["prompt"] for b in bodies], params)
    offline_s = time.perf_counter() - start
    del llm
    port = free_port()
    proc = spawn_server(model, port, ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs",
                                      str(args.max_num_seqs), *_thread_args(args), *OPEN_ADMISSION])
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"

        async def batch():
            async with _session(args) as session:
                await one_request(session, url, bodies[0])  # warm-up
                start = time.perf_counter()
                results = await asyncio.gather(*(one_request(session, url, b) for b in bodies))
                return time.perf_counter() - start, results

        served_s, results = asyncio.run(batch())
        bodies = [{**b, "stream": False, "logprobs": None} for b in bodies]
        unstreamed_s, results_unstreamed = asyncio.run(batch())
        results += results_unstreamed
    finally:
        stop_server(proc)
    tokens = len(bodies) * args.max_tokens
    assert all(r["status"] == 200 and r["tokens"] == args.max_tokens for r in results), results[:3]
    out = {"requests": len(bodies), "offline_s": offline_s, "served_s": served_s,
           "offline_tokens_per_s": tokens / offline_s, "served_tokens_per_s": tokens / served_s,
           "served_unstreamed_tokens_per_s": tokens / unstreamed_s, "torch_threads": args.torch_threads}
    print(f"engine overhead: offline {out['offline_tokens_per_s']:.0f} tok/s, served streaming "
          f"{out['served_tokens_per_s']:.0f} tok/s, served non-streaming "
          f"{out['served_unstreamed_tokens_per_s']:.0f} tok/s")
    return out


class OTLPSink:
    """An OTLP/HTTP trace endpoint that accepts every export and counts the
    requests and bytes (the spans are not decoded): what a collector costs
    the server is its export, not the collector's work."""

    def __init__(self) -> None:
        sink = self
        self.num_exports = 0
        self.num_bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.num_exports += 1
                sink.num_bytes += len(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracer_cpu_cost(sink: OTLPSink, num_requests: int = 2000) -> dict:
    """CPU seconds the tracer spends per request, measured in this process
    on the server's own RequestTracer and OTLP exporter (to the sink): an
    admitted request of 64 prompt and 64 output tokens (its request span,
    queue / prefill / decode children, one prefill chunk event) and a
    refused one (its request span). Export is part of it: the processor is
    flushed inside the timed stretch. The goodput A/B above moves with the
    machine's speed by more than the 3% it judges; this cost does not."""
    from types import SimpleNamespace

    from kvserve.contract import RequestTimestamps, ResolvedVersions
    from kvserve.engine.async_engine import Finished
    from kvserve.tracing import Admission, RequestTracer

    tracer = RequestTracer.to_otlp(sink.url, ResolvedVersions("revision", "tokenizer", "template"), "bench")
    admitted, refused = Admission("admitted", None, 64), Admission("refused", "queue_full", 64)
    headers = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    costs = {}
    try:
        for kind in ("admitted", "refused"):
            start = time.process_time()
            for i in range(num_requests):
                if kind == "refused":
                    tracer.refused(headers, refused, 1.0, 1.001, {"kvserve.tenant": "default"})
                    continue
                request_id = f"cmpl-{i}"
                tracer.admitted(request_id, headers, admitted)
                stamps = RequestTimestamps(1.0, 1.0, 1.01, 1.05, [1.05 + 0.01 * t for t in range(64)], 1.7)
                prefill = SimpleNamespace(request=SimpleNamespace(request_id=request_id, num_prompt_tokens=64),
                                          start=0, num_new_tokens=64)
                tracer.on_scheduled(SimpleNamespace(scheduled_at=1.01, chunks=[prefill]))  # the engine thread's hook
                tracer.finished(Finished(request_id, "length", 64, stamps, num_prompt_tokens=64))
                if i % 256 == 255:  # the batch processor's queue is 2048 spans: export as it would
                    tracer.provider.force_flush()
            tracer.provider.force_flush()
            costs[f"{kind}_cpu_us"] = (time.process_time() - start) / num_requests * 1e6
    finally:
        tracer.shutdown()
    return costs


def compare_tracing(args, model: str, serve_args: list[str]) -> dict:
    """Tracing off and on, alternating rounds, one server per side and round;
    the capacity is measured once, on the first server (tracing off)."""
    sink = OTLPSink()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
    sides = {"tracing off": [], "tracing on": ["--otlp-traces-endpoint", sink.url]}
    report: dict = {"rounds": [], "capacity_per_s": None}
    try:
        for round_index in range(args.rounds):
            for label, extra in sides.items():
                port = free_port()
                proc = spawn_server(model, port, serve_args + extra)
                try:
                    url = f"http://127.0.0.1:{port}/v1/completions"
                    if report["capacity_per_s"] is None:
                        report["capacity_per_s"] = asyncio.run(measure_capacity(args, url))
                        print(f"capacity: {report['capacity_per_s']:.2f} requests/s")
                    exports_before = sink.num_exports
                    rows = sweep(args, url, report["capacity_per_s"])
                finally:
                    stop_server(proc)  # its last spans are exported on shutdown
                report["rounds"].append({"round": round_index, "side": label, "rows": rows,
                                         "otlp_exports": sink.num_exports - exports_before})
                print_table(f"round {round_index}: {label}", rows)
        report["tracer_cpu"] = tracer_cpu_cost(sink)
    finally:
        sink.close()
    report["otlp_bytes"] = sink.num_bytes
    report["goodput"] = _goodput_by_side(report["rounds"], args.rates)
    for multiple, by_side in report["goodput"].items():
        off, on = by_side["tracing off"], by_side["tracing on"]
        diff = (on - off) / off if off else float("nan")
        print(f"{multiple}x capacity: mean goodput off {off:.3f}/s, on {on:.3f}/s ({diff:+.1%})")
    cpu = report["tracer_cpu"]
    print(f"tracer CPU per request (this process, export included): admitted {cpu['admitted_cpu_us']:.0f} us, "
          f"refused {cpu['refused_cpu_us']:.0f} us")
    for multiple in args.rates:  # what those costs are at each rate's mix of admitted and refused
        rows = [row for r in report["rounds"] if r["side"] == "tracing on" for row in r["rows"]
                if row["multiple"] == multiple]
        rate = rows[0]["rate_per_s"]
        refused_share = sum(row["refused_share"] for row in rows) / len(rows)
        share = rate * ((1 - refused_share) * cpu["admitted_cpu_us"] + refused_share * cpu["refused_cpu_us"]) / 1e6
        report["tracer_cpu"][f"core_share_at_{multiple}x"] = share
        print(f"  at {multiple}x capacity ({rate:.1f} req/s, {refused_share:.0%} refused): {share:.2%} of one core")
    return report


def _goodput_by_side(rounds: list[dict], multiples: list[float]) -> dict:
    """Mean goodput per rate multiple and side over the rounds."""
    out: dict = {}
    for multiple in multiples:
        out[str(multiple)] = {}
        for side in ("tracing off", "tracing on"):
            values = [row["goodput_per_s"] for r in rounds if r["side"] == side
                      for row in r["rows"] if row["multiple"] == multiple]
            out[str(multiple)][side] = sum(values) / len(values)
    return out


def _thread_args(args) -> list[str]:
    out = [] if args.torch_threads is None else ["--torch-threads", str(args.torch_threads)]
    return out + ([] if args.gil_switch_interval is None else ["--gil-switch-interval", str(args.gil_switch_interval)])


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="an already running server (default: spawn one)")
    p.add_argument("--model", default="random", help="model to spawn: 'random' (built here) or a path")
    p.add_argument("--model-name", default="bench", help="model name to send")
    p.add_argument("--hidden", type=int, default=256, help="random model hidden size")
    p.add_argument("--layers", type=int, default=4, help="random model layers")
    p.add_argument("--max-num-seqs", type=int, default=16, help="server running batch cap (sequences)")
    p.add_argument("--kv-cache-memory", default="4MiB", help="server KV cache size (bytes with unit)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tokens, byte tokenizer)")
    p.add_argument("--max-tokens", type=int, default=64, help="output length (tokens)")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 1, 1.5, 2, 3],
                   help="offered load as multiples of measured capacity")
    p.add_argument("--duration-s", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--capacity-s", type=float, default=10.0, help="seconds of the closed-loop capacity run")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="wait for stragglers (seconds)")
    p.add_argument("--pause-s", type=float, default=1.0, help="pause between rates (seconds)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT target (seconds)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="TPOT target (seconds)")
    p.add_argument("--compare-tracing", action="store_true",
                   help="the same rates with request tracing off and on (an OTLP/HTTP sink here), side by side")
    p.add_argument("--rounds", type=int, default=2, help="--compare-tracing: off/on rounds, alternating")
    p.add_argument("--compare-no-admission", action="store_true",
                   help="also run the rates >= 1x against a server with admission opened up")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads for the server (and the offline run); default: torch's")
    p.add_argument("--gil-switch-interval", type=float, default=None,
                   help="pass --gil-switch-interval (seconds) to the server; default: serve's default")
    p.add_argument("--engine-overhead", action="store_true",
                   help="only compare the same batch offline vs through the server (thread choice check)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    serve_args = ["--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
                  "--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo), *_thread_args(args)]
    report: dict = {"args": {k: v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.base_url is None and model == "random":
            model = str(random_model_folder(Path(tmp) / "model", args.hidden, args.layers))
        if args.compare_tracing:
            result = compare_tracing(args, model, serve_args)
            out = RESULTS.with_name("overload_tracing.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"args": report["args"], **result}, indent=2))
            print(f"\nwrote {out.relative_to(ROOT)}")
            return 0
        if args.engine_overhead:
            result = engine_overhead(args, model)
            out = RESULTS.with_name("engine_overhead.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2))
            return 0
        for label, extra in [("admission on", [])] + (
                [("admission opened up", OPEN_ADMISSION)] if args.compare_no_admission else []):
            proc = None
            base = args.base_url
            if base is None:
                port = free_port()
                proc = spawn_server(model, port, serve_args + extra)
                base = f"http://127.0.0.1:{port}"
            try:
                url = base + "/v1/completions"
                if "capacity_per_s" not in report:
                    report["capacity_per_s"] = asyncio.run(measure_capacity(args, url))
                    print(f"capacity: {report['capacity_per_s']:.2f} requests/s "
                          f"({args.prompt_tokens} prompt + {args.max_tokens} output tokens)")
                rates = args.rates if not extra else [r for r in args.rates if r >= 1]
                saved, args.rates = args.rates, rates
                rows = sweep(args, url, report["capacity_per_s"])
                args.rates = saved
                report[label] = rows
                print_table(label, rows)
            finally:
                if proc is not None:
                    stop_server(proc)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
