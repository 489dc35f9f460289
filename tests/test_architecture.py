"""The tree shows the architecture: every module is named in docs/architecture.md,
and the pure-Python core never imports torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvserve"


def test_every_module_is_named_in_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert modules, "found no modules: wrong path?"
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import kvserve.contract, kvserve.config, kvserve.latency\n"
        "import kvserve.kv_cache.manager, kvserve.scheduler.scheduler, kvserve.scheduler.policy\n"
        "try:\n    import kvserve.scheduler.admission\nexcept ModuleNotFoundError:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported by the pure-Python core'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
