"""Output error of every default-grid option, and the clip search's gain, on the bundled model's layers.

Weights: SmolLM2-135M (the bundled Q4_1 GGUF, dequantized). Gram matrices
X^T X: real inputs of each layer, captured while the model runs over rows of
the bundled calibration text. Because the base is already 4-bit group-32
(Q4_1), options that can represent it exactly (4b_32g, 8b_32g) show near-zero
error; ``--dither`` adds uniform noise of one Q4_1 step per group to undo
that quantization grid and give continuous-valued weights of the same shape.

Run: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
     python benchmarks/error_table.py [--layers 2,15] [--rows 16 --seq-len 256] [--dither]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dq.measure.grids import load_grid
from mlx_dq.names import role_of
from mlx_dq.quant.affine import output_error, quantize_weight
from mlx_dq.quant.options import QuantOption

PROJS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
EMBED = "model.embed_tokens"  # tied: its Gram is that of the head's input
EMBED_ROWS = 8192


def collect(layers: list[int], rows: int, seq_len: int, cache: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Float weights and calibration Gram matrices of the chosen layers (cached in ``cache``)."""
    names = [f"model.layers.{i}.{p}" for i in layers for p in PROJS] + [EMBED]
    if cache.is_file():
        data = np.load(cache)
        if all(f"{n}/w" in data for n in names):
            return {n: (data[f"{n}/w"], data[f"{n}/gram"]) for n in names}
    from mlx_dq.data.calib import default_calibration_texts, sample_rows
    from mlx_dq.model.capture import GramCollector, quantizable_modules
    from mlx_dq.model.sources import DEFAULT_MODEL, load_model

    model, tok, _ = load_model(DEFAULT_MODEL)
    mods = quantizable_modules(model)
    chosen = {n: mods[n] for n in names}
    tokens = sample_rows(tok, default_calibration_texts(), rows, seq_len)
    with GramCollector(chosen) as gc:
        for i in range(0, rows, 4):
            model(tokens[i : i + 4])
            gc.flush()
    out = {n: (np.array(chosen[n].weight.astype(mx.float32)), np.array(gc.stats[n].gram)) for n in names}
    w, g = out[EMBED]  # the tied head: keep the first rows (lowest token ids) only, to stay fast
    out[EMBED] = (w[:EMBED_ROWS], g)
    np.savez(cache, **{f"{n}/{k}": v for n, (w, g) in out.items() for k, v in (("w", w), ("gram", g))})
    return out


def dither(w: np.ndarray, seed: int = 0) -> np.ndarray:
    """Add uniform noise of one Q4_1 step (per group of 32) so the weights leave the 4-bit grid."""
    g = w.reshape(w.shape[0], -1, 32)
    step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / 15.0
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, g.shape) * step
    return (g + noise).reshape(w.shape).astype(np.float32)


def _short(name: str) -> str:
    """A table column name for a parameter path."""
    if name == EMBED:
        return f"embed/head[:{EMBED_ROWS}]"
    return name.replace("model.layers.", "L").replace("self_attn.", "").replace("mlp.", "")


def grid_table(tensors: dict[str, tuple[mx.array, mx.array]]) -> None:
    """Print output error of every default-grid option per tensor, sorted by bpw, and monotonicity violations."""
    grid = load_grid()
    names = list(tensors)
    short = [_short(n) for n in names]
    table: dict[str, dict[str, float]] = {}
    bpw: dict[str, dict[str, float]] = {}
    for n in names:
        w, gram = tensors[n]
        for opt in grid[role_of(n)]:
            if not opt.fits(w.shape[-1]):
                continue
            qt = quantize_weight(w, opt, gram=gram)
            table.setdefault(opt.desc, {})[n] = output_error(w, qt.dequantize(), gram)
            bpw.setdefault(opt.desc, {})[n] = opt.bpw(w.shape)
    order = sorted(table, key=lambda d: QuantOption.parse(d).nominal_bpw())
    print(f"{'option':<26} {'bpw':>5} " + " ".join(f"{s:>14}" for s in short))
    for d in order:
        cells = [f"{table[d][n]:14.5f}" if n in table[d] else f"{'-':>14}" for n in names]
        print(f"{d:<26} {QuantOption.parse(d).nominal_bpw():5.2f} " + " ".join(cells))
    print("monotonicity (per tensor, options sorted by exact bpw; a violation = more bits, higher error):")
    total = 0
    for n, s in zip(names, short):
        descs = sorted((d for d in table if n in table[d]), key=lambda d: bpw[d][n])
        bad = [(a, b) for a, b in zip(descs, descs[1:]) if table[b][n] > table[a][n]]
        total += len(bad)
        print(f"  {s}: {len(descs)} options, {len(bad)} violations" + "".join(
            f"\n      {a} ({bpw[a][n]:.3f} bpw, {table[a][n]:.5f}) < {b} ({bpw[b][n]:.3f} bpw, {table[b][n]:.5f})"
            for a, b in bad))
    print(f"  total violations: {total}")


def clip_table(tensors: dict[str, tuple[mx.array, mx.array]], bits: tuple[int, ...], group: int) -> None:
    """Print output error without clip and with the clip search under each error metric."""
    print(f"{'tensor':<16} {'option':<12} {'no clip':>9} {'weight':>9} {'diag':>9} {'block':>9}  gain(block)  clipped")
    gains: dict[int, list[float]] = {b: [] for b in bits}
    for n, (w, gram) in tensors.items():
        s = _short(n)
        for b in bits:
            opt = QuantOption.uniform(b, group)
            errs = [output_error(w, quantize_weight(w, opt, gram=gram, clip=False).dequantize(), gram),
                    output_error(w, quantize_weight(w, opt).dequantize(), gram),
                    output_error(w, quantize_weight(w, opt, gram=gram, clip_metric="diag").dequantize(), gram)]
            qt = quantize_weight(w, opt, gram=gram, clip_metric="block")
            errs.append(output_error(w, qt.dequantize(), gram))
            gain = 1 - errs[3] / errs[0]
            gains[b].append(gain)
            print(f"{s:<16} {opt.desc:<12} " + " ".join(f"{e:9.5f}" for e in errs)
                  + f"  {100 * gain:9.1f}%  {100 * qt.stats['clipped_fraction']:6.2f}%")
    for b in bits:
        print(f"mean output-error reduction by clip search (block metric) at {b}-bit g{group}: {100 * np.mean(gains[b]):.1f}%")


def main() -> None:
    """Collect layers and print the grid table and the clip table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="2,15")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/mlx_dq_error_table_grams.npz"))
    ap.add_argument("--dither", action="store_true", help="undo the Q4_1 grid with one step of uniform noise")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--skip-clip", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    raw = collect([int(x) for x in args.layers.split(",")], args.rows, args.seq_len, args.cache)
    tensors = {n: (mx.array(dither(w) if args.dither else w), mx.array(g)) for n, (w, g) in raw.items()}
    clip_tensors = {n: v for n, v in tensors.items() if n != EMBED}
    print(f"{len(tensors)} tensors, Gram from {args.rows}x{args.seq_len} calibration tokens"
          f"{', dithered weights' if args.dither else ''} ({time.perf_counter() - t0:.0f}s to load)")
    if not args.skip_grid:
        grid_table(tensors)
    if not args.skip_clip:
        for group in (64, 32):
            clip_table(clip_tensors, (2, 3, 4), group)
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
