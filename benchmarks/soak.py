"""Soak: a `kvserve serve` process (the default model) under ~80% of its
measured capacity for --duration-s, with bursts, client cancellations,
disconnects, stalled readers and bad input mixed into the steady traffic.

What it checks:
- every request is accounted for: each one the client sent ends in exactly
  one outcome (success, refused with its reason, timed out with its reason,
  cancelled or disconnected by the client, a stalled reader aborted by the
  server, a 4xx for bad input); `error` (a 5xx, a dropped connection, an
  unexpected answer) must stay 0;
- memory: the server's RSS at the end is within 5% of its RSS after the
  first 5 minutes (the warm-up of allocators and caches is over by then);
- idle: once the load stops, running, waiting and KV usage go back to 0.

Capacity is measured first (--calibrate-s of closed-loop clients, as many
as --max-num-seqs), then Poisson arrivals run at --load x that rate, with a
burst of 2 x --max-num-seqs requests every --burst-every-s seconds.

    python benchmarks/soak.py --duration-s 1800 --out benchmarks/results/soak.json

Prints a table and writes the JSON (outcomes, RSS timeline, idle state,
the server's own counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
KVSERVE = Path(sys.executable).parent / "kvserve"
STALL_TIMEOUT_S = 5.0
STALL_RECEIVE_BUFFER_BYTES = 2048
RSS_BASELINE_S = 300.0  # "after the first 5 minutes"
RSS_TOLERANCE = 0.05
MAX_OUTSTANDING = 400  # the client's own bound on requests in flight
# Request kinds of the steady traffic and their shares.
MIX = {"stream": 0.55, "plain": 0.15, "cancel": 0.08, "disconnect": 0.05, "stall": 0.02, "bad_input": 0.15}
PROMPT_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
                "judge boxing matches near the old river bank").split()
BAD_BODIES = (
    (b'{"model": "m", "prompt": "hi \\udfff", "max_tokens": 4}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": "64"}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": true, "stream": "yes"}', "application/json"),
    (b'{"prompt": [true, false], "max_tokens": 4}', "application/json"),
    (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", "application/json"),
    (b'{"prompt": "hi", "temperature": NaN}', "application/json"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json"),
    (b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 4}', "application/json"),
    (b"prompt=hi&max_tokens=4", "application/x-www-form-urlencoded"),
    (b'{"prompt": "hi", "max_tokens": 4', "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}', "chat"),
)


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> Server:
    port = free_port()
    command = [str(KVSERVE), "serve", "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
               "--kv-cache-memory", args.kv_cache_memory, "--stream-stall-timeout", str(STALL_TIMEOUT_S),
               "--queue-timeout", "10", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(args.server_log, "w"))
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); see {args.server_log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(64):
                    return Server(process, base_url, port)
        except OSError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not become ready in 300 s")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(8, 60)))


def payload(rng: random.Random, stream: bool, max_tokens: int | None = None) -> dict:
    return {"prompt": prompt(rng), "max_tokens": max_tokens or rng.randint(8, 48), "temperature": 0.7,
            "seed": rng.randrange(2**31), "stream": stream}


# ---- one request of each kind: -> (outcome, detail) ------------------------------

async def refused_or_error(response: aiohttp.ClientResponse) -> tuple[str, str]:
    try:
        code = (await response.json(content_type=None))["error"]["code"]
    except Exception:
        return "error", f"http_{response.status}_unparsable"
    if response.status == 429:
        return "refused", str(code)
    if response.status == 503 and code in ("queue_timeout", "deadline", "shutting_down"):
        return "timed_out", str(code)
    return "error", f"http_{response.status}_{code}"


async def stream_request(session, base_url: str, body: dict, read_chunks: int | None) -> tuple[str, str]:
    async with session.post(base_url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return await refused_or_error(response)
        num_chunks, done = 0, False
        async for line in response.content:
            if line.startswith(b"data: [DONE]"):
                done = True
                break
            if line.startswith(b"data: "):
                if b'"error"' in line:
                    return "error", "error_event"
                num_chunks += 1
                if read_chunks is not None and num_chunks >= read_chunks:
                    response.close()  # the client cancels mid-stream
                    return "cancelled", "mid_stream"
        return ("success", "stream") if done else ("error", "stream_cut")


async def plain_request(session, base_url: str, body: dict) -> tuple[str, str]:
    async with session.post(base_url + "/v1/completions", json=body) as response:
        if response.status != 200:
            return await refused_or_error(response)
        data = await response.json()
        return ("success", "plain") if data["choices"][0]["finish_reason"] in ("stop", "length") \
            else ("error", "plain_" + str(data["choices"][0]["finish_reason"]))


async def disconnect_request(session, base_url: str, body: dict, rng: random.Random) -> tuple[str, str]:
    """A non-streamed request whose client gives up before the answer."""
    try:
        async with asyncio.timeout(rng.uniform(0.05, 1.0)):
            outcome = await plain_request(session, base_url, body)
    except TimeoutError:
        return "disconnected", "before_answer"
    return outcome


async def stall_request(port: int, body: dict) -> tuple[str, str]:
    """A streamed request whose reader (2 KB receive buffer) reads the
    response head and then nothing: the server must abort it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALL_RECEIVE_BUFFER_BYTES)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        data = json.dumps(body).encode()
        await loop.sock_sendall(sock, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                      b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        head = await asyncio.wait_for(loop.sock_recv(sock, 512), 60)
        if not head.startswith(b"HTTP/1.1 200"):
            return ("refused", "stalled_client") if b" 429 " in head[:16] else ("timed_out", "stalled_client") \
                if b" 503 " in head[:16] else ("error", "stall_" + head[:12].decode(errors="replace"))
        await asyncio.sleep(STALL_TIMEOUT_S * 3)  # silent: read nothing
        received = b""
        async with asyncio.timeout(30):
            while chunk := await loop.sock_recv(sock, 65536):
                received += chunk
        if b"[DONE]" in received and b'"finish_reason":"abort"' not in received:
            return "success", "stall_fit_in_buffers"  # the whole answer fit the buffers
        return "stalled_aborted", "server_closed"
    except (TimeoutError, ConnectionError) as exc:
        return "error", f"stall_{type(exc).__name__}"
    finally:
        sock.close()


async def bad_request(session, base_url: str, rng: random.Random) -> tuple[str, str]:
    data, content_type = rng.choice(BAD_BODIES)
    path = "/v1/chat/completions" if content_type == "chat" else "/v1/completions"
    headers = {"Content-Type": "application/json" if content_type == "chat" else content_type}
    async with session.post(base_url + path, data=data, headers=headers) as response:
        await response.read()
        if 400 <= response.status < 500 and response.status != 429:
            return "bad_input_4xx", str(response.status)
        if response.status == 429:
            return "refused", "bad_input_refused_early"
        return "error", f"bad_input_http_{response.status}"


async def one(kind: str, session, server: Server, rng: random.Random) -> tuple[str, str]:
    try:
        if kind == "stream":
            return await stream_request(session, server.base_url, payload(rng, True), None)
        if kind == "plain":
            return await plain_request(session, server.base_url, payload(rng, False))
        if kind == "cancel":
            return await stream_request(session, server.base_url, payload(rng, True, 64), rng.randint(1, 6))
        if kind == "disconnect":
            return await disconnect_request(session, server.base_url, payload(rng, False, 64), rng)
        if kind == "stall":
            return await stall_request(server.port, {**payload(rng, True, 400), "logprobs": 5})
        return await bad_request(session, server.base_url, rng)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return "error", f"{kind}_{type(exc).__name__}"


# ---- the phases ------------------------------------------------------------------

async def calibrate(session, server: Server, args) -> float:
    """Closed loop, one client per batch slot: completed requests per second."""
    rng = random.Random(1)
    ends = time.monotonic() + args.calibrate_s
    done = 0

    async def client():
        nonlocal done
        while time.monotonic() < ends:
            outcome, _ = await one("stream", session, server, rng)
            if outcome == "success":
                done += 1
            else:
                await asyncio.sleep(0.2)
    await asyncio.gather(*(client() for _ in range(args.max_num_seqs)))
    return done / args.calibrate_s


async def soak(session, server: Server, args, rate_per_s: float) -> tuple[Counter, Counter, list, int]:
    rng = random.Random(args.seed)
    outcomes: Counter = Counter()
    details: Counter = Counter()
    rss: list[tuple[float, int]] = []
    tasks: set[asyncio.Task] = set()
    started = time.monotonic()
    next_burst = started + args.burst_every_s
    next_rss = started
    kinds, weights = list(MIX), list(MIX.values())
    sent = 0

    def launch(kind: str) -> None:
        nonlocal sent
        sent += 1
        task = asyncio.create_task(one(kind, session, server, random.Random(rng.random())))
        tasks.add(task)
        task.add_done_callback(lambda t, k=kind: record(t, k))

    def record(task: asyncio.Task, kind: str) -> None:
        tasks.discard(task)
        outcome, detail = task.result()
        outcomes[outcome] += 1
        details[f"{kind}:{outcome}:{detail}"] += 1

    while (now := time.monotonic()) < started + args.duration_s:
        if now >= next_rss:
            rss.append((now - started, rss_bytes(server.process.pid)))
            next_rss += 10.0
        if now >= next_burst:
            for _ in range(2 * args.max_num_seqs):
                launch("stream")
            next_burst += args.burst_every_s
        if len(tasks) < MAX_OUTSTANDING:
            launch(rng.choices(kinds, weights)[0])
        else:
            outcomes["client_backlog_skipped"] += 1
        await asyncio.sleep(rng.expovariate(rate_per_s / (1 - MIX["bad_input"])))
    if tasks:
        await asyncio.wait(tasks, timeout=120)
    outcomes["unfinished_at_end"] = len(tasks)
    return outcomes, details, rss, sent


async def idle_state(session, server: Server, wait_s: float = 60.0) -> dict:
    """Poll /metrics until nothing runs, waits or holds KV (or wait_s passes)."""
    deadline = time.monotonic() + wait_s
    while True:
        samples = await scrape(session, server.base_url)
        state = {name: sum(v for k, v in samples.items() if k.startswith(name))
                 for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
        if not any(state.values()) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(1.0)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


async def scrape(session, base_url: str) -> dict[str, float]:
    async with session.get(base_url + "/metrics") as response:
        text = await response.text()
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := _SAMPLE.match(line))}


