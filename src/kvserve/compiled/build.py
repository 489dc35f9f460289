"""Building the compiled core in place (`python -m kvserve.compiled build`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.compiled import (COMPILED_MODULES, EXTENSION_SUFFIX, GROUP_NAME, PURE_PYTHON_ENV, SOURCE_ROOT, digest,
                              manifest_path, source_path)


def clean(root: Path = SOURCE_ROOT) -> list[Path]:
    """Remove the compiled core (unlinked, so a process that has it loaded
    keeps running on its mapping); returns what was removed. Every extension
    module in the package goes, also of a module compiled by an earlier
    COMPILED_MODULES: kvserve has no native code of its own."""
    removed = list((root / "kvserve").rglob(f"*{EXTENSION_SUFFIX}"))
    removed += list(root.glob(f"{GROUP_NAME}__mypyc*"))
    removed.append(manifest_path(root))
    removed = [p for p in removed if p.exists()]
    for path in removed:
        path.unlink()
    return removed


_SETUP = """
import sys
from mypyc.build import mypycify
from setuptools import setup

build_dir, group_name, *paths_and_options = sys.argv[1:]
# Everything but the extension modules themselves stays in build_dir.
sys.argv = [sys.argv[0], "build_ext", "--inplace", "--build-temp", build_dir, "--build-lib", build_dir]
setup(name="kvserve-compiled-core", packages=[],
      ext_modules=mypycify(paths_and_options, opt_level="3", group_name=group_name,
                           target_dir=build_dir, multi_file=True))
"""


def build(root: Path = SOURCE_ROOT) -> None:
    """Type-check and compile COMPILED_MODULES in place; write the manifest
    last, so an interrupted build leaves the sources in charge."""
    if importlib.util.find_spec("mypyc") is None:
        raise SystemExit("kvserve: building the compiled core needs mypy (pip install -e '.[compile]')")
    clean(root)
    sources = [source_path(m, root) for m in COMPILED_MODULES]
    digests = {m: digest(p) for m, p in zip(COMPILED_MODULES, sources)}
    arguments = [str(p.relative_to(root)) for p in sources]
    # The project's mypy settings (pyproject.toml) keep the type check off
    # torch and the server, which these modules never import.
    config = root.parent / "pyproject.toml"
    if config.is_file():
        arguments.append(f"--config-file={config}")
    with tempfile.TemporaryDirectory(prefix="kvserve-mypyc-") as build_dir:
        # A child process: the C compiler's output and any failure stay
        # apart from this one, which may have the old core loaded.
        env = {**os.environ, PURE_PYTHON_ENV: "1"}
        arguments.append(f"--cache-dir={build_dir}/mypy-cache")
        done = subprocess.run([sys.executable, "-c", _SETUP, build_dir, GROUP_NAME, *arguments],
                              cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # the compiler's log only when it failed
            sys.stderr.write(done.stdout[-20000:] + done.stderr[-20000:])
            clean(root)
            raise SystemExit(f"kvserve: mypyc failed (exit {done.returncode}); the sources stay in use")
    manifest = {"python": sys.implementation.cache_tag, "sources": digests,
                "mypy": _version("mypy"), "built_by": "python -m kvserve.compiled build"}
    manifest_path(root).write_text(json.dumps(manifest, indent=1) + "\n")


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None
