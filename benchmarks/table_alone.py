"""The embedding table alone: KL when only a tied table is rounded, as a lookup, as the head, or both.

Why: to split a bad pair's loss between the table's two uses and the decoder at a chosen width, before any
plan. The table is rounded with mlx's own affine quantization (group 64, no finer rows, no GPTQ) and the
decoder stays in float32, so the figures bound what the table alone costs at each width (``kl_parts.py``
splits a converted model the same way). Prints a tab-separated table, one line per text.

    python benchmarks/table_alone.py --model gemma3-270m --texts russian_chinese,german_french,pydoc
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kl_parts import _embedding, tied_head_reading  # noqa: E402

from mlx_dq.data.calib import resolve_eval_texts, sample_rows  # noqa: E402
from mlx_dq.data.eval_texts import EVAL_TEXTS  # noqa: E402
from mlx_dq.evaluation.metrics import kl_divergence, load_for_eval, reference  # noqa: E402


def rounded(w: mx.array, bits: int, group_size: int = 64) -> mx.array:
    """``w`` rounded to ``bits`` per weight in groups of ``group_size`` and dequantized (a float matmul anywhere)."""
    out = mx.dequantize(*mx.quantize(w, group_size, bits), group_size, bits).astype(w.dtype)
    mx.eval(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--texts", default="russian_chinese,german_french,pydoc",
                    help=f"named texts ({', '.join(EVAL_TEXTS)}) or .txt/.jsonl paths, comma-separated")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", default="2,3,4", help="widths of the whole table; the first one also per side")
    args = ap.parse_args()

    model, tok, _, _ = load_for_eval(args.model)
    table = _embedding(model)
    if not isinstance(table, nn.Embedding) or hasattr(model, "lm_head"):
        raise SystemExit("this measures a tied, unquantized embedding table")
    own = table.weight
    widths = [int(b) for b in args.bits.split(",")]
    low = {b: rounded(own, b) for b in widths}
    variants = {f"{b} bits": (low[b], None) for b in widths}  # (lookup weight, head weight or None: the lookup's)
    variants[f"{widths[0]} bits, lookup only"] = (low[widths[0]], own)
    variants[f"{widths[0]} bits, head only"] = (own, low[widths[0]])
    print("text", *variants, sep="\t", flush=True)
    for name in args.texts.split(","):
        rows = sample_rows(tok, resolve_eval_texts(name)[0], args.rows, args.seq_len, seed=args.seed)
        ref = reference(model, rows)
        kls = []
        for lookup, head in variants.values():
            table.weight = lookup
            try:
                with tied_head_reading(model, head):
                    kls.append(kl_divergence(ref, model, rows)["kl"])
            finally:
                table.weight = own
        print(name, *(f"{k:.4f}" for k in kls), sep="\t", flush=True)


if __name__ == "__main__":
    main()
