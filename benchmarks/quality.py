"""Quality benchmark: mlx-dq against every mlx-lm quantization method, side by side, on the bundled model.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/quality.py [--model smollm2-135m] [--rows 8 --seq-len 256] [--only mlx-lm]

Every variant is evaluated on the same evaluation rows (the default evaluation text, never the
calibration text) against the float32 source model: mean KL divergence of the next-token
distributions, top-1 agreement, perplexity, bits per weight and stored size. Bits per weight
follow one rule for every method (:func:`mlx_dq.evaluate.weight_storage`): packed codes plus 16
bits per scale and per bias, 16 bits per unquantized element, over the weights of every Linear
and Embedding (norms and layer biases excluded; a tied head counts once). On the CPU every model
is evaluated through dequantized float32 weights.

Rows: mlx-lm uniform quantization at every bits x group pair, mlx-lm's mixed_3_4 / mixed_3_6 /
mixed_4_6 recipes, mlx-lm's dynamic_quant (its sensitivity estimate and threshold search, run on
our calibration rows), and mlx-dq (measure -> optimize -> convert) at several bpw targets, with
mixed-proportion tensors allowed and with ``--mlx-lm-compatible``. Writes quality.csv, quality.md
and quality.png into ``--out``; the mlx-dq measurement and dynamic_quant sensitivities are cached
in ``--out/cache`` (not committed). ``--resume`` keeps rows already in the CSV for the same
evaluation settings.
"""

from __future__ import annotations

import csv
import functools
import gc
import json
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import click
import mlx.core as mx
import mlx.nn as nn

from mlx_dq import baselines, calib, evaluate
from mlx_dq.sources import DEFAULT_MODEL, load_model

RESULTS = Path(__file__).parent / "results"
MLX_DQ_TARGETS = (3.5, 3.0, 4.0, 4.5, 2.5, 5.0)  # the goal target first: a run cut short still answers it
# dynamic_quant: its default levels (4b g64 -> 5b g64) at its default target 5.0, the 4.7 of
# mlx-lm's published figures and 5.25; plus levels one step lower (3b g64 -> 4b g64) to reach 3.5-4.5
DYNAMIC_RUNS = (((4, 64, 5, 64), (4.7, 5.0, 5.25)), ((3, 64, 4, 64), (3.75, 4.0, 4.25)))
# caveats that hold for the bundled SmolLM2 Q4_1 GGUF
BUNDLED_NOTES = [
    "The source is the bundled SmolLM2-135M-Instruct Q4_1 GGUF (token embedding Q8_0), dequantized to "
    "float32: every other weight lies on a 4-bit min/max grid per group of 32 inputs. mlx-lm's 4-bit g32 "
    "does NOT reproduce it: MLX's quantizer anchors each group at its larger-magnitude edge and rounds the "
    "scale so that edge and zero are exact, which moves the grid off Q4_1's (layer 0 down_proj: 7.7% "
    "relative weight error, the same as on ordinary weights). A quantizer that tries the plain min/max "
    "scale at 4-bit g32 can reproduce the source exactly, so any method that does (mlx-dq options with "
    "4b_32g segments may; mlx-dq's default grid has none) is flattered near 4-5 bpw on this model; check claims "
    "on other models too.",
    "Group size 128: SmolLM2's hidden size 576 is not a multiple of 128, so mlx-lm leaves every tensor with "
    "576 inputs (all but down_proj, and the embedding) in 16 bits; those rows have high bpw.",
    "SmolLM2 ties the head to the embedding: mlx-lm's mixed_* recipes give lm_head the high width, "
    "but a tied model has no lm_head, so its embedding/head takes the low width.",
]
FIELDS = ["family", "method", "bpw", "kl", "kl_max", "top1", "perplexity", "size_mb", "build_s", "eval_s", "notes",
          "measure_s", "version"]
RTN_TARGETS = (3.0, 4.0)  # mlx-dq without error compensation (measured with rounding, converted with rounding + clip)


