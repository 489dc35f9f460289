"""The tree shows the architecture: every module is named in
docs/architecture.md, and the import rules stated there hold.

The rules are checked on the module graph drawn from the import statements
(tools/import_graph.py), every import counted, including those inside
functions: a lazy import still runs when its function does. Rules name
packages, not modules, so a module moving inside a package (or a package
being split, as scheduler/admission.py into admission/) keeps them true.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.import_graph import cycles, external_imports, module_graph, package_graph, package_of, reachable

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "kvserve"

# The pure-Python core and the thinking tools: no torch (nor transformers,
# which imports it), so they run anywhere and fast.
TORCH_FREE = ("kv_cache", "scheduler", "admission", "fleet", "model_facts", "plan", "sim", "structured",
              "gateway")
TORCH = ("torch", "transformers", "triton")
# bench speaks HTTP only: it measures any server, so it imports nothing of
# kvserve's engine, server or policies.
NOT_FOR_BENCH = ("engine", "model", "runner", "server", "scheduler", "kv_cache", "admission", "sim",
                 "fleet", "gateway", "ray")
# Modules exempt from their package's rule, with the reason (none now:
# `kvserve profile`, which times the real engine, lives in engine/).
EXEMPT: dict[str, str] = {}
# The gateway fronts servers over HTTP and reuses the server's torch-free
# front, never its engine: the OpenAI wire format and the SIGTERM drain
# (gateway is in TORCH_FREE, so these may not reach torch). The API keys
# file is admission's (admission/tenants.py), read by servers and fronts.
SERVER_FRONT = ("kvserve.server.protocol", "kvserve.server.draining")
# On Ray, a model replica hosts one whole server (serve's engine, admission
# and app) and `kvserve ray` takes serve's flags; the rest of ray/ (the
# ingress, router, autoscaling) is a fleet front like the gateway.
RAY_SERVER_HOSTS = ("kvserve.ray.replica", "kvserve.ray.flags")
# Packages that must exist, so a wrong path cannot make the rules vacuous.
REQUIRED = ("kv_cache", "scheduler", "model_facts", "plan", "sim", "bench", "engine", "server")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_graph()
    assert set(REQUIRED) <= {package_of(m) for m in modules}, "found none of the packages: wrong path?"
    return modules


def _modules_of(graph: dict[str, set[str]], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in graph if package_of(m) in packages and m not in EXEMPT)


def test_every_module_is_named_in_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    assert modules, "found no modules: wrong path?"
    missing = [m for m in modules if f"`{m}`" not in doc]
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_torch_free_packages_import_no_torch(graph):
    external = external_imports()
    offenders = {}
    for module in _modules_of(graph, TORCH_FREE):
        through = [m for m in sorted({module} | reachable(graph, module)) if external[m] & set(TORCH)]
        if through:
            offenders[module] = through
    assert not offenders, f"torch-free modules that reach torch (module: through): {offenders}"


def test_torch_free_packages_import_no_torch_at_run_time(graph):
    # The static rule cannot see into third-party packages: import every
    # module for real and look.
    modules = _modules_of(graph, TORCH_FREE)
    assert len(modules) > 10
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert not {'torch', 'transformers'} & set(sys.modules), f'{name} imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_bench_imports_nothing_of_the_engine(graph):
    external = external_imports()
    for module in _modules_of(graph, ("bench",)):
        reached = {module} | reachable(graph, module)
        engine = sorted(m for m in reached if package_of(m) in NOT_FOR_BENCH)
        assert not engine, f"{module} reaches {engine}"
        assert not [m for m in reached if external[m] & set(TORCH)], module


def test_nothing_imports_the_server_but_the_cli(graph):
    importers = sorted(m for m, targets in graph.items() if package_of(m) not in ("server", "gateway", "ray")
                       and any(package_of(t) == "server" for t in targets))
    assert importers in ([], ["kvserve.cli"]), importers
    fronts = {t for m, targets in graph.items() if package_of(m) in ("gateway", "ray") and m not in RAY_SERVER_HOSTS
              for t in targets if package_of(t) == "server"}
    assert fronts <= set(SERVER_FRONT), sorted(fronts - set(SERVER_FRONT))


def test_no_import_cycles(graph):
    assert cycles(graph) == [], "modules importing each other"
    assert cycles(package_graph(graph)) == [], "packages importing each other"


def test_the_rules_catch_what_they_forbid(tmp_path):
    # The checks on a small fake tree: each rule must see its violation.
    from tools import import_graph

    src = tmp_path / "src" / "kvserve"
    for name, text in {
        "__init__.py": "",
        "plan/__init__.py": "",
        "plan/cli.py": "def run():\n    from kvserve.sim import model\n",
        "sim/__init__.py": "",
        "sim/model.py": "from kvserve.plan import cli\nimport torch.nn\n",
        "bench/__init__.py": "",
        "bench/report.py": "from . import plots\n",
        "bench/plots.py": "from kvserve.bench.report import x\n",
    }.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    fake = import_graph.module_graph(tmp_path / "src")
    assert fake["kvserve.plan.cli"] == {"kvserve.sim.model"}  # a lazy import counts
    assert import_graph.cycles(fake) == [["kvserve.bench.plots", "kvserve.bench.report"],
                                         ["kvserve.plan.cli", "kvserve.sim.model"]]
    assert import_graph.cycles(import_graph.package_graph(fake)) == [["plan", "sim"]]
    assert import_graph.external_imports(tmp_path / "src")["kvserve.sim.model"] == {"torch"}
    assert "kvserve.sim.model" in import_graph.reachable(fake, "kvserve.plan.cli")


# Underscore names that are public API (namedtuple's), not private members.
PUBLIC_UNDERSCORE = frozenset({"_asdict", "_replace", "_fields", "_make", "_field_defaults"})


def _private_reaches(source: str) -> list[str]:
    """`obj._name` where obj is not self / cls and no class or function of
    this module defines `_name`: a reach into another module's privates
    (within one module, a class's helpers may use each other's)."""
    import ast

    tree = ast.parse(source)
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)  # a dataclass field
    reaches = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if node.attr not in own and node.attr not in PUBLIC_UNDERSCORE:
            reaches.append(f"{node.lineno}: {ast.unparse(node)}")
    return reaches


def test_no_module_reaches_into_another_modules_privates():
    found = {p.relative_to(PACKAGE).as_posix(): r for p in sorted(PACKAGE.rglob("*.py"))
             if (r := _private_reaches(p.read_text(encoding="utf-8")))}
    assert not found, f"private members used across modules (module: line: expression): {found}"


def test_the_private_reach_check_sees_a_reach():
    source = ("class A:\n    def __init__(self):\n        self._mine = 1\n\n"
              "def f(a, b):\n    return a._mine, b._theirs, b.core._state, p._asdict()\n")
    assert _private_reaches(source) == ["6: b._theirs", "6: b.core._state"]


def _environment_reads(path: Path) -> set[str]:
    """Names of the environment variables a module reads: os.environ.get(K),
    os.environ[K], os.getenv(K), with K a string or a module-level constant."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def name(node: ast.expr) -> str:
        if isinstance(node, ast.Constant):
            return node.value
        return constants[node.id]  # a KeyError names a read this helper cannot resolve

    def is_environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and (
                (node.func.attr == "get" and is_environ(node.func.value)) or node.func.attr == "getenv"):
            reads.add(name(node.args[0]))
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            reads.add(name(node.slice))
    return reads


def test_every_environment_variable_kvserve_reads_is_documented():
    readme = (ROOT / "README.md").read_text()
    reads = {var: path.relative_to(PACKAGE).as_posix() for path in sorted(PACKAGE.rglob("*.py"))
             for var in _environment_reads(path)}
    assert {"KVSERVE_PURE_PYTHON", "KVSERVE_TORCH_ATTENTION"} <= set(reads)  # the helper finds them
    missing = {var: module for var, module in reads.items() if f"`{var}" not in readme}
    assert not missing, f"README.md's environment table lacks: {missing}"
