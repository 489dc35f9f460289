"""A run of one sequence's query rows attending row by row against across
vector lanes (csrc's lane_attention, AVX-512): `kvq_decode_attention` on the
default model's head shape (9 query heads, 3 KV heads, 64 dims), a chunk of
`rows` new tokens after `cached` positions of prefix, a bfloat16 KV cache
(the CPU default) in scattered blocks. Calls alternate between the two
kernels so the machine's drift falls on both alike; the table gives the
median time of one layer's attention and the lanes' speed-up. The
crossover (the smallest run where the lanes win) sets
`model/attention.LANE_MIN_ROWS`.

    .venv/bin/python benchmarks/lane_attention.py [--threads 2] [--rounds 7]

Prints a table and writes benchmarks/results/lane_attention.json (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from kvserve.model import quantized

ROOT = Path(__file__).resolve().parents[1]
H, HKV, D, BLOCK = 9, 3, 64, 16
# (cached prefix, new rows): the crossover at small runs; prefills of 256 and
# 2,048 tokens; chunks after a long cached prefix.
CASES = [(0, 1), (0, 2), (0, 4), (0, 6), (0, 8), (0, 12), (0, 16), (256, 2), (256, 4), (256, 8), (256, 16),
         (1024, 4), (1024, 8), (0, 256), (0, 2048), (1024, 96), (4096, 256)]


def attend(q, cache, table, lens, rows, run_min_rows, threads):
    lib = quantized.require_kernels()
    out = torch.empty(rows, H * D, dtype=q.dtype)
    status = lib.kvq_decode_attention(q.data_ptr(), quantized.activation_type(q.dtype), q.stride(0),
                                      cache.data_ptr(), quantized.cache_type(cache.dtype), table.data_ptr(),
                                      table.shape[1], lens.data_ptr(), BLOCK, rows, H, HKV, D, 0.125,
                                      out.data_ptr(), threads, rows, run_min_rows)
    assert status == 0
    return out


def measure(cached: int, rows: int, threads: int, rounds: int) -> dict:
    gen = torch.Generator().manual_seed(cached * 7 + rows)
    context = cached + rows
    num_blocks = (context + BLOCK - 1) // BLOCK
    cache = torch.randn(num_blocks * BLOCK * 2, 2, HKV, D, generator=gen).bfloat16()
    blocks = torch.randperm(num_blocks * 2, generator=gen)[:num_blocks]  # scattered, as a busy cache's
    table = blocks.repeat(rows, 1).contiguous()
    lens = torch.arange(cached + 1, context + 1)
    q = torch.randn(rows, H * D, generator=gen)
    row_out, lane_out = attend(q, cache, table, lens, rows, 0, threads), attend(q, cache, table, lens, rows, 1, threads)
    max_diff = float((row_out - lane_out).abs().max())
    calls = max(1, int(2e6 / (rows * context)))  # ~a few ms a round
    times: dict[str, list[float]] = {"rows": [], "lanes": []}
    for _ in range(rounds):
        for name, min_rows in (("rows", 0), ("lanes", 1)):
            start = time.perf_counter()
            for _ in range(calls):
                attend(q, cache, table, lens, rows, min_rows, threads)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    row_ms, lane_ms = statistics.median(times["rows"]), statistics.median(times["lanes"])
    return {"cached": cached, "rows": rows, "row_kernel_ms": row_ms, "lanes_ms": lane_ms,
            "speedup": row_ms / lane_ms, "max_abs_diff": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lane_attention.json")
    args = parser.parse_args()
    if quantized.set_isa("best") not in ("avx512_vnni", "amx"):  # a skip, not a failure (make bench runs it)
        print("lane_attention: skipped: the lanes need AVX-512, which this CPU's kernels do not have")
        return
    torch.set_num_threads(args.threads)
    results = [measure(cached, rows, args.threads, args.rounds) for cached, rows in CASES]
    print("| cached | new rows | row kernel ms | lanes ms | lanes speed-up | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['cached']} | {r['rows']} | {r['row_kernel_ms']:.3f} | {r['lanes_ms']:.3f} | "
              f"{r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |")
    print(f"\none layer's attention (9 x 64 query heads over 3 KV heads, bfloat16 cache), {args.threads} threads, "
          f"median of {args.rounds} rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "results": results,
                                    "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg": os.getloadavg()},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
