"""Figures for exploring a measurement, a plan and the quality table.

Every function returns a matplotlib ``Figure`` built without pyplot (safe on
headless machines and in notebooks); pass ``ax`` to draw into existing axes.

Tensors are placed by *layer* (the number after ``layers``/``h``/``blocks`` in
their path, else the first number) and by *kind* (the rest of the path, e.g.
``self_attn.q_proj``; further numbers such as expert indices become ``*``).
Modules measured jointly (ExLlamaV2's current form: ``model.layers.N.self_attn``
and ``.mlp``) are one unit each, with the module's error and bits per weight.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from mlx_dq.errors import InputError
from mlx_dq.measure.records import Measurement
from mlx_dq.names import LAYER_RE
from mlx_dq.quant.options import QuantOption

_NUMBER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")
_INNER_NUMBER = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")
_KIND_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "self_attn", "attn",
               "gate_proj", "up_proj", "gate_up_proj", "down_proj", "mlp")


# --------------------------------------------------------------------------- data
@dataclass(frozen=True)
class Curve:
    """The measured options of one tensor (or jointly measured module), sorted by bits per weight.

    ``options`` holds each point's MLX option description(s): one for a tensor, one per member for a module.
    """

    key: str
    layer: int | None
    kind: str
    role: str
    bpw: np.ndarray
    err: np.ndarray
    options: tuple[tuple[str, ...], ...]
    importance: float = 1.0


def layer_and_kind(key: str) -> tuple[int | None, str]:
    """Layer index and kind of a tensor path: ``model.layers.3.self_attn.q_proj`` -> ``(3, "self_attn.q_proj")``.

    Paths without a number (embedding, head) give ``(None, path)``.
    """
    path = key[: -len(".weight")] if key.endswith(".weight") else key
    found = LAYER_RE.search(path) or _NUMBER.search(path)
    if found is None:
        return None, path
    rest = path[found.end():].lstrip(".")
    # a numbered module that is itself the tensor (``blocks.2``) takes the container's name
    kind = rest or path[: found.start()].rsplit(".", 1)[-1] or found.group(0).strip(".").split(".")[0]
    return int(found.group(found.lastindex)), _INNER_NUMBER.sub("*", kind)


def _pareto(bpw: np.ndarray, err: np.ndarray) -> np.ndarray:
    """Indices (in bpw order) of options that no cheaper-or-equal option beats on error."""
    keep, best = [], math.inf
    for i in np.lexsort((err, bpw)):
        if err[i] < best:
            keep.append(i)
            best = err[i]
    return np.array(keep, dtype=int)


def sensitivity_curves(measurement: Measurement, frontier: bool = False) -> list[Curve]:
    """One :class:`Curve` per measured tensor or joint module; ``frontier`` keeps only Pareto-best options.

    Raises ValueError when nothing in the measurement has a measured error.
    """
    curves: list[Curve] = []
    grouped = measurement.grouped_keys()
    units: list[tuple[str, str, float, list[tuple[float, float, tuple[str, ...]]]]] = []
    for t in measurement.tensors.values():
        if t.key not in grouped:
            pts = [(o.bpw, o.err, (o.desc,)) for o in t.options if o.err is not None]
            units.append((t.key, t.role, t.importance, pts))
    for g in measurement.groups.values():
        numel = sum(measurement.tensors[k].numel for k in g.members)
        pts = [(o.total_bits / numel, o.err, tuple(r.desc for r in o.members.values())) for o in g.options]
        units.append((g.key, "module", g.importance, pts))
    for key, role, importance, pts in units:
        if not pts:
            continue
        bpw = np.array([p[0] for p in pts], dtype=float)
        err = np.array([p[1] for p in pts], dtype=float)
        idx = _pareto(bpw, err) if frontier else np.lexsort((err, bpw))
        layer, kind = layer_and_kind(key)
        curves.append(Curve(key, layer, kind, role, bpw[idx], err[idx], tuple(pts[i][2] for i in idx), importance))
    if not curves:
        raise InputError("the measurement has no measured options to plot (it is empty or holds no errors)")
    return curves


def _kind_sort_key(kind: str, first_seen: int) -> tuple:
    last = kind.rsplit(".", 1)[-1]
    return (_KIND_ORDER.index(last) if last in _KIND_ORDER else len(_KIND_ORDER), first_seen)


def _kinds(pairs: Iterable[tuple[str, bool]]) -> list[str]:
    """Distinct kinds of (kind, has_no_layer) pairs: layered ones in attention-then-MLP order, then the rest."""
    seen: dict[str, tuple[bool, int]] = {}
    for kind, unlayered in pairs:
        if kind not in seen:
            seen[kind] = (unlayered, len(seen))
    return sorted(seen, key=lambda k: (seen[k][0], *_kind_sort_key(k, seen[k][1])))


# --------------------------------------------------------------------------- layout
def _panels(
    ax: Axes | Sequence[Axes] | None, n: int, ncols: int, size: tuple[float, float]
) -> tuple[Figure, list[Axes]]:
    """A new figure with ``n`` panels, or the figure of the ``n`` axes the caller passed."""
    if ax is None:
        ncols = max(1, min(ncols, n))
        nrows = math.ceil(n / ncols)
        fig = Figure(figsize=(size[0] * ncols + 1.0, size[1] * nrows), layout="constrained")
        axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
        for extra in axes[n:]:
            fig.delaxes(extra)
        return fig, axes[:n]
    axes = [ax] if isinstance(ax, Axes) else list(ax)
    if len(axes) != n or not all(isinstance(a, Axes) for a in axes):
        raise ValueError(f"this figure needs {n} axes, got {len(axes)}")
    return axes[0].figure, axes


def _grid_matrix(cells: Iterable[tuple[int, str, float]]) -> tuple[np.ndarray, list[int], list[str]]:
    """A layers x kinds matrix from (layer, kind, value) cells: NaN where none, the largest where several."""
    cells = list(cells)
    layers = sorted({c[0] for c in cells})
    kinds = _kinds((c[1], False) for c in cells)
    mat = np.full((len(layers), len(kinds)), np.nan)
    li = {v: i for i, v in enumerate(layers)}
    ki = {v: i for i, v in enumerate(kinds)}
    for layer, kind, value in cells:
        mat[li[layer], ki[kind]] = np.fmax(mat[li[layer], ki[kind]], value)
    return mat, layers, kinds


def _draw_matrix(ax: Axes, mat: np.ndarray, layers: list[int], kinds: list[str], norm: Normalize, cmap: str,
                 annotate: bool) -> Any:
    """Draw a layers x kinds matrix with readable ticks; NaN cells stay blank."""
    image = ax.imshow(np.ma.masked_invalid(mat), aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=8)
    step = max(1, math.ceil(len(layers) / 16))
    ax.set_yticks(range(0, len(layers), step), [str(v) for v in layers[::step]], fontsize=8)
    ax.set_ylabel("layer")
    if annotate and mat.size <= 160:
        for (i, j), v in np.ndenumerate(mat):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6,
                        color="k" if norm(v) > 0.6 else "w")
    return image


# --------------------------------------------------------------------------- figures
def error_vs_bpw(
    measurement: Measurement,
    role: str | None = None,
    *,
    ax: Axes | Sequence[Axes] | None = None,
    frontier: bool = True,
    cmap: str = "viridis",
) -> Figure:
    """Measured error against bits per weight: a panel per tensor kind, a curve per layer coloured by depth.

    ``role`` limits the figure to one kind (``q_proj``, ``self_attn.q_proj``) or
    grid role (``attn_in``). ``frontier`` draws only options that no cheaper one
    beats, the choices an optimizer would consider.
    """
    curves = sensitivity_curves(measurement, frontier=frontier)
    kinds = _kinds((c.kind, c.layer is None) for c in curves)
    if role is not None:
        roles = sorted({c.role for c in curves})
        chosen = [k for k in kinds if role in (k, k.rsplit(".", 1)[-1])
                 or any(c.role == role for c in curves if c.kind == k)]
        if not chosen:
            raise InputError(f"unknown role {role!r}: this measurement has the kinds "
                             f"{', '.join(kinds)} and the roles {', '.join(roles)}")
        kinds = chosen
    fig, axes = _panels(ax, len(kinds), 4, (3.2, 2.7))
    layers = [c.layer for c in curves if c.layer is not None]
    norm = Normalize(min(layers, default=0), max(max(layers, default=1), min(layers, default=0) + 1))
    colours = colormaps[cmap]
    for a, kind in zip(axes, kinds):
        for c in curves:
            if c.kind != kind:
                continue
            if c.layer is None:
                a.plot(c.bpw, c.err, color="k", lw=1.2, marker=".", ms=3, label=c.key)
            else:
                a.plot(c.bpw, c.err, color=colours(norm(c.layer)), lw=0.9, marker=".", ms=2.5, alpha=0.85)
        a.set_yscale("log")
        a.set_title(kind, fontsize=9)
        a.set_xlabel("bits per weight")
        a.grid(True, which="both", alpha=0.25)
    for a in axes[:: min(4, len(axes))]:
        a.set_ylabel("relative output error")
    if layers:
        fig.colorbar(ScalarMappable(norm=norm, cmap=colours), ax=axes, label="layer (depth)")
    return fig


def _pick(curve: Curve, option_or_bpw: float | str | QuantOption) -> float | None:
    """The error of ``curve`` at an option (None when not measured) or at the option nearest a bpw."""
    if isinstance(option_or_bpw, (int, float)):
        return float(curve.err[int(np.argmin(np.abs(curve.bpw - float(option_or_bpw))))])
    desc = option_or_bpw.desc
    for opts, e in zip(curve.options, curve.err):
        if all(o == desc for o in opts):
            return float(e)
    return None


def error_heatmap(
    measurement: Measurement,
    option_or_bpw: float | str | QuantOption,
    *,
    ax: Axes | None = None,
    damage: bool = False,
    cmap: str = "magma_r",
) -> Figure:
    """Heat map of measured error by layer x tensor kind at one option, on a log colour scale.

    A number picks, for every tensor, its option nearest that bits per weight (for
    files whose options differ per tensor, such as ExLlamaV2's); a string or
    :class:`QuantOption` picks exactly that option. Where several tensors share a
    cell (experts) the worst error is shown. Embedding and head have no layer and are left out.
    ``damage=True`` shows the optimizer's predicted damage ``importance * err**2`` instead,
    which makes tensors of different layers comparable.
    """
    if isinstance(option_or_bpw, bool) or not isinstance(option_or_bpw, (int, float, str, QuantOption)):
        raise InputError(f"expected a bits-per-weight number or an option, got {option_or_bpw!r}")
    target = QuantOption.parse(option_or_bpw) if isinstance(option_or_bpw, str) else option_or_bpw
    curves = [c for c in sensitivity_curves(measurement) if c.layer is not None]
    if not curves:
        raise InputError("the measurement has no tensors inside numbered layers to place on a heat map")
    cells = [(c.layer, c.kind, c.importance * e**2 if damage else e)
             for c in curves if (e := _pick(c, target)) is not None]
    if not cells:
        seen = sorted({o for c in curves for opts in c.options for o in opts})
        raise InputError(f"option {target.desc} was not measured for any tensor; measured options: "
                         f"{', '.join(seen[:12])}{' ...' if len(seen) > 12 else ''}")
    mat, layers, kinds = _grid_matrix(cells)
    positive = mat[np.isfinite(mat) & (mat > 0)]
    lo, hi = (positive.min(), positive.max()) if positive.size else (1e-6, 1.0)
    norm = LogNorm(lo, hi if hi > lo else lo * 10)
    fig, (a,) = _panels(ax, 1, 1, (max(4.0, 0.55 * len(kinds) + 2), max(3.0, 0.16 * len(layers) + 1.5)))
    image = _draw_matrix(a, np.where(mat > 0, mat, np.nan), layers, kinds, norm, cmap, annotate=False)
    what = f"option nearest {float(target):g} bpw" if isinstance(target, (int, float)) else f"option {target.desc}"
    quantity = "predicted damage" if damage else "relative output error"
    a.set_title(f"{quantity}{' (importance x error²)' if damage else ''} at the {what}", fontsize=10)
    fig.colorbar(image, ax=a, label=f"{quantity} (log scale)")
    return fig


def _plan_cells(plan: Any) -> list[tuple[int, str, float]]:
    cells = []
    for e in plan.tensors:
        layer, kind = layer_and_kind(e.key)
        if layer is not None and e.numel:
            cells.append((layer, kind, e.bits / e.numel))
    return cells


def bit_map(
    plan: Any,
    *,
    ax: Axes | None = None,
    norm: Normalize | None = None,
    cmap: str = "viridis",
    colorbar: bool = True,
) -> Figure:
    """Bits per weight (codes, scales, biases) the plan gives each tensor, by layer x tensor kind.

    Embedding and head (no layer) are left out; their bits are in the plan's ``total_bpw``.
    """
    cells = _plan_cells(plan)
    if not cells:
        raise InputError("the plan has no tensors inside numbered layers to draw")
    mat, layers, kinds = _grid_matrix(cells)
    norm = norm or Normalize(np.nanmin(mat), max(np.nanmax(mat), np.nanmin(mat) + 1e-6))
    fig, (a,) = _panels(ax, 1, 1, (max(3.5, 0.5 * len(kinds) + 1.5), max(3.0, 0.16 * len(layers) + 1.5)))
    image = _draw_matrix(a, mat, layers, kinds, norm, cmap, annotate=True)
    a.set_title(f"target {plan.target_bpw:g}: {plan.achieved_bpw:.3f} bpw", fontsize=10)
    if colorbar:
        fig.colorbar(image, ax=a, label="bits per weight")
    return fig


def bit_maps(
    measurement: Measurement,
    targets: Sequence[float] = (2.5, 3.5, 4.5),
    *,
    ax: Sequence[Axes] | None = None,
    cmap: str = "viridis",
    **optimize_kw: Any,
) -> Figure:
    """The optimizer's bit maps for several targets side by side, on one colour scale.

    ``optimize_kw`` goes to :func:`mlx_dq.plan.solver.optimize` (head option, keep rules, ...);
    a target outside the measurement's range raises its ValueError.
    """
    from mlx_dq.plan.solver import optimize

    targets = [float(t) for t in targets]
    if not targets:
        raise InputError("bit_maps needs at least one bits-per-weight target")
    plans = [optimize(measurement, t, **optimize_kw) for t in targets]
    values = [v for p in plans for (_, _, v) in _plan_cells(p)]
    if not values:
        raise InputError("the plans have no tensors inside numbered layers to draw")
    norm = Normalize(min(values), max(max(values), min(values) + 1e-6))
    fig, axes = _panels(ax, len(plans), len(plans), (3.6, 4.2))
    for a, p in zip(axes, plans):
        bit_map(p, ax=a, norm=norm, cmap=cmap, colorbar=False)
    for a in axes[1:]:
        a.set_ylabel("")
    fig.colorbar(ScalarMappable(norm=norm, cmap=colormaps[cmap]), ax=axes, label="bits per weight")
    return fig


# --------------------------------------------------------------------------- quality table
def read_quality_table(csv_path: str | Path) -> list[dict[str, Any]]:
    """Rows of the quality benchmark's CSV with numeric bpw / kl / perplexity / top1 (None when blank).

    Accepts ``perplexity`` or ``ppl``; a missing ``family`` is derived from ``method``
    (``mlx-dq...`` or ``mlx-lm``). A table scored on several texts (a ``text`` column) gives the
    rows of its first text. Raises InputError naming the file.
    """
    path = Path(csv_path)
    if not path.is_file():
        raise InputError(f"{path}: no quality table (benchmarks/quality.py writes it)")
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        cols = set(reader.fieldnames or ())
        missing = [c for c in ("bpw", "kl") if c not in cols]
        if "family" not in cols and "method" not in cols:
            missing.append("family or method")
        if missing:
            raise InputError(f"{path}: the quality table lacks the column(s) {', '.join(missing)}; "
                             f"found {', '.join(sorted(cols)) or 'none'}")
        rows = list(reader)
    if rows and rows[0].get("text"):
        rows = [r for r in rows if r.get("text") == rows[0]["text"]]

    def num(v: Any) -> float | None:
        try:
            x = float(v)
        except (TypeError, ValueError):
            return None
        return x if math.isfinite(x) else None

    out = []
    for r in rows:
        method = r.get("method") or r.get("family") or ""
        family = r.get("family") or ("mlx-dq" if method.startswith("mlx-dq") else "mlx-lm")
        out.append({"family": family, "method": method, "bpw": num(r.get("bpw")), "kl": num(r.get("kl")),
                    "top1": num(r.get("top1")), "perplexity": num(r.get("perplexity", r.get("ppl")))})
    return out


def kl_vs_bpw(csv_path: str | Path, *, ax: Sequence[Axes] | None = None) -> Figure:
    """KL divergence to the source model (log scale) and perplexity against bpw, one series per method family.

    mlx-dq families are drawn as lines (one point per target), mlx-lm families as
    markers; the source model's perplexity is a dashed line.
    """
    rows = read_quality_table(csv_path)
    source = [r for r in rows if r["family"] == "source" or (r["kl"] == 0.0 and (r["bpw"] or 0) >= 16)]
    rows = [r for r in rows if r not in source and r["bpw"] is not None and r["kl"] is not None and r["kl"] > 0]
    if not rows:
        raise InputError(f"{csv_path}: no quantized rows with bpw and a positive KL to plot")
    fig, (a_kl, a_ppl) = _panels(ax, 2, 2, (4.6, 3.6))
    families = sorted({r["family"] for r in rows}, key=lambda f: (not f.startswith("mlx-dq"), f))
    markers = "osD^v<>ph*"
    for i, fam in enumerate(families):
        pts = sorted((r for r in rows if r["family"] == fam), key=lambda r: r["bpw"])
        dq = fam.startswith("mlx-dq")
        style = {"marker": markers[i % len(markers)], "ms": 5, "lw": 1.6 if dq else 0, "color": f"C{i}",
                 "label": fam}
        a_kl.plot([r["bpw"] for r in pts], [r["kl"] for r in pts], **style)
        ppl = [(r["bpw"], r["perplexity"]) for r in pts if r["perplexity"] is not None]
        if ppl:
            a_ppl.plot(*zip(*ppl), **style)
    base = [r["perplexity"] for r in source if r["perplexity"] is not None]
    if base:
        a_ppl.axhline(base[0], color="k", ls="--", lw=1, label="source model")
        a_ppl.legend(handles=a_ppl.lines[-1:], fontsize=7)
    a_kl.set_yscale("log")
    a_kl.set_ylabel("KL divergence to the source (nats/token)")
    a_ppl.set_ylabel("perplexity")
    a_ppl.set_yscale("log")
    for a in (a_kl, a_ppl):
        a.set_xlabel("bits per weight")
        a.grid(True, which="both", alpha=0.25)
    a_kl.legend(fontsize=7)
    return fig


# --------------------------------------------------------------------------- files
FIGURE_NAMES = ("error_vs_bpw.png", "error_heatmap.png", "damage_heatmap.png", "bit_maps.png", "kl_vs_bpw.png")
_SOFTWARE = "mlx-dq"  # written into each PNG, so a later run knows the figure is its own to replace


def _is_our_figure(path: Path) -> bool:
    """Whether ``path`` is a PNG that :func:`save_figures` wrote (its Software text chunk names mlx-dq)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"tEXtSoftware\x00" + _SOFTWARE.encode() in head


def guard_figures(out_dir: str | Path, inputs: Iterable[tuple[str, Any]] = ()) -> None:
    """Refuse a figure folder where a figure would replace an input or a file mlx-dq did not write, before any work."""
    from mlx_dq.safety import guard_output_names

    guard_output_names(out_dir, FIGURE_NAMES, inputs=inputs, is_ours=_is_our_figure, kind="figures")


def save_figures(
    measurement: Measurement,
    out_dir: str | Path,
    *,
    targets: Sequence[float] = (2.5, 3.5, 4.5),
    heatmap_at: float | str = 4.0,
    quality_csv: str | Path | None = None,
    dpi: int = 120,
) -> list[Path]:
    """Write the measurement's figures (and the quality figure when the CSV exists) as PNGs; return the paths."""
    out = Path(out_dir)
    guard_figures(out, [("quality CSV", quality_csv)])
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "error_vs_bpw.png": lambda: error_vs_bpw(measurement),
        "error_heatmap.png": lambda: error_heatmap(measurement, heatmap_at),
        "damage_heatmap.png": lambda: error_heatmap(measurement, heatmap_at, damage=True),
        "bit_maps.png": lambda: bit_maps(measurement, targets),
    }
    if quality_csv is not None and Path(quality_csv).is_file():
        figures["kl_vs_bpw.png"] = lambda: kl_vs_bpw(quality_csv)
    written = []
    for name, make in figures.items():
        make().savefig(out / name, dpi=dpi, metadata={"Software": _SOFTWARE})
        written.append(out / name)
    return written