@functools.lru_cache(maxsize=None)  # taken once, at the start of a run: edits made while it runs do not count
def code_version(family: str) -> str:
    """What a row was built with: mlx-lm's version for its rows, a digest of mlx-dq's code for mlx-dq rows.

    ``--resume`` keeps a row only when this still matches, so rows from older code are rebuilt.
    """
    import hashlib
    from importlib.metadata import version

    if not family.startswith("mlx-dq"):
        return f"mlx-lm {version('mlx-lm')}, mlx {mx.__version__}"
    root = Path(__file__).resolve().parents[1] / "mlx_dq"
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".json") and "__pycache__" not in f.parts:
            h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return f"mlx-dq {h.hexdigest()[:12]}"


@dataclass
class Variant:
    """One quantized model to evaluate: a name, its family, the model (or a loader) and notes."""

    family: str
    name: str
    build: Callable[[], tuple[nn.Module, dict | None]]
    notes: str = ""


def _tag(spec: str) -> str:
    """A file-name-safe tag for a model spec (cache file names)."""
    return re.sub(r"[^\w.-]+", "_", Path(spec).name or spec)


def _settings_key(args: dict) -> str:
    keys = ("model", "rows", "seq_len", "seed", "text_digest")
    return json.dumps({k: args[k] for k in keys}, sort_keys=True)


def _read_existing(csv_path: Path, key: str, current_only: bool = True) -> dict[str, dict]:
    """Rows of an earlier run with the same evaluation settings; ``current_only``: built by the code here now."""
    meta = csv_path.with_suffix(".settings.json")
    if not csv_path.exists() or not meta.exists() or meta.read_text() != key:
        return {}
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    return {r["method"]: r for r in rows
            if not current_only or r["family"] == "source" or r.get("version") == code_version(r["family"])}


