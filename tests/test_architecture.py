"""The package's shape: modules import only modules before them in the pipeline order, and functions stay short.

The order below is the one the README's layout section lists (foundations,
model sources, quantizers, the layer runner, measuring, optimizing, formats,
the output folder, converting, evaluating, the command line). Every import
counts, in-function ones included, so an import cycle cannot hide inside a
function.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlx_dq"

PIPELINE_ORDER = [
    # foundations: names, options, file safety, calibration text, input capture, ranks
    "mlx_dq.errors", "mlx_dq.openblas", "mlx_dq.names", "mlx_dq.options", "mlx_dq.keeprules", "mlx_dq.safety", "mlx_dq.kernels",
    "mlx_dq.threads", "mlx_dq.cpu_forward", "mlx_dq.calib", "mlx_dq.capture", "mlx_dq.replay", "mlx_dq.distributed",
    # model sources and loading
    "mlx_dq.gguf_io", "mlx_dq.sources",
    # quantizers and quantized layers
    "mlx_dq.quant", "mlx_dq.linalg", "mlx_dq.gptq", "mlx_dq.mixed", "mlx_dq.rowsplit", "mlx_dq.loader", "mlx_dq.grids",
    "mlx_dq.settings",
    # streaming a model, the one quantizer dispatch
    "mlx_dq.runner", "mlx_dq.quantize",
    # measuring
    "mlx_dq.measurement", "mlx_dq.measure",
    # optimizing, and plans/measurements in other formats
    "mlx_dq.optimize", "mlx_dq.baselines",
    "mlx_dq.formats.common", "mlx_dq.formats.facts", "mlx_dq.formats.exl2", "mlx_dq.formats.dashq",
    "mlx_dq.formats.dynquant", "mlx_dq.formats.mlx_kept16",
    # the output folder, reading it back, the formats dispatch
    "mlx_dq.writer", "mlx_dq.report", "mlx_dq.formats", "mlx_dq.plans", "mlx_dq.card", "mlx_dq.hub",
    # estimating; distilling a quantized model's scales and biases (a stage of its own and a step of convert)
    "mlx_dq.estimate", "mlx_dq.distill",
    # converting, and the Python API
    "mlx_dq.convert", "mlx_dq.api",
    # evaluating, plotting
    "mlx_dq.evaluate", "mlx_dq.plots",
    # the command line and the package facade
    "mlx_dq.cli", "mlx_dq.__main__", "mlx_dq",
    # a standalone script that composes the calibration text
    "mlx_dq.data.compose_calibration",
]

# functions longer than MAX_LINES, each with the reason it stays whole (see the README's layout section)
MAX_LINES = 80
LONG_FUNCTIONS = {
    "mlx_dq.gptq.gptq_core": "the GPTQ inner loop, one numeric kernel whose steps share the column state",
    "mlx_dq.gptq.gptq_quantize_many": "GPTQ's setup around the kernel: banks, options, channel order, factor cache, stats",
    "mlx_dq.optimize._build": "builds the knapsack's item table in one pass over the measurement",
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


def test_every_module_has_a_place_in_the_pipeline_order(graph):
    assert sorted(graph) == sorted(PIPELINE_ORDER), "add new modules to PIPELINE_ORDER (and the README layout)"


def test_no_module_imports_a_later_one(graph):
    rank = {m: i for i, m in enumerate(PIPELINE_ORDER)}
    back = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps if rank[d] > rank[m])
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


def test_readme_layout_lists_every_module_in_pipeline_order():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout"):]
    section = section[: section.find("\n## ", 4) if "\n## " in section[4:] else len(section)]
    listed = re.findall(r"^\s{2}(\S+\.py)\s", section, flags=re.M)
    files = [("__init__.py" if m == "mlx_dq" else m.removeprefix("mlx_dq.").replace(".", "/") + ".py")
             for m in PIPELINE_ORDER]
    files = [f if f != "formats.py" else "formats/__init__.py" for f in files]
    assert listed == files
