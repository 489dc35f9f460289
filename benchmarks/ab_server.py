"""A/B of the default server: this checkout against an earlier commit, side
by side in one run.

For changes to admission or scheduling whose effect is only visible on a
live server with the real model (running cap, refusals at low load, TTFT):
each round starts `kvserve serve` (default model, default flags) from the
base commit and from this checkout in turn, runs the same `kvserve bench`
against each, and samples `kvserve_running_cap` every half second. Both
sides run the pure-Python core (`KVSERVE_PURE_PYTHON=1`): the base
commit's tree has no compiled modules, and the model's step dominates
either way. Rounds alternate the two sides so that a drifting machine
affects both alike.

    python benchmarks/ab_server.py --base-ref 913228f --rounds 2 \\
        --rate 1 --num-requests 60

Prints a table per side (TTFT / TPOT p50 and p99, refusals, prefill steps,
the running cap's spread) and writes JSON to --out/ab_server.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvserve.bench.cli import free_port, wait_ready

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
CAP_SAMPLE_PERIOD_S = 0.5
_CAP = re.compile(r"^kvserve_running_cap\{[^}]*\} ([0-9.eE+-]+)$", re.MULTILINE)
_PREFILL_STEPS = re.compile(r'^kvserve_engine_step_seconds_count\{[^}]*kind="prefill"[^}]*\} ([0-9.eE+-]+)$',
                            re.MULTILINE)


@contextmanager
def worktree(ref: str):
    """A detached checkout of `ref`, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvserve-ab-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), ref], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


@contextmanager
def server(src: Path, port: int, log_path: Path):
    """`kvserve serve` on the default model from the source tree `src`."""
    env = {**os.environ, "PYTHONPATH": str(src), "KVSERVE_PURE_PYTHON": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_ready(f"http://127.0.0.1:{port}", proc, READY_TIMEOUT_S)
            except RuntimeError as exc:
                raise SystemExit(f"server from {src}: {exc}; see {log_path}") from exc
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class CapSampler(threading.Thread):
    """Samples kvserve_running_cap until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.caps, self._stop_event = base_url, [], threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(CAP_SAMPLE_PERIOD_S):
            try:
                match = _CAP.search(httpx.get(self.base_url + "/metrics", timeout=5).text)
            except httpx.HTTPError:
                continue
            if match:
                self.caps.append(float(match.group(1)))

    def stop(self) -> list[float]:
        self._stop_event.set()
        self.join()
        return self.caps


def run_side(name: str, src: Path, args: argparse.Namespace, round_index: int, out: Path) -> dict:
    side_out = out / f"{name}_{round_index}"
    with server(src, free_port(), out / f"serve_{name}_{round_index}.log") as base_url:
        sampler = CapSampler(base_url)
        sampler.start()
        bench = subprocess.run([sys.executable, "-m", "kvserve.cli", "bench", "--base-url", base_url,
                                "--workload", args.workload, "--rate", str(args.rate),
                                "--num-requests", str(args.num_requests), "--seed", str(args.seed + round_index),
                                "--out", str(side_out)], capture_output=True, text=True)
        caps = sampler.stop()
        metrics_text = httpx.get(base_url + "/metrics", timeout=5).text
    if bench.returncode != 0:
        raise SystemExit(f"bench against {name} failed: {bench.stderr[-2000:]}")
    summary = json.loads((side_out / "report.json").read_text())["summary"]
    prefill = _PREFILL_STEPS.search(metrics_text)
    return {"side": name, "round": round_index, "ttft_p50_s": summary["ttft"]["p50"],
            "ttft_p99_s": summary["ttft"]["p99"], "tpot_p50_s": summary["tpot"]["p50"],
            "tpot_p99_s": summary["tpot"]["p99"], "outcomes": summary["outcomes"],
            "prefill_steps": float(prefill.group(1)) if prefill else None,
            "running_cap": {"samples": len(caps), "min": min(caps, default=None),
                            "median": statistics.median(caps) if caps else None, "max": max(caps, default=None)}}


def fmt_row(r: dict) -> str:
    cap = r["running_cap"]
    prefill = "-" if r["prefill_steps"] is None else f"{r['prefill_steps']:.0f}"
    return (f"{r['side']:<5} {r['round']:>5} {r['ttft_p50_s'] * 1e3:>8.0f} {r['ttft_p99_s'] * 1e3:>8.0f} "
            f"{r['tpot_p50_s'] * 1e3:>8.1f} {r['tpot_p99_s'] * 1e3:>8.1f} {r['outcomes']['rejected']:>8} "
            f"{prefill:>8} {cap['min']!s:>5}/{cap['median']!s:>5}/{cap['max']!s:>5}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-ref", default="HEAD~1", help="the commit to compare against (git ref)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=float, default=1.0, help="bench arrival rate, requests/s")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--workload", default="short")
    parser.add_argument("--seed", type=int, default=1, help="round i uses seed + i (both sides alike)")
    parser.add_argument("--out", default="bench-out/ab-server")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    header = (f"{'side':<5} {'round':>5} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} {'TPOT p99':>8} "
              f"{'refused':>8} {'prefill':>8} {'cap min/median/max':>17}")
    with worktree(args.base_ref) as base_tree:
        print(f"base {args.base_ref} against this checkout; times in ms")
        print(header)
        for i in range(args.rounds):
            sides = [("base", base_tree / "src"), ("head", REPO / "src")]
            for name, src in sides if i % 2 == 0 else sides[::-1]:
                rows.append(run_side(name, src, args, i, out))
                print(fmt_row(rows[-1]), flush=True)
    document = {"base_ref": args.base_ref, "head": subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "config": vars(args), "rows": rows}
    (out / "ab_server.json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out / 'ab_server.json'}")


if __name__ == "__main__":
    main()
