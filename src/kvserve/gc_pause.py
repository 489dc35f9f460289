"""Pausing the cyclic garbage collector around bulk work that makes no
reference cycles.

Generating a workload, simulating it and summarizing its records each
allocate hundreds of thousands of objects that stay alive. Every 700
allocations the collector scans its youngest generation, and its older
generations each time enough survivors pile up: passes over a growing live
set that free nothing (reference counting frees what these loops drop).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore its state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
