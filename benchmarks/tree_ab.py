"""What the A/B benchmarks of two source trees share (prefill_ab.py,
decode_ab.py): a worker process per tree, running that tree's kvserve
(PYTHONPATH=TREE/src, its own built _kvq.so) on this checkout's .venv and
answering the driver line by line, and the default model's EngineCore it
times. Not a benchmark itself."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def start_worker(script: str, tree: Path, *args: str) -> subprocess.Popen:
    """`script --worker ARGS` on `tree`'s sources, once it has said "ready"."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    proc = subprocess.Popen([sys.executable, script, "--worker", *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(tree))
    assert proc.stdout.readline().strip() == "ready", f"the worker for {tree} did not start"
    return proc


def default_model_core(threads: int, **engine_fields):
    """The default model's EngineCore (the shipped Q4_1 computed quantized,
    1 GiB of KV cache, and any other EngineConfig fields given) on `threads`
    torch threads."""
    import torch

    from kvserve.engine.core import EngineConfig, EngineCore
    from kvserve.model.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(None, quantization="auto")
    return EngineCore(loaded.config, loaded.weights, loaded.tokenizer,
                      EngineConfig(**{"quantization": "auto", "device": "cpu", "kv_cache_memory_bytes": 2**30,
                                      **engine_fields}))


def timed_decode_steps(core, requests) -> list[float]:
    """Add `requests`, step until each has its first token, then the wall
    time (s) of every step until all are done."""
    for request in requests:
        core.add_request(request)
    while any(r.num_output_tokens == 0 for r in requests):
        core.step()
    steps = []
    while core.has_unfinished():
        t0 = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t0)
    return steps
