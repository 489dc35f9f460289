"""Bounded connection buffers (server/transport.py) against the kernel's
defaults, side by side in one run: streaming throughput, and what a silent
client leaves queued on the server.

The server is the tests' live server (uvicorn on uvloop, the production
socket setup) on the tiny random model with no step delay: each step is a
few milliseconds, so the HTTP path, where the buffers act, weighs as much
as it ever does. Both servers run at once (each idle while the other is
measured) and bursts alternate between them, so a drifting or shared
machine affects both alike; the figure is the median of the per-pair ratios.

- throughput: N concurrent streaming clients that read as fast as they can,
  each max_tokens tokens; tokens received per second (all clients).
- silent client: one stream (with logprobs, ~1 KB per token) whose client
  has a 2 KB receive buffer, reads the first event and then nothing; after
  --silent-s seconds, the bytes the server holds for it (transport buffer +
  the socket's send queue, TIOCOUTQ), with the stall timeout set far beyond
  the measurement.

    python benchmarks/stream_buffers.py --pairs 20 --clients 16 --max-tokens 100

Prints a table and writes benchmarks/results/stream_buffers.json.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import fcntl
import json
import os
import platform
import socket
import statistics
import sys
import termios
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' live server and tiny model

from kvserve.config import AdmissionConfig, ServerConfig  # noqa: E402
from kvserve.server.serving import Serving  # noqa: E402
from kvserve.server.transport import ConnectionLimits  # noqa: E402
from tests.server_helpers import MODEL_NAME, LiveServer, tiny_core  # noqa: E402

STALL_TIMEOUT_S = 600.0  # far past any measurement here: nothing is aborted
SILENT_RECEIVE_BUFFER_BYTES = 2048
SIDES = {
    "bounded": ConnectionLimits(STALL_TIMEOUT_S),
    "kernel_default": ConnectionLimits(STALL_TIMEOUT_S, send_buffer_bytes=None, write_buffer_high_bytes=None),
}


def start(limits: ConnectionLimits, max_num_seqs: int) -> LiveServer:
    # KV for every client's whole stream at once: admission never refuses.
    core = tiny_core(num_blocks=max_num_seqs * 32, max_num_seqs=max_num_seqs, max_model_len=512)
    config = ServerConfig(served_model_name=MODEL_NAME, stream_stall_timeout_s=STALL_TIMEOUT_S)
    admission = AdmissionConfig(max_queue_wait_s=100.0, ttft_slo_s=100.0, tpot_slo_s=10.0)
    return LiveServer(Serving(core, admission, config), limits)


async def _stream(client: httpx.AsyncClient, max_tokens: int) -> int:
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return tokens


def throughput(base_url: str, num_clients: int, max_tokens: int) -> float:
    """Tokens per second received by `num_clients` concurrent streams."""
    async def main():
        limits = httpx.Limits(max_connections=num_clients)
        async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
            start_s = time.perf_counter()
            tokens = await asyncio.gather(*(_stream(client, max_tokens) for _ in range(num_clients)))
            return sum(tokens) / (time.perf_counter() - start_s)
    return asyncio.run(main())


def silent_client_queue_bytes(srv: LiveServer, silent_s: float) -> int:
    """Bytes the server holds for a client that stopped reading `silent_s` ago."""
    host, port = srv.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SILENT_RECEIVE_BUFFER_BYTES)
    sock.connect((host, int(port)))
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 480, "stream": True,
                       "logprobs": 5}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    data = b""
    while b"data: " not in data:
        data += sock.recv(4096)
    time.sleep(silent_s)
    queued = max(_server_queue_bytes(protocol) for protocol in list(srv.server.server_state.connections))
    sock.close()
    return queued


def _server_queue_bytes(protocol) -> int:
    transport = protocol.transport
    if transport is None or transport.is_closing():
        return 0
    outq = array.array("i", [0])
    fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.TIOCOUTQ, outq)
    return transport.get_write_buffer_size() + outq[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="bursts per side, alternating")
    parser.add_argument("--clients", type=int, default=16, help="concurrent streams per burst")
    parser.add_argument("--max-tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--silent-s", type=float, default=4.0, help="how long the silent client stays silent (s)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stream_buffers.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    servers = {side: start(limits, args.clients) for side, limits in SIDES.items()}
    rates: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        for srv in servers.values():
            srv.__enter__()
            throughput(srv.base_url, args.clients, 16)  # first-request costs out of the way
        for pair in range(args.pairs):
            order = list(SIDES) if pair % 2 == 0 else list(reversed(SIDES))
            for side in order:
                rates[side].append(throughput(servers[side].base_url, args.clients, args.max_tokens))
            print(f"pair {pair + 1:2d}: " + "  ".join(f"{side} {rates[side][-1]:6.0f}" for side in SIDES)
                  + " tokens/s", flush=True)
        queued = {side: silent_client_queue_bytes(srv, args.silent_s) for side, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.__exit__(None, None, None)
    ratios = [b / d for b, d in zip(rates["bounded"], rates["kernel_default"])]
    medians = {side: statistics.median(r) for side, r in rates.items()}
    ratio = statistics.median(ratios)
    print(f"\n{'side':15s} {'median tok/s':>12s} {'min':>8s} {'max':>8s} {'silent client queued':>21s}")
    for side in SIDES:
        print(f"{side:15s} {medians[side]:12.0f} {min(rates[side]):8.0f} {max(rates[side]):8.0f} "
              f"{queued[side] / 1024:17.1f} KiB")
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio, ratio, ratio]
    print(f"bounded / kernel_default throughput, median of {len(ratios)} pairs: {ratio:.3f} "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(), "loadavg_1m_before": load_before,
        "clients": args.clients, "max_tokens": args.max_tokens, "silent_s": args.silent_s,
        "tokens_per_s": rates, "median_tokens_per_s": medians, "pair_ratios": ratios,
        "throughput_ratio_median": ratio, "throughput_ratio_quartiles": [quartiles[0], quartiles[2]],
        "silent_client_queued_bytes": queued}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
