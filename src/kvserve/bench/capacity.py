"""The rest of a capacity report (seed 003, section 10) beside report.py's
latencies and outcomes: what the server process used (CPU from /proc, GPU
through NVML where present), energy (RAPL counters where readable, else a
stated power), cost and energy per successful request and per successful
task (a task: a configured group of consecutive requests, e.g. the turns of
one conversation, that succeeds only when all of them do), and the warm- vs
cold-start section (time to ready, the first requests' TTFT against the rest).

Reads only /proc, /sys and the records: bench stays free of the engine.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.report import SLO, RequestRecord, is_good, record_latency
from kvserve.latency import summarize

RAPL_ROOT = Path("/sys/class/powercap")
# The first requests after a start whose TTFT the startup section lists.
NUM_FIRST_REQUESTS = 5


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc), None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _rapl_zones() -> list[Path]:
    """Package-level RAPL zones whose energy counter this user can read."""
    zones = []
    for zone in sorted(RAPL_ROOT.glob("*-rapl:*")):
        if ":" in zone.name.split("rapl:", 1)[1]:
            continue  # a sub-zone (core, dram): counted in its package
        if os.access(zone / "energy_uj", os.R_OK):
            zones.append(zone)
    return zones


def _rapl_joules(zones: list[Path]) -> list[tuple[int, int]]:
    """(energy_uj, max_energy_range_uj) per zone."""
    return [(int((z / "energy_uj").read_text()), int((z / "max_energy_range_uj").read_text())) for z in zones]


def _gpu_utilization() -> float | None:
    """Mean utilization (0..1) of the visible NVIDIA GPUs now, through NVML
    where pynvml is installed; None otherwise."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        rates = [pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(i)).gpu
                 for i in range(count)]
        return sum(rates) / len(rates) / 100.0 if rates else None
    except Exception:  # not installed, no driver, no device: no GPU figure
        return None


@dataclass
class ResourceMeter:
    """Brackets a run: CPU seconds of the server process (when its pid is
    known), RAPL energy (when readable) or `watts` x the run's wall time."""

    server_pid: int | None = None
    watts: float | None = None

    def start(self) -> None:
        self._wall = time.monotonic()
        self._cpu = None if self.server_pid is None else _cpu_seconds(self.server_pid)
        self._zones = _rapl_zones()
        self._energy = _rapl_joules(self._zones) if self._zones else []
        self._gpu_samples: list[float] = []
        self._stopped = threading.Event()
        if _gpu_utilization() is not None:  # NVML answers: sample once a second
            threading.Thread(target=self._sample_gpu, daemon=True).start()

    def _sample_gpu(self) -> None:
        while not self._stopped.wait(1.0):
            value = _gpu_utilization()
            if value is not None:
                self._gpu_samples.append(value)

    def stop(self) -> dict:
        self._stopped.set()
        wall_s = time.monotonic() - self._wall
        out: dict = {"wall_s": wall_s, "server_pid": self.server_pid, "server_cpu_s": None,
                     "server_cpu_utilization": None, "gpu_utilization": None,
                     "energy_j": None, "energy_source": None}
        if self._cpu is not None and (cpu_now := _cpu_seconds(self.server_pid)) is not None:
            out["server_cpu_s"] = cpu_now - self._cpu
            # In cores: 2.0 is two CPUs busy the whole run.
            out["server_cpu_utilization"] = out["server_cpu_s"] / max(wall_s, 1e-9)
        if self._gpu_samples:
            out["gpu_utilization"] = sum(self._gpu_samples) / len(self._gpu_samples)
        if self._energy:
            joules = 0.0
            for (before, wrap), (after, _) in zip(self._energy, _rapl_joules(self._zones)):
                joules += ((after - before) % (wrap + 1)) / 1e6
            out["energy_j"], out["energy_source"] = joules, "rapl"
        elif self.watts is not None:
            out["energy_j"], out["energy_source"] = self.watts * wall_s, f"stated {self.watts:g} W"
        return out


def task_summary(records: Sequence[RequestRecord], task_size: int, slo: SLO | None) -> dict:
    """Tasks of `task_size` consecutive requests (by index): a task succeeds
    when every request succeeds, and is good when every one is also inside
    the SLO. A trailing partial group is a task too."""
    if task_size < 1:
        raise ValueError("--task-size must be >= 1")
    by_task: dict[int, list[RequestRecord]] = {}
    for record in records:
        by_task.setdefault(record.index // task_size, []).append(record)
    successful = good = 0
    for members in by_task.values():
        if all(r.outcome == "success" for r in members):
            successful += 1
            good += all(is_good(r, record_latency(r), slo) for r in members)
    return {"task_size": task_size, "num_tasks": len(by_task), "successful_tasks": successful,
            "good_tasks": good if slo is not None else None}


def per_unit(summary: dict, resources: dict | None, tasks: dict | None) -> dict:
    """Cost and energy per successful request and per successful task."""
    num_success = summary["outcomes"]["success"]
    successful_tasks = tasks["successful_tasks"] if tasks else 0
    cost = summary.get("cost_total")
    energy = resources.get("energy_j") if resources else None

    def each(total, count):
        return total / count if total is not None and count else None
    return {"cost_per_successful_request": each(cost, num_success),
            "cost_per_successful_task": each(cost, successful_tasks),
            "energy_per_successful_request_j": each(energy, num_success),
            "energy_per_successful_task_j": each(energy, successful_tasks)}


def startup_summary(records: Sequence[RequestRecord], time_to_ready_s: float | None) -> dict:
    """Warm vs cold: the first requests' TTFT (in send order) against the
    rest's, and the time the server took to become ready (when it was
    started by the run)."""
    ordered = sorted((r for r in records if r.sent_s is not None), key=lambda r: r.sent_s)
    ttfts = [record_latency(r).ttft_s if r.outcome == "success" else None for r in ordered]
    first, rest = ttfts[:NUM_FIRST_REQUESTS], [t for t in ttfts[NUM_FIRST_REQUESTS:] if t is not None]
    return {"time_to_ready_s": time_to_ready_s, "first_requests_ttft_s": first,
            "later_ttft": summarize(rest)}
