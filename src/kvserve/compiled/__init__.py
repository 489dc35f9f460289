"""The optional compiled core: the scheduler, KV cache, admission and simulator built by mypyc.

`kvserve simulate` runs the real scheduler, KV cache manager and admission
controller, so a simulated hour costs their Python per request (~600 us of
it, spread over some thirty functions: docs/performance.md). mypyc compiles
these same modules, type-checked as written, into C extension modules that
run them about twice as fast. Nothing else changes: the source stays the one
the server runs and the tests read.

The build is optional and in place (`make compile`, i.e. `python -m
kvserve.compiled build` with mypy installed; build.py): each module gains a
`.so` beside its `.py`, and `manifest.json` here records the sha256 of every
source compiled.
A compiled module is only ever used together with the source it was built
from: `activate()` (run by `kvserve/__init__.py` before any of them is
imported) checks the digests, and when a source has changed since, or
KVSERVE_PURE_PYTHON=1 is set, it loads the `.py` files instead and says why
in `status()`.

How the compiled modules are written, for mypyc (these notes live here, not
beside each line they explain):
- Module constants are `Final`: mypyc inlines them instead of a lookup in
  the module's dict at every use.
- Hot loops call a collaborator's methods through a local (`kv = self._kv`
  in a decode run's loops): compiled, those are direct C calls into the
  native class; in Python, one attribute lookup less per call.
- `step2 = key // n; index = key - step2 * n` instead of `divmod()`: no
  tuple, and native integers when compiled (sim/fast_forward.py).
- Sort keys are `operator.attrgetter` (scheduler.URGENCY): a C-level getter
  in either build.
- `SamplingParams` stays a plain Python class (`mypyc_attr(native_class=
  False)`, contract.py): it takes whatever a caller passes and its own
  checks name the wrong field, where a native class would refuse the type
  first.
- An argument typed with a native class must be an instance of it at run
  time, so a proxy (the simulator trace's recorder of admission calls,
  sim/replica.py) goes through a slot typed `Any` (AdmissionLoop.controller).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

# The modules the simulator's hot loop runs, in dependency order. Each must
# type-check under mypy (mypyc compiles nothing else) and stay importable as
# plain Python.
COMPILED_MODULES = (
    "kvserve.contract",  # Request; SamplingParams stays a Python class (see there)
    "kvserve.kv_cache.hashing",
    "kvserve.kv_cache.block_pool",
    "kvserve.kv_cache.manager",
    "kvserve.scheduler.policy",
    "kvserve.admission.decision",
    "kvserve.admission.busy_rate",
    "kvserve.admission.quotas",
    "kvserve.admission.retry_after",
    "kvserve.admission.step_time",
    "kvserve.admission.step_limits",
    "kvserve.admission.controller",
    "kvserve.admission.loop",
    "kvserve.scheduler.scheduler",
    "kvserve.sim.fast_forward",
    "kvserve.plan.roofline",  # the roofline step time (sim.cost_model's, shared with `kvserve plan`)
    "kvserve.sim.cost_model",
    "kvserve.fleet.backend_state",
    "kvserve.fleet.router",
    "kvserve.sim.clock",
    "kvserve.sim.replica",
    "kvserve.sim.simulator",
)
# mypyc puts the compiled code of all modules in one shared library, a
# top-level module beside the package (mypyc 2.4 cannot build one inside a
# package in multi-file mode); each module's own extension is a small shim
# that loads its part of it.
GROUP_NAME = "kvserve_native"
PURE_PYTHON_ENV = "KVSERVE_PURE_PYTHON"

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds kvserve/
MANIFEST_NAME = "manifest.json"
EXTENSION_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so

_status: dict = {"compiled": False, "reason": "not activated"}


def source_path(module: str, root: Path = SOURCE_ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_suffix(".py")


def extension_path(module: str, root: Path = SOURCE_ROOT) -> Path:
    return root.joinpath(*module.split(".")).with_name(module.rsplit(".", 1)[-1] + EXTENSION_SUFFIX)


def manifest_path(root: Path = SOURCE_ROOT) -> Path:
    return root / "kvserve" / "compiled" / MANIFEST_NAME


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _PreferSource(importlib.abc.MetaPathFinder):
    """Loads the listed modules from their `.py` files, never from the
    extension modules next to them (which the default finder prefers)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.names = frozenset(COMPILED_MODULES)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname, self.root))


def _pure_python_asked() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def why_not_compiled(root: Path = SOURCE_ROOT) -> str | None:
    """None when the compiled core under `root` is built and matches its
    sources; otherwise the reason it cannot be used."""
    if _pure_python_asked():
        return f"{PURE_PYTHON_ENV} is set"
    path = manifest_path(root)
    if not path.is_file():
        return "not built; make compile builds it"
    try:
        manifest = json.loads(path.read_text())
        digests = manifest["sources"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {path}: {exc}"
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"built for {manifest.get('python')}, running {sys.implementation.cache_tag}"
    if not any(root.glob(f"{GROUP_NAME}__mypyc*{EXTENSION_SUFFIX}")):
        return f"its shared library {GROUP_NAME}__mypyc is missing"
    for module in COMPILED_MODULES:
        if not extension_path(module, root).is_file():
            return f"{module} has no compiled extension"
        if digests.get(module) != digest(source_path(module, root)):
            return f"{source_path(module, root).relative_to(root)} changed since it was compiled (make compile)"
    return None


def activate(root: Path = SOURCE_ROOT) -> None:
    """Decide, once per process and before any compiled module is imported,
    whether the extension modules or the sources serve them."""
    if _status["reason"] != "not activated":
        return
    reason = why_not_compiled(root)
    if reason is None:
        _status.update(compiled=True, reason="compiled by mypyc")
        return
    _status.update(compiled=False, reason=reason)
    if any(extension_path(m, root).is_file() for m in COMPILED_MODULES):
        sys.meta_path.insert(0, _PreferSource(root))
        if not _pure_python_asked():  # a build is there but cannot serve: say so
            warnings.warn(f"kvserve: compiled core not used, {reason}", RuntimeWarning, stacklevel=2)


def status() -> dict:
    """{"compiled": bool, "reason": str, "core": a one-line description}."""
    core = "compiled by mypyc" if _status["compiled"] else f"pure Python, {_status['reason']}"
    return {**_status, "core": core}
