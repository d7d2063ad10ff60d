"""The embedding table alone: KL when only a tied table is rounded, as a lookup, as the head, or both.

Why: to split a bad pair's loss between the table's two uses and the decoder. The table is rounded with
mlx's own affine quantization (group 64, no finer rows, no GPTQ) and the decoder stays in float32, so the
figures bound what the table alone costs at each width. Prints a tab-separated table, one line per text.

    python benchmarks/table_alone.py --model gemma3-270m --texts russian_chinese,german_french,pydoc
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn

from mlx_dq.data.calib import load_texts, sample_rows
from mlx_dq.data.eval_texts import EVAL_TEXTS, eval_texts
from mlx_dq.evaluation.metrics import kl_divergence, load_for_eval, reference


class _Sides(nn.Module):
    """A tied table whose lookup and head come from two different tables."""

    def __init__(self, lookup: nn.Module, head: nn.Module):
        super().__init__()
        self.lookup, self.head = lookup, head

    def __call__(self, x: mx.array) -> mx.array:
        return self.lookup(x)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.head.as_linear(x)


def rounded(table: nn.Embedding, bits: int, group_size: int = 64) -> nn.Embedding:
    """``table`` with its weight rounded to ``bits`` and stored dequantized (a float matmul on any backend)."""
    out = nn.Embedding(*table.weight.shape)
    w = mx.dequantize(*mx.quantize(table.weight, group_size, bits), group_size, bits)
    out.weight = w.astype(table.weight.dtype)
    mx.eval(out.weight)
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
    inner = model.model if hasattr(model, "model") else model.language_model.model
    table = inner.embed_tokens
    if not isinstance(table, nn.Embedding) or not hasattr(model, "args") or not getattr(
            model.args, "tie_word_embeddings", True):
        raise SystemExit("this measures a tied, unquantized embedding table")
    widths = [int(b) for b in args.bits.split(",")]
    variants = {f"{b} bits": rounded(table, b) for b in widths}
    low = variants[f"{widths[0]} bits"]
    variants[f"{widths[0]} bits, lookup only"] = _Sides(low, table)
    variants[f"{widths[0]} bits, head only"] = _Sides(table, low)
    print("text", *variants, sep="\t", flush=True)
    for name in args.texts.split(","):
        texts = eval_texts(name) if name in EVAL_TEXTS else load_texts(name)
        rows = sample_rows(tok, texts, args.rows, args.seq_len, seed=args.seed)
        ref = reference(model, rows)
        kls = []
        for variant in variants.values():
            inner.embed_tokens = variant
            try:
                kls.append(kl_divergence(ref, model, rows)["kl"])
            finally:
                inner.embed_tokens = table
        print(name, *(f"{k:.4f}" for k in kls), sep="\t", flush=True)


if __name__ == "__main__":
    main()
