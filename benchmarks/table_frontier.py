"""The embedding table's width against the decoder's at one whole-model bits-per-weight target: KL per text.

Why: on a model whose tied table is most of its weights, every bit the table gets is taken from the decoder. This
converts the model once per table option (``--head-option``, outside the budget), with the decoder's budget set so
that the whole model lands on ``--bpw`` (from the measurement's tensor sizes), and evaluates each conversion as
``mlx_dq eval`` does. The lowest KL of a text over the table options is the best a plan with one table option
(and the decoder planned as usual) reaches there. Prints a tab-separated table, one line per table option.

    python benchmarks/table_frontier.py --model gemma3-270m --measurement MEAS --bpw 3.5 \
        --table-options 1.0:3b_128g,1.0:3b_64g,0.25:4b_64g/0.75:3b_64g --texts russian_chinese,german_french
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx

from mlx_dq.conversion.pipeline import convert
from mlx_dq.data.calib import resolve_eval_texts, sample_rows
from mlx_dq.data.eval_texts import EVAL_TEXTS
from mlx_dq.errors import MlxDqError
from mlx_dq.evaluation.metrics import evaluate_model, load_for_eval, reference
from mlx_dq.measure.records import load_measurement
from mlx_dq.model.sources import load_model
from mlx_dq.names import in_head_scope
from mlx_dq.quant.options import QuantOption


def decoder_bpw(measurement, table_option: str, target: float) -> float:
    """The decoder's bits per weight that puts the whole model at ``target`` with the table at ``table_option``."""
    tables = [r for r in measurement.tensors.values() if in_head_scope(r.role, r.key, measurement.tied)]
    opt = QuantOption.parse(table_option)
    table_bits = sum(opt.storage_bits(tuple(r.shape)) for r in tables)
    n_all = measurement.numel()
    n_rest = n_all - measurement.numel(r.key for r in tables)
    return (target * n_all - table_bits) / n_rest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--measurement", required=True, help="the model's measurement (mlx_dq measure)")
    ap.add_argument("--bpw", type=float, default=3.5, help="whole-model target")
    ap.add_argument("--table-options", required=True, help="embedding/head options, comma-separated")
    ap.add_argument("--texts", default="russian_chinese,german_french,pydoc",
                    help=f"named texts ({', '.join(EVAL_TEXTS)}) or .txt/.jsonl paths, comma-separated")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", default=None, help="keep the conversions in this folder (default: a temporary one)")
    args = ap.parse_args()

    try:  # a bad measurement, or an option the table can't take: one line, before any work
        meas = load_measurement(args.measurement)
        budgets = {opt: decoder_bpw(meas, opt, args.bpw) for opt in args.table_options.split(",")}
    except MlxDqError as e:
        raise SystemExit(f"error: {e}") from None
    src, tok, _ = load_model(args.model, dtype=mx.float32)
    names = args.texts.split(",")
    refs = {}
    for name in names:
        rows = sample_rows(tok, resolve_eval_texts(name)[0], args.rows, args.seq_len, seed=args.seed)
        refs[name] = (rows, reference(src, rows))
    del src
    print("table option", "decoder bpw", "whole bpw", *names, sep="\t", flush=True)
    with tempfile.TemporaryDirectory(prefix="table_frontier-") as scratch:  # conversions not kept: gone at the end
        work = Path(args.keep or scratch)
        for opt, dec in budgets.items():
            out = work / opt.replace(":", "_").replace("/", "+")
            try:
                convert(args.model, out, measurement=args.measurement, head_option=opt, bpw=round(dec, 4),
                        progress=False, force=True)
            except MlxDqError as e:  # e.g. a decoder budget below its cheapest options: this line, then the next
                print(opt, f"{dec:.4f}", "-", *("-" for _ in names), f"({e})", sep="\t", flush=True)
                continue
            q = load_for_eval(str(out))[0]
            res = [evaluate_model(q, rows, base=ref) for rows, ref in refs.values()]
            print(opt, f"{dec:.4f}", f"{res[0]['bits_per_weight']:.4f}", *(f"{r['kl']:.4f}" for r in res),
                  sep="\t", flush=True)


if __name__ == "__main__":
    main()
