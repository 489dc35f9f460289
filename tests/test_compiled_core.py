"""The optional compiled core (kvserve/compiled): used only with the very
sources it was built from, and reported honestly either way."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvserve
from kvserve.compiled import (COMPILED_MODULES, EXTENSION_SUFFIX, GROUP_NAME, PURE_PYTHON_ENV, SOURCE_ROOT, digest,
                              extension_path, manifest_path, source_path, why_not_compiled)
from kvserve.compiled.build import clean


def _module_files() -> dict[str, str]:
    return {name: importlib.import_module(name).__file__ for name in COMPILED_MODULES}


def test_status_matches_the_modules_in_use():
    files = _module_files()
    compiled = kvserve.compiled.status()["compiled"]
    for name, file in files.items():
        assert file.endswith(EXTENSION_SUFFIX if compiled else ".py"), (name, file, kvserve.compiled.status())


@pytest.mark.skipif(os.environ.get("KVSERVE_REQUIRE_COMPILED") != "1",
                    reason="only under `make test-compiled`")
def test_required_core_is_in_use():
    # `make test-compiled` must not pass on the sources by accident.
    assert kvserve.compiled.status() == {"compiled": True, "reason": "compiled by mypyc",
                                         "core": "compiled by mypyc"}
    assert all(f.endswith(EXTENSION_SUFFIX) for f in _module_files().values())


def _copy_sources(root: Path) -> None:
    for name in COMPILED_MODULES:
        target = source_path(name, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source_path(name), target)


def _write_manifest(root: Path, **changes) -> None:
    digests = {name: digest(source_path(name, root)) for name in COMPILED_MODULES}
    manifest = {"python": sys.implementation.cache_tag, "sources": digests, **changes}
    manifest_path(root).parent.mkdir(parents=True, exist_ok=True)
    manifest_path(root).write_text(json.dumps(manifest))


def test_why_not_compiled_names_each_reason(tmp_path, monkeypatch):
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    _copy_sources(tmp_path)
    assert why_not_compiled(tmp_path) == "not built; make compile builds it"
    _write_manifest(tmp_path)
    assert why_not_compiled(tmp_path) == f"its shared library {GROUP_NAME}__mypyc is missing"
    # Stand-ins: only their presence is checked.
    (tmp_path / f"{GROUP_NAME}__mypyc{EXTENSION_SUFFIX}").touch()
    assert why_not_compiled(tmp_path) == f"{COMPILED_MODULES[0]} has no compiled extension"
    for name in COMPILED_MODULES:
        extension_path(name, tmp_path).touch()
    assert why_not_compiled(tmp_path) is None
    scheduler = tmp_path / "kvserve" / "scheduler" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\n# an edit after the build\n")
    assert why_not_compiled(tmp_path) == (
        "kvserve/scheduler/scheduler.py changed since it was compiled (make compile)")
    _write_manifest(tmp_path, python="cpython-39")
    assert why_not_compiled(tmp_path) == f"built for cpython-39, running {sys.implementation.cache_tag}"
    manifest_path(tmp_path).write_text("{not json")
    assert why_not_compiled(tmp_path).startswith("unreadable ")
    _write_manifest(tmp_path)
    monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    assert why_not_compiled(tmp_path) == f"{PURE_PYTHON_ENV} is set"
    removed = clean(tmp_path)
    assert manifest_path(tmp_path) in removed and not list(tmp_path.rglob(f"*{EXTENSION_SUFFIX}"))
    assert why_not_compiled(tmp_path) == f"{PURE_PYTHON_ENV} is set"
    monkeypatch.delenv(PURE_PYTHON_ENV)
    assert why_not_compiled(tmp_path) == "not built; make compile builds it"


_REPORT_FILES = textwrap.dedent("""
    import importlib, json, warnings
    warnings.simplefilter("always")
    import kvserve
    from kvserve.compiled import COMPILED_MODULES
    files = {n: importlib.import_module(n).__file__ for n in COMPILED_MODULES}
    print(json.dumps({"status": kvserve.compiled.status(), "files": files}))
""")


def _import_in(root: Path) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop(PURE_PYTHON_ENV, None)
    done = subprocess.run([sys.executable, "-c", _REPORT_FILES], env=env, capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


@pytest.mark.skipif(not kvserve.compiled.status()["compiled"], reason="needs the built core (make compile)")
def test_an_edited_source_is_imported_from_python_not_its_stale_build(tmp_path):
    # A copy of the whole package with its build: the build serves it, until
    # one source changes; then every module comes from its source (the
    # compiled ones call each other directly, so none can stay).
    shutil.copytree(SOURCE_ROOT / "kvserve", tmp_path / "kvserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for library in SOURCE_ROOT.glob(f"{GROUP_NAME}__mypyc*"):
        shutil.copy(library, tmp_path / library.name)
    report, _ = _import_in(tmp_path)
    assert report["status"]["compiled"] is True
    assert all(f.startswith(str(tmp_path)) and f.endswith(EXTENSION_SUFFIX) for f in report["files"].values())

    admission = tmp_path / "kvserve" / "admission" / "controller.py"
    admission.write_text(admission.read_text() + "\n# an edit after the build\n")
    report, stderr = _import_in(tmp_path)
    assert report["status"]["compiled"] is False
    assert "kvserve/admission/controller.py changed since it was compiled" in report["status"]["reason"]
    assert all(f.startswith(str(tmp_path)) and f.endswith(".py") for f in report["files"].values())
    assert "compiled core not used" in stderr
