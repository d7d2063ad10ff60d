"""The package's shape: stages are subpackages, each imports only the stages before it, and functions stay short
(in lines and in parameters).

STAGES is the order the README's layout section lists: foundations (errors,
names, file safety), how mlx-dq runs (runtime), text (data), model sources and
streaming (model), quantizers (quant), quantized layers (layers), loading,
settings, the measure, plan and format stages, conversion, evaluation, the
Python API and the command line. A module may import modules of its own stage
and of earlier ones. Every import counts, in-function ones included, so an
import cycle cannot hide inside a function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_dq"

STAGES = [
    "mlx_dq.errors", "mlx_dq.names", "mlx_dq.safety",  # foundations
    "mlx_dq.runtime",  # OpenBLAS, worker threads, several ranks
    "mlx_dq.data",  # calibration and evaluation text
    "mlx_dq.model",  # model sources, input capture, the layer runner
    "mlx_dq.quant",  # storage arithmetic, RTN, GPTQ, the one quantizer dispatch
    "mlx_dq.layers",  # mixed-proportion layers, kernels, split tables
    "mlx_dq.loader", "mlx_dq.settings",  # loading an output folder; stage settings
    "mlx_dq.measure", "mlx_dq.plan", "mlx_dq.formats",  # the measure and plan stages; other tools' files
    "mlx_dq.conversion",  # plan resolution, quantize, write, card, hub, estimate, distill
    "mlx_dq.evaluation",  # perplexity, KL, plots
    "mlx_dq.api", "mlx_dq.cli", "mlx_dq.__main__", "mlx_dq",  # the Python API, the command line, the facade
]


def _stage(module: str) -> str:
    """The stage a module belongs to: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    return module if len(parts) == 1 else ".".join(parts[:2])


# functions longer than MAX_LINES, each with the reason it stays whole (see the README's layout section)
MAX_LINES = 80
LONG_FUNCTIONS = {
}

# functions outside click commands with more than MAX_PARAMETERS parameters, each with the reason
MAX_PARAMETERS = 10
LONG_PARAMETER_LISTS = {
    "mlx_dq.conversion.pipeline.convert": "the Python API: its keyword options mirror the CLI's settings",
    "mlx_dq.plan.solver.optimize": "the planning API: its keywords are the plan's rules, each recorded in the "
                                   "plan's settings (effort aside)",
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (``__version__`` from the package is metadata)."""
    is_pkg = path.name == "__init__.py"
    pkg = name if is_pkg else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "mlx_dq"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "mlx_dq":
                mod = node.module
            else:
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in known:
                    out.add(sub)
                elif not (mod == "mlx_dq" and a.name == "__version__"):
                    out.add(mod)
    out.discard(name)
    return {m for m in out if m in known}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_belongs_to_a_stage(graph):
    assert sorted({_stage(m) for m in graph} - set(STAGES)) == [], "add new stages to STAGES (and the README layout)"


def test_no_module_imports_a_later_stage(graph):
    rank = {s: i for i, s in enumerate(STAGES)}
    back = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                  if rank[_stage(d)] > rank[_stage(m)])
    assert back == []


def test_the_import_graph_has_no_cycle(graph):
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_the_checker_sees_in_function_and_relative_imports(tmp_path):
    src = "from .b import x\n\ndef f():\n    from ..c import y\n    import mlx_dq.d\n"
    path = tmp_path / "mlx_dq" / "pkg" / "a.py"
    path.parent.mkdir(parents=True)
    path.write_text(src)
    known = {"mlx_dq.pkg.b", "mlx_dq.c", "mlx_dq.d"}
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert _imports("mlx_dq.pkg.a", path, known) == known
    finally:
        ROOT = old


def _long_functions() -> dict[str, int]:
    out = {}
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef,)):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        sub.qualname = f"{node.name}.{sub.name}"  # type: ignore[attr-defined]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    out[f"{name}.{getattr(node, 'qualname', node.name)}"] = n
    return out


def test_functions_stay_short_except_the_listed_ones():
    long = _long_functions()
    assert sorted(set(long) - set(LONG_FUNCTIONS)) == [], long
    assert sorted(set(LONG_FUNCTIONS) - set(long)) == [], "a listed function got short: drop it from the list"


def _is_click_command(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Whether a decorator makes ``node`` a click command: ``@click.<anything>`` or a group's ``.command()``."""
    for d in node.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        while isinstance(f, ast.Attribute):
            if f.attr in ("command", "group"):
                return True
            f = f.value
        if isinstance(f, ast.Name) and f.id == "click":
            return True
    return False


def _parameter_counts(module: str, tree: ast.AST) -> dict[str, int]:
    """Every function of ``tree`` that is no click command -> its named parameters (``self``/``cls`` and
    ``*args``/``**kwargs`` not counted), by qualified name."""
    out = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = sub.args
                named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
                n = len(named) - (1 if named and named[0].arg in ("self", "cls") else 0)
                if not _is_click_command(sub):
                    out[f"{prefix}.{sub.name}"] = n
                visit(sub, f"{prefix}.{sub.name}")
            elif isinstance(sub, ast.ClassDef):
                visit(sub, f"{prefix}.{sub.name}")
            else:
                visit(sub, prefix)

    visit(tree, module)
    return out


def _long_parameter_lists() -> dict[str, int]:
    out = {}
    for name, path in _modules().items():
        counts = _parameter_counts(name, ast.parse(path.read_text(encoding="utf-8")))
        out.update({f: n for f, n in counts.items() if n > MAX_PARAMETERS})
    return out


def test_parameter_lists_stay_short_except_the_listed_ones():
    """No function outside click commands takes more than MAX_PARAMETERS parameters unless listed with a reason:
    a long list is grouped into a small value (settings, a frozen dataclass of options) instead."""
    long = _long_parameter_lists()
    assert sorted(set(long) - set(LONG_PARAMETER_LISTS)) == [], long
    assert sorted(set(LONG_PARAMETER_LISTS) - set(long)) == [], "a listed function got short: drop it from the list"
    assert all(isinstance(why, str) and why.strip() for why in LONG_PARAMETER_LISTS.values())


def test_the_parameter_checker_counts_functions_and_methods_but_not_click_commands():
    names = ", ".join(f"a{i}" for i in range(11))
    ten = names.removeprefix("a0, ")
    src = (f"import click\n\ndef f({names}): pass\n\ndef g(*args, {ten}, **kw): pass\n\n"
           f"class C:\n    def m(self, {names}): pass\n\n    def n(self, {ten}): pass\n\n"
           f"@click.command()\n@click.option('--a0')\ndef cmd({names}): pass\n\n"
           f"@main.command()\ndef sub({names}): pass\n\ndef outer():\n    def inner({names}): pass\n")
    counts = _parameter_counts("mlx_dq.x", ast.parse(src))
    assert {k: n for k, n in counts.items() if n > MAX_PARAMETERS} == {
        "mlx_dq.x.f": 11, "mlx_dq.x.C.m": 11, "mlx_dq.x.outer.inner": 11}
    assert counts["mlx_dq.x.g"] == counts["mlx_dq.x.C.n"] == 10
    assert "mlx_dq.x.cmd" not in counts and "mlx_dq.x.sub" not in counts


def test_readme_layout_lists_every_stage_in_order():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    section = section[: section.find("\n## ", 4) if "\n## " in section[4:] else len(section)]
    listed = re.findall(r"^\s{2}(\S+?)(?:/|\.py)\s", section, flags=re.M)
    names = [("__init__" if s == "mlx_dq" else s.removeprefix("mlx_dq.")) for s in STAGES]
    assert listed == names
