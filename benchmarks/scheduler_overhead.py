"""Python overhead of one scheduler step: schedule() + update() with 256
running and 1,000 waiting requests (block size 16, prefix caching on).

Target (issue 2): median under 1 ms per step on the 2-core dev machine.

    python benchmarks/scheduler_overhead.py [--steps 300] [--out benchmarks/results/scheduler_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.scheduler.scheduler import Scheduler

NON_EOS = 7


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(num_running: int, num_waiting: int, prefix_caching: bool, seed: int):
    rng = random.Random(seed)
    clock = StepClock()
    # The sequence cap holds the running set at num_running, so after the
    # warm-up prefills every timed step is a pure decode step of the whole
    # batch with the waiting queue full behind it: the case where scheduler
    # overhead is largest relative to model time.
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=num_running,
                                      max_model_len=8192),
                      CacheConfig(num_blocks=num_running * 64, block_size=16,
                                  enable_prefix_caching=prefix_caching), clock=clock)
    shared_prefix = [rng.randrange(1, 30000) for _ in range(256)]
    for i in range(num_running + num_waiting):
        prompt = shared_prefix[:rng.choice([0, 128, 256])] + [rng.randrange(1, 30000) for _ in range(rng.randint(32, 512))]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=4096, ignore_eos=True),
                                  arrival_time=clock.now, priority=rng.randrange(3), tenant=f"t{i % 4}"))
    # Prefill the first num_running requests (not timed).
    while sum(1 for r in sched.running.values() if r.num_output_tokens > 0) < num_running:
        step(sched, clock)
    return sched, clock


def step(sched: Scheduler, clock: StepClock):
    out = sched.schedule()
    clock.now += 0.02
    sched.update(out, {c.request.request_id: NON_EOS for c in out.chunks if c.samples})
    return out


def measure(num_running: int, num_waiting: int, steps: int, prefix_caching: bool, seed: int) -> dict:
    sched, clock = build(num_running, num_waiting, prefix_caching, seed)
    times_ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step(sched, clock)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    assert len(out.chunks) == num_running and len(sched.waiting) == num_waiting
    times_ms.sort()
    return {
        "running": num_running, "waiting": num_waiting, "prefix_caching": prefix_caching,
        "steps": steps, "median_ms": statistics.median(times_ms),
        "p90_ms": times_ms[int(0.9 * (len(times_ms) - 1))], "min_ms": times_ms[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed decode steps per case")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", default="benchmarks/results/scheduler_overhead.json", help="JSON output path")
    args = parser.parse_args()
    cases = [(256, 1000, True), (256, 1000, False), (64, 1000, True)]
    rows = [measure(r, w, args.steps, pc, args.seed) for r, w, pc in cases]
    print(f"{'running':>8} {'waiting':>8} {'prefix':>7} {'median ms':>10} {'p90 ms':>8} {'min ms':>8}")
    for row in rows:
        print(f"{row['running']:>8} {row['waiting']:>8} {str(row['prefix_caching']):>7} "
              f"{row['median_ms']:>10.3f} {row['p90_ms']:>8.3f} {row['min_ms']:>8.3f}")
    target = rows[0]["median_ms"] < 1.0
    print(f"target: median < 1 ms with 256 running / 1000 waiting, prefix caching on: "
          f"{'met' if target else 'MISSED'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"benchmark": "scheduler_overhead", "rows": rows,
                                          "target_met": target}, indent=2))


if __name__ == "__main__":
    main()
