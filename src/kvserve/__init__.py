"""kvserve: an LLM inference server whose unit of capacity is the KV cache."""

from kvserve import compiled, cpu_threads

# Before torch loads libgomp, which reads its wait policy once (kvserve/cpu_threads.py).
cpu_threads.set_openmp_defaults()
# Before anything imports a module that may be compiled: decides whether its
# extension module or its source serves it (kvserve/compiled/).
compiled.activate()

from kvserve.contract import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked for, so the pure-Python
    # core (contract, kv_cache, scheduler, plan, bench) stays light.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
