"""The CPU compute threads: how they wait, set before torch loads libgomp.

Two kinds of threads compute a step on the CPU: torch's intra-op pool
(OpenMP, the libgomp.so.1 torch's wheel ships) for torch ops, and the
quantized kernels' own pool (csrc/kvq_kernels.c) for the matmuls and decode
attention. Both take torch's thread count (`--torch-threads`,
torch.set_num_threads; the kernels read it on every call, so the server's
engine thread gets it too).

The kernels' pool never makes its caller wait for a helper that has not
started, so it degrades to one thread's speed when the other core is busy.
An OpenMP team cannot: every member joins every region's barrier, and by
default libgomp lets an idle member spin ~300,000 iterations (milliseconds)
before it sleeps, taking the core another process wants. On this 2-core
shared machine 2 OpenMP threads ran a decode step 10-20x slower than 1 with
the machine loaded. The torch ops left in a quantized step are few, but a
float (`--quantization none`) step is all torch.

libgomp reads its wait policy once, when it loads, so `set_openmp_defaults`
runs at `import kvserve` (before anything there imports torch) and only
fills in what the user left unset: an exported OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins. Where torch was imported before kvserve the policy is
libgomp's own, and `wait_policy_note` (logged at engine start) says so.
Figures: benchmarks/cpu_threads.py.
"""

from __future__ import annotations

import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
# What kvserve sets when the user set neither: spin ~10,000 iterations (about
# 0.1 ms) before sleeping. The next region of a step usually starts within
# that, and a worker that lost its core to another process gives it back
# almost at once (benchmarks/cpu_threads.py compares this with PASSIVE, no
# spin at all, and libgomp's own 300,000).
DEFAULTS = {SPIN_COUNT: "10000"}

_applied: dict[str, str] = {}
_torch_loaded_first = False


def set_openmp_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Fill in the OpenMP wait policy in `environ` (default os.environ) unless
    the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT; returns what was set."""
    global _torch_loaded_first
    env = os.environ if environ is None else environ
    if env.get(WAIT_POLICY) is not None or env.get(SPIN_COUNT) is not None:
        return {}
    env.update(DEFAULTS)
    if environ is None:
        _torch_loaded_first = "torch" in sys.modules
        _applied.update(DEFAULTS)
    return dict(DEFAULTS)


def wait_policy_note() -> str:
    """One line for the start-up log: the wait policy the OpenMP threads run with."""
    if _torch_loaded_first:
        return ("OpenMP wait policy: libgomp's own (torch was imported before kvserve, so kvserve's "
                f"{SPIN_COUNT}={DEFAULTS[SPIN_COUNT]} came too late; import kvserve first or export it)")
    policy, spin_count = os.environ.get(WAIT_POLICY), os.environ.get(SPIN_COUNT)
    values = [f"{name}={value}" for name, value in ((WAIT_POLICY, policy), (SPIN_COUNT, spin_count)) if value]
    source = "kvserve's default" if _applied else "from the environment"
    return f"OpenMP wait policy: {', '.join(values) or 'libgomp default'} ({source})"