def _write_csv(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    tmp.replace(path)


def _fmt(r: dict, key: str, spec: str) -> str:
    v = r.get(key, "")
    return "" if v in ("", None) else format(float(v), spec)


def goal_check(rows: list[dict]) -> list[str]:
    """Markdown lines: each mlx-lm row within mlx-dq's bpw range against the mlx-dq row with the most bits not above it.

    That is the goal "mlx-dq's KL is below every mlx-lm method at equal or higher bpw", read where both exist.
    """
    families = sorted({r["family"] for r in rows if r["family"].startswith("mlx-dq") and "no compensation" not in r["family"]})
    dq = {f: sorted((r for r in rows if r["family"] == f), key=lambda r: float(r["bpw"])) for f in families}
    if not dq:
        return []
    top = max(float(r["bpw"]) for f in families for r in dq[f])
    low = min(float(r["bpw"]) for f in families for r in dq[f])
    lm = sorted((r for r in rows if r["family"].startswith("mlx-lm") and low - 0.01 <= float(r["bpw"]) <= top + 0.01),
                key=lambda r: float(r["bpw"]))
    head = "| mlx-lm | bpw | KL | " + " | ".join(f"{f} (bpw, KL, ratio)" for f in families) + " |"
    out = ["", "Goal check: every mlx-lm row inside mlx-dq's bpw range against the mlx-dq row with the most bits "
           "not above it (ratio = mlx-dq KL / mlx-lm KL; below 1 means mlx-dq wins with no more bits).", "",
           head, "|---|---:|---:|" + "---|" * len(families)]
    for r in lm:
        cells = []
        for f in families:
            fit = [d for d in dq[f] if float(d["bpw"]) <= float(r["bpw"]) + 1e-9]
            if fit:
                d = fit[-1]
                cells.append(f"{float(d['bpw']):.3f}, {float(d['kl']):.5f}, {float(d['kl']) / float(r['kl']):.2f}")
            else:
                cells.append("")
        out.append(f"| {r['method']} | {float(r['bpw']):.3f} | {float(r['kl']):.5f} | " + " | ".join(cells) + " |")
    return out


def compensation_check(rows: list[dict]) -> list[str]:
    """Markdown lines: mlx-dq with error compensation (GPTQ) against the same pipeline with rounding, per target."""
    by = {r["method"]: r for r in rows}
    pairs = []
    for r in rows:
        if r["family"] == "mlx-dq (no compensation)":
            t = r["method"].rsplit("@", 1)[1]
            if f"mlx-dq @{t}" in by:
                pairs.append((float(t), by[f"mlx-dq @{t}"], r))
    if not pairs:
        return []
    out = ["", "Error compensation: mlx-dq measured and quantized with GPTQ (the default) against the same pipeline "
           "with rounding (`--method rtn` on measure and convert: rounding to measure, rounding + clip search to "
           "quantize), same targets. Times: quantizing the model (in memory) and, once per method, measuring it.", "",
           "| target | KL rounding | KL GPTQ | KL change | quantize s rounding | quantize s GPTQ | measure s rounding "
           "| measure s GPTQ |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t, g, n in sorted(pairs, key=lambda p: p[0]):
        kg, kn = float(g["kl"]), float(n["kl"])
        out.append(f"| {t:g} | {kn:.5f} | {kg:.5f} | {100 * (kg - kn) / kn:+.1f}% | {float(n['build_s']):.0f} | "
                   f"{float(g['build_s']):.0f} | {_fmt(n, 'measure_s', '.0f')} | {_fmt(g, 'measure_s', '.0f')} |")
    return out


def write_markdown(path: Path, rows: list[dict], info: dict) -> None:
    """The results as a markdown table sorted by bits per weight, with the settings and caveats."""
    lines = [
        f"# Quality: mlx-dq vs mlx-lm on {info['model']}",
        "",
        f"Evaluation: {info['rows']} rows x {info['seq_len']} tokens of the default evaluation text "
        f"(CPython's pydoc topics, digest {info['text_digest']}, seed {info['seed']}), "
        f"{info['tokens']} predicted tokens; never the calibration text. KL = mean KL(source || quantized) "
        "of the next-token distribution over every position, in nats; top-1 = how often both pick the same "
        "next token. All models " + evaluate.CPU_NOTE + ".",
        "",
        "bpw = stored bits of every Linear/Embedding weight (codes + 16-bit scale and bias per group, 16 bits "
        "per unquantized element; norms excluded; the tied embedding/head counted once) / weights, "
        "the same rule for every method. size = those bits plus norms at 16 bits.",
        "",
        "| family | method | bpw | KL | top-1 | ppl | size MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: (float(r["bpw"]), r["family"], r["method"])):
        lines.append(
            f"| {r['family']} | {r['method']} | {_fmt(r, 'bpw', '.3f')} | {_fmt(r, 'kl', '.5f')} | "
            f"{_fmt(r, 'top1', '.4f')} | {_fmt(r, 'perplexity', '.3f')} | {_fmt(r, 'size_mb', '.1f')} |"
        )
    lines += goal_check(rows)
    lines += compensation_check(rows)
    lines += ["", "Notes:", ""]
    lines += [f"- {n}" for n in info["notes"]]
    compute = sum(float(r.get("build_s") or 0) + float(r.get("eval_s") or 0) for r in rows) / 60
    lines += ["", f"Command: `{info['command']}` (this run {info['wall_min']:.1f} min; building and evaluating "
              f"all rows took {compute:.0f} min on {info['machine']}, shared with other jobs)", ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, rows: list[dict], base_ppl: float, title: str) -> None:
    """KL divergence (log scale) and perplexity against bits per weight, mlx-lm methods vs mlx-dq."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_ppl) = plt.subplots(1, 2, figsize=(13, 5.2))
    styles: dict[str, tuple[str, str, str]] = {}
    series: dict[str, list[tuple[float, float, float]]] = {}
    for r in rows:
        if r["family"] == "source":
            continue
        fam = r["family"]
        if fam == "mlx-lm uniform":
            fam = f"mlx-lm uniform g{r['method'].rsplit('g', 1)[1]}"
        series.setdefault(fam, []).append((float(r["bpw"]), float(r["kl"]), float(r["perplexity"])))
    palette = {
        "mlx-lm uniform g32": ("tab:blue", "o", "--"),
        "mlx-lm uniform g64": ("tab:cyan", "o", "--"),
        "mlx-lm uniform g128": ("tab:gray", "o", "--"),
        "mlx-lm mixed": ("tab:purple", "s", ""),
        "mlx-lm dynamic_quant": ("tab:orange", "D", ""),
        "mlx-dq": ("tab:red", "*", "-"),
        "mlx-dq --mlx-lm-compatible": ("tab:green", "P", "-"),
        "mlx-dq (no compensation)": ("tab:brown", "x", ":"),
    }
    for fam, pts in sorted(series.items()):
        pts.sort()
        color, marker, ls = palette.get(fam, styles.get(fam, ("black", "x", "")))
        xs = [p[0] for p in pts]
        for ax, col in ((ax_kl, 1), (ax_ppl, 2)):
            ys = [p[col] for p in pts]
            ax.plot(xs, ys, marker=marker, linestyle=ls or "none", color=color, label=fam,
                    markersize=9 if marker == "*" else 6)
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL divergence to the source (nats, log scale)")
    ax_ppl.axhline(base_ppl, color="black", linewidth=0.8, linestyle=":", label="source")
    ax_ppl.set_yscale("log")
    ax_ppl.set_ylabel("perplexity (log scale)")
    for ax in (ax_kl, ax_ppl):
        ax.set_xlabel("bits per weight (scales and biases counted)")
        ax.grid(True, which="both", alpha=0.3)
    ax_ppl.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mlx_lm_variants(model: nn.Module, config: dict, calib_rows: mx.array, cache: Path, spec: str) -> Iterator[Variant]:
    """Every mlx-lm method, built lazily one at a time from the float32 model.

    Ordered so that a run cut short still covers the range where methods compete (2-5 bits) first.
    """

    def uniform(b: int) -> Iterator[Variant]:
        for g in baselines.GROUP_SIZES:
            note = "MLX's zero-anchored scale does not reproduce the Q4_1 grid" if (b, g) == (4, 32) else ""
            if g == 128 and config.get("hidden_size", 0) % 128:
                note = f"inputs of width {config['hidden_size']} are not a multiple of 128: mlx-lm keeps them 16-bit"
            yield Variant("mlx-lm uniform", f"mlx-lm {b}-bit g{g}",
                          lambda b=b, g=g: (baselines.uniform(model, config, b, g)[0], None), note)

    def mixed() -> Iterator[Variant]:
        for r in baselines.MIXED_RECIPES:
            yield Variant("mlx-lm mixed", f"mlx-lm {r}",
                          lambda r=r: (baselines.mixed_recipe(model, config, r)[0], None),
                          "tied head: lm_head rule does not apply")

    def dynamic(levels: tuple[int, ...], targets: tuple[float, ...]) -> Iterator[Variant]:
        lb, lg, hb, hg = levels
        path = cache / f"{_tag(spec)}.dynamic_sens.{lb}b{lg}-{hb}b{hg}.r{calib_rows.shape[0]}x{calib_rows.shape[1]}.json"
        state: dict = {}

        def sensitivities() -> dict[str, float]:
            if "sens" not in state:
                if path.exists():
                    state["sens"] = json.loads(path.read_text())
                else:
                    t0 = time.perf_counter()
                    state["sens"] = baselines.dynamic_sensitivities(model, calib_rows, levels)
                    print(f"  dynamic_quant sensitivities {levels}: {time.perf_counter() - t0:.0f} s", flush=True)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(state["sens"]))
            return state["sens"]

        for t in targets:
            default = " (its defaults)" if tuple(levels) == baselines.DYNAMIC_LEVELS and t == baselines.DYNAMIC_TARGET else ""
            yield Variant(
                "mlx-lm dynamic_quant", f"mlx-lm dynamic_quant {lb}b{lg}/{hb}b{hg} @{t:g}",
                lambda t=t: (baselines.dynamic_quant(model, config, sensitivities(), t, levels)[0], None),
                f"target {t:g} bpw{default}",
            )

    (hi_levels, hi_targets), (lo_levels, lo_targets) = DYNAMIC_RUNS
    for part in (uniform(2), uniform(3), uniform(4), mixed(), dynamic(hi_levels, hi_targets), uniform(5),
                 dynamic(lo_levels, lo_targets), uniform(6), uniform(8)):
        yield from part


def mlx_dq_variants(spec: str, targets: tuple[float, ...], cache: Path, modes: tuple[str, ...] = ("mixed", "compatible"),
                    rtn_targets: tuple[float, ...] = RTN_TARGETS, head_option: str | None = None,
                    calib_rows: int | None = None, calib_seq: int | None = None) -> Iterator[Variant]:
    """mlx-dq at each target as a user gets it: ``measure`` -> ``optimize`` -> ``quantize_model``, library defaults.

    Mixed-proportion and ``--mlx-lm-compatible`` plans with error compensation (GPTQ, the default), then
    the same pipeline without it (measured and quantized with rounding + clip) at ``rtn_targets``.
    ``head_option`` None puts embedding and head in the bpw budget (so the target is the total bpw).
    ``calib_rows``/``calib_seq`` None: the measurer's and converter's own defaults. Quantizes in memory
    with ``mlx_dq.convert.quantize_model`` (the converter's own arithmetic).
    """
    from mlx_dq import convert as conv
    from mlx_dq import measure as meas
    from mlx_dq.optimize import optimize

    state: dict = {}

    def measurement(method: str):
        if method not in state:
            rows = calib_rows or meas.DEFAULT_ROWS
            seq = calib_seq or meas.DEFAULT_SEQ_LEN
            path = cache / f"{_tag(spec)}.measurement.{method}.r{rows}x{seq}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            kw = dict(rows=rows, seq_len=seq, method=method, out_path=path, progress=True)
            try:
                state[method] = meas.measure(spec, **kw)
            except ValueError as e:  # a cached file from other settings or another version: measure afresh
                print(f"  {e}: measuring again", flush=True)
                state[method] = meas.measure(spec, resume=False, **kw)
            secs = time.perf_counter() - t0
            state[method + "_s"] = secs
            print(f"  measurement ({path.name}): {secs:.0f} s", flush=True)
        return state[method]

    def build(target: float, compatible: bool, method: str) -> tuple[nn.Module, dict]:
        first = method not in state
        m = measurement(method)
        plan = optimize(m, target, mlx_lm_compatible=compatible, head_option=head_option)
        kw = {"method": method}
        if calib_rows:
            kw.update(rows=calib_rows, seq_len=calib_seq or conv.DEFAULT_SEQ_LEN)
        # measuring time is reported apart (from the file: also right when it came from the cache)
        extra = {"measure_s": m.extra.get("timing", {}).get("total_s") or 0.0,
                 "spent_measuring_s": state[method + "_s"] if first else 0.0}
        return conv.quantize_model(spec, plan, **kw)[0], extra

    runs = [("gptq", False, t) for t in targets if "mixed" in modes] + [("rtn", False, t) for t in rtn_targets]
    runs += [("gptq", True, t) for t in targets if "compatible" in modes]
    for method, compatible, t in runs:
        family = "mlx-dq --mlx-lm-compatible" if compatible else "mlx-dq"
        suffix = "" if method == "gptq" else " (no compensation)"
        yield Variant(family + suffix, f"{family}{suffix} @{t:g}",
                      lambda t=t, c=compatible, m=method: build(t, c, m),
                      f"target {t:g} bpw, {'GPTQ' if method == 'gptq' else 'rounding + clip'}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "spec", default=DEFAULT_MODEL, show_default=True, help="Model spec (sources.resolve).")
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Evaluation rows.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--calib-rows", default=8, show_default=True, type=click.IntRange(min=1),
              help="Calibration rows for mlx-lm's dynamic_quant sensitivities.")
@click.option("--calib-seq-len", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--targets", default=",".join(f"{t:g}" for t in MLX_DQ_TARGETS), show_default=True,
              help="mlx-dq bpw targets, comma separated.")
@click.option("--dq-calib-rows", default=None, type=click.IntRange(min=1),
              help="Calibration rows for the mlx-dq measurement and quantization [default: mlx-dq's own defaults].")
@click.option("--dq-calib-seq-len", default=None, type=click.IntRange(min=2))
@click.option("--rtn-targets", default=",".join(f"{t:g}" for t in RTN_TARGETS), show_default=True,
              help="bpw targets for mlx-dq without error compensation (rounding + clip), comma separated; '' for none.")
@click.option("--dq-modes", default="mixed,compatible", show_default=True,
              help="mlx-dq plans to run: mixed (mixed-proportion options allowed), compatible (--mlx-lm-compatible).")
@click.option("--head-option", default="budget", show_default=True,
              help="mlx-dq embedding/head option, or 'budget' to let the optimizer choose it inside the target.")
@click.option("--only", type=click.Choice(["all", "mlx-lm", "mlx-dq", "report"]), default="all", show_default=True,
              help="Which rows to build; 'report' only rewrites the outputs from earlier (and --merge) results.")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Keep rows already in the CSV for the same evaluation settings.")
@click.option("--merge", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Also take rows from another run's quality.csv (same evaluation settings); repeatable.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(spec: str, rows: int, seq_len: int, batch_size: int, seed: int, calib_rows: int, calib_seq_len: int,
         targets: str, dq_calib_rows: int | None, dq_calib_seq_len: int | None, rtn_targets: str, dq_modes: str,
         head_option: str, only: str, resume: bool,
         merge: tuple[str, ...], out_dir: Path) -> None:
    """Build and evaluate every mlx-lm method and mlx-dq on the same evaluation rows; write CSV, markdown, PNG."""
    t_start = time.perf_counter()
    try:
        dq_targets = tuple(float(t) for t in targets.split(",") if t.strip())
        rtn = tuple(float(t) for t in rtn_targets.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"not a list of numbers: {targets!r} / {rtn_targets!r}",
                                 param_hint="--targets / --rtn-targets") from None
    bad = [m for m in dq_modes.split(",") if m.strip() not in ("mixed", "compatible")]
    if bad:
        raise click.BadParameter(f"unknown mode(s) {bad}: use mixed and/or compatible", param_hint="--dq-modes")
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = out_dir / "cache"
    texts = calib.default_eval_texts()
    info = {"model": spec, "rows": rows, "seq_len": seq_len, "seed": seed, "text_digest": calib.text_digest(texts)}
    key = _settings_key(info)
    csv_path = out_dir / "quality.csv"
    code_version("mlx-dq"), code_version("mlx-lm")  # noqa: B018 - fix the versions of this run now
    done = _read_existing(csv_path, key, only != "report") if resume else {}
    for other in merge:
        extra = _read_existing(Path(other), key, only != "report")
        if not extra:
            raise click.BadParameter(f"{other} holds no results for these evaluation settings", param_hint="--merge")
        done.update({k: v for k, v in extra.items() if k not in done})
    results: list[dict] = list(done.values())
    if only == "report" and "source (float32)" not in done:
        raise click.ClickException(f"--only report needs earlier results in {csv_path} (or --merge)")
    if only != "report":
        model, tokenizer, config = load_model(spec, dtype=mx.float32)
        eval_rows = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
        c_rows = calib.sample_rows(tokenizer, calib.default_calibration_texts(), calib_rows, calib_seq_len, seed)
    ref_state: dict = {}

    def ref() -> evaluate.Reference:
        if "ref" not in ref_state:
            print(f"reference: {spec} in float32 on {rows} x {seq_len} evaluation tokens", flush=True)
            ref_state["ref"] = evaluate.reference(model, eval_rows, batch_size)
        return ref_state["ref"]

    if "source (float32)" in done:
        src_ppl = float(done["source (float32)"]["perplexity"])
    else:
        src_ppl = ref().perplexity
        results.append({"family": "source", "method": "source (float32)", "bpw": 16.0, "kl": 0.0, "kl_max": 0.0,
                        "top1": 1.0, "perplexity": src_ppl,
                        "size_mb": evaluate.stored_bytes(model) / 1e6, "build_s": 0.0,
                        "eval_s": ref().seconds, "notes": "dequantized Q4_1 GGUF, counted as 16-bit"})
    (csv_path.with_suffix(".settings.json")).write_text(key)
    _write_csv(csv_path, results)

    variants: list[Iterator[Variant]] = []
    if only in ("all", "mlx-lm"):
        variants.append(mlx_lm_variants(model, config, c_rows, cache, spec))
    if only in ("all", "mlx-dq"):
        variants.append(mlx_dq_variants(spec, dq_targets, cache,
                                        tuple(m.strip() for m in dq_modes.split(",") if m.strip()), rtn,
                                        None if head_option == "budget" else head_option,
                                        dq_calib_rows, dq_calib_seq_len))
    for group in variants:
        for v in group:
            if v.name in done:
                continue
            t0 = time.perf_counter()
            try:
                q, extra = v.build()
            except (ValueError, NotImplementedError, TypeError, AttributeError, ImportError, RuntimeError) as e:
                print(f"NOTE: {v.name} skipped: {type(e).__name__}: {e}", flush=True)
                continue
            t1 = time.perf_counter()
            extra = extra or {}
            r = evaluate.evaluate_model(q, eval_rows, base=ref(), batch_size=batch_size)
            row = {"family": v.family, "method": v.name, "bpw": r["bits_per_weight"], "kl": r["kl"],
                   "kl_max": r["kl_max"], "top1": r["top1"], "perplexity": r["perplexity"],
                   "size_mb": r["size_bytes"] / 1e6, "build_s": t1 - t0 - extra.get("spent_measuring_s", 0.0),
                   "eval_s": time.perf_counter() - t1, "notes": v.notes,
                   "measure_s": extra.get("measure_s", ""), "version": code_version(v.family)}
            results.append(row)
            _write_csv(csv_path, results)
            print(f"{v.name:42s} bpw {row['bpw']:.3f}  KL {row['kl']:.5f}  top-1 {row['top1']:.4f}  "
                  f"ppl {row['perplexity']:.3f}  build {row['build_s']:.0f}s eval {row['eval_s']:.0f}s",
                  flush=True)
            del q
            gc.collect()
            mx.clear_cache()

    info.update(
        tokens=rows * (seq_len - 1),
        command="python benchmarks/quality.py " + " ".join(sys.argv[1:]),
        wall_min=(time.perf_counter() - t_start) / 60,
        machine=f"{platform.machine()} CPU, MLX {mx.__version__}",
        notes=(BUNDLED_NOTES if spec == DEFAULT_MODEL else []) + [
            f"dynamic_quant: mlx-lm's estimate_sensitivities and estimate_threshold on our calibration text "
            f"({calib_rows} rows x {calib_seq_len} tokens, not its own download), levels and targets in the "
            "method name (4b64/5b64 @5.0 is its default).",
            "mlx-dq rows: measure -> optimize -> quantize with mlx-dq's defaults (the converter's streamed "
            "arithmetic, in memory; calibration "
            + (f"{dq_calib_rows} rows x {dq_calib_seq_len or 'default'} tokens"
               if dq_calib_rows else "16 x 512 tokens to measure, 32 x 512 to quantize")
            + " of mlx-dq's calibration text); embedding/head: "
            f"{'chosen by the optimizer inside the target' if head_option == 'budget' else head_option}; "
            "`--mlx-lm-compatible` plans use whole-tensor options only; '(no compensation)' rows are measured "
            "with rounding (`measure --method rtn`) and quantized with rounding + clip search (`convert --method "
            "rtn`) instead of GPTQ.",
        ],
    )
    write_markdown(out_dir / "quality.md", results, info)
    write_plot(out_dir / "quality.png", results, src_ppl, f"{spec}: mlx-dq vs mlx-lm quantization")
    print(f"wrote {csv_path}, quality.md, quality.png in {info['wall_min']:.1f} min", flush=True)


if __name__ == "__main__":
    main()