def server_counters(samples: dict[str, float]) -> dict[str, float]:
    keep = ("vllm:request_success_total", "kvserve_admission_decisions_total", "kvserve_cancellations_total",
            "kvserve_slo_requests_total")
    return {k: v for k, v in samples.items() if k.startswith(keep)}


async def main_async(args) -> dict:
    server = start_server(args)
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        connector = aiohttp.TCPConnector(limit=MAX_OUTSTANDING + 50, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            capacity = await calibrate(session, server, args)
            rate = max(0.05, args.load * capacity)
            outcomes, details, rss, sent = await soak(session, server, args, rate)
            idle = await idle_state(session, server)
            await asyncio.sleep(5)
            rss_end = rss_bytes(server.process.pid)
            counters = server_counters(await scrape(session, server.base_url))
    finally:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()
    return report(args, capacity, rate, outcomes, details, rss, rss_end, sent, idle, counters,
                  server.process.returncode)


def report(args, capacity, rate, outcomes, details, rss, rss_end, sent, idle, counters, exit_code) -> dict:
    baseline = next((b for t, b in rss if t >= min(RSS_BASELINE_S, args.duration_s / 2)), rss[-1][1] if rss else 0)
    accounted = sum(v for k, v in outcomes.items() if k not in ("client_backlog_skipped", "unfinished_at_end"))
    checks = {
        "every_request_accounted": accounted == sent and outcomes["unfinished_at_end"] == 0,
        "no_errors": outcomes["error"] == 0,
        "rss_within_5pct_of_5min": baseline > 0 and abs(rss_end - baseline) <= RSS_TOLERANCE * baseline,
        "idle_back_to_zero": not any(idle.values()),
        "server_exited_zero": exit_code == 0,
    }
    return {
        "benchmark": "soak", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared), load {os.getloadavg()[0]:.1f}",
        "command": " ".join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "duration_s": args.duration_s, "capacity_req_per_s": capacity, "offered_req_per_s": rate,
        "requests_sent": sent, "outcomes": dict(outcomes), "outcome_details": dict(details),
        "rss_bytes_baseline": baseline, "rss_bytes_end": rss_end,
        "rss_change": (rss_end - baseline) / baseline if baseline else None,
        "rss_timeline": rss, "idle": idle, "server_counters": counters, "server_exit_code": exit_code,
        "checks": checks, "passed": all(checks.values()),
    }


def print_table(result: dict) -> None:
    print(f"soak {result['duration_s']:.0f} s: capacity {result['capacity_req_per_s']:.2f} req/s, "
          f"offered {result['offered_req_per_s']:.2f} req/s, {result['requests_sent']} requests")
    for name, count in sorted(result["outcomes"].items()):
        print(f"  {name:<24} {count}")
    print(f"  RSS after 5 min {result['rss_bytes_baseline'] / 2**20:.1f} MiB, at the end "
          f"{result['rss_bytes_end'] / 2**20:.1f} MiB ({(result['rss_change'] or 0) * 100:+.1f}%)")
    print(f"  idle: {result['idle']}")
    for name, ok in result["checks"].items():
        print(f"  {'PASS' if ok else 'FAIL'} {name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800.0, help="soak length (seconds)")
    parser.add_argument("--calibrate-s", type=float, default=60.0, help="capacity measurement (seconds)")
    parser.add_argument("--load", type=float, default=0.8, help="offered load as a share of measured capacity")
    parser.add_argument("--burst-every-s", type=float, default=60.0, help="seconds between bursts")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the server's running-batch cap")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="the server's KV cache size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-log", default="/tmp/kvserve-soak-server.log", help="the server's stderr")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print_table(result)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
