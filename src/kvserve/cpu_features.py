"""What this CPU's native kernels (kvserve/model/_kvq.so) can run, asked
through ctypes without torch, so `kvserve plan` sizes what `kvserve serve`
would hold on this machine (model/quantized.py asks the same)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

KERNELS_PATH = Path(__file__).parent / "model" / "_kvq.so"


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    if not KERNELS_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(KERNELS_PATH))
    except OSError:
        return None
    lib.kvq_has_amx_bf16.restype = ctypes.c_int
    return lib


def amx_bf16_available() -> bool:
    """The kernels are built, the CPU has AMX-BF16, Linux grants the tile
    state, and no portable path is pinned (KVSERVE_KVQ_PORTABLE=1)."""
    lib = _kernels()
    return lib is not None and os.environ.get("KVSERVE_KVQ_PORTABLE", "0") != "1" and bool(lib.kvq_has_amx_bf16())
