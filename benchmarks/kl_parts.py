"""Which parts of a quantized model cost its KL: each part's quantized weights alone in the float source.

Loads an output folder and its source model (the manifest's, or ``--base``), samples the evaluation rows
exactly as ``mlx_dq eval`` does, and prints the KL divergence against the source when only one part is
quantized: everything, the tensors outside the decoder layers (embedding, head), the decoder layers, each
third of them, attention, MLP, and for a tied embedding its lookup side and its head side separately.
Why: one KL number does not say where a plan spends too few bits; on Gemma-3-270M at 3.5 bpw the tied
262k-token embedding alone cost KL 0.49 of the whole model's 0.52 on tiny-shakespeare.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/kl_parts.py smollm2-135m-3.5bpw --text shakespeare
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten


def parts(n_layers: int) -> dict[str, Callable[[str, int | None], bool]]:
    """Part name -> ``(parameter path, decoder layer or None) -> belongs``."""
    third = max(1, -(-n_layers // 3))
    out: dict[str, Callable[[str, int | None], bool]] = {
        "everything": lambda k, i: True,
        "outside the layers (embedding, head)": lambda k, i: i is None,
        "decoder layers": lambda k, i: i is not None,
    }
    for a in range(0, n_layers, third):
        b = min(n_layers, a + third) - 1
        out[f"layers {a}-{b}"] = lambda k, i, a=a, b=b: i is not None and a <= i <= b
    out["attention"] = lambda k, i: i is not None and "attn" in k
    out["mlp"] = lambda k, i: i is not None and ("mlp" in k or "expert" in k)
    return out


def main() -> None:
    import mlx.nn as nn

    from mlx_dq.data import calib
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.layers.rowsplit import RowSplitEmbedding
    from mlx_dq.model.sources import load_model
    from mlx_dq.names import layer_index

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="an mlx-dq output folder (or any quantized MLX folder with --base)")
    ap.add_argument("--base", default=None, help="source model (default: the folder manifest's)")
    ap.add_argument("--text", default=None, help="evaluation text, as for mlx_dq eval")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    base = args.base or evaluate.manifest_base(args.folder)
    if base is None:
        raise SystemExit(f"{args.folder}: no source recorded in its manifest; pass --base")
    q = evaluate.dequantize_model(evaluate.load_for_eval(args.folder)[0])
    for path, m in list(q.named_modules()):  # a table with frequent-token rows: one float table again
        if isinstance(m, RowSplitEmbedding):
            whole = nn.Embedding(*m.table().shape)
            whole.weight = m.table()
            q.update_modules(tree_unflatten([(path, whole)]))
    quantized = dict(tree_flatten(q.parameters()))
    src, tokenizer, _ = load_model(base, dtype=mx.float32)
    texts, source = calib.resolve_eval_texts(args.text)
    rows = calib.sample_rows(tokenizer, texts, args.rows, args.seq_len, args.seed)
    ref = evaluate.reference(src, rows)
    source_weights = dict(tree_flatten(src.parameters()))
    names = list(source_weights)
    n_layers = 1 + max((layer_index(k) or 0) for k in names)
    print(f"{args.folder} against {base}; text {source}, {args.rows} x {args.seq_len} tokens, seed {args.seed}")
    print(f"{'quantized part':40s} {'tensors':>7s} {'KL':>8s} {'top-1':>7s}")

    def score(label: str, weights: list[tuple[str, mx.array]], head: mx.array | None = None) -> None:
        """The KL with ``weights`` in the source (and a tied head reading ``head``); the source is restored after."""
        src.load_weights(weights, strict=False)
        try:
            with tied_head_reading(src, head):
                t0 = time.perf_counter()
                r = evaluate.kl_divergence(ref, src, rows)
        finally:
            src.load_weights([(k, source_weights[k]) for k, _ in weights], strict=False)
        print(f"{label:40s} {len(weights):7d} {r['kl']:8.4f} {r['top1']:7.4f}   ({time.perf_counter() - t0:.0f} s)",
              flush=True)

    for label, belongs in parts(n_layers).items():
        score(label, [(k, quantized[k]) for k in names if k in quantized and belongs(k, layer_index(k))])
    embed = next((k for k in names if k.endswith("embed_tokens.weight")), None)
    if embed is not None and embed in quantized and not any(k.endswith("lm_head.weight") for k in names):  # tied
        score("tied embedding: lookup side only", [(embed, quantized[embed])], head=source_weights[embed])
        score("tied embedding: head side only", [], head=quantized[embed])


@contextmanager
def tied_head_reading(model, head: mx.array | None) -> Iterator[None]:
    """Inside, a tied embedding's head side reads ``head`` while its lookup side keeps its own weight (None:
    unchanged)."""
    if head is None:
        yield
        return
    object.__setattr__(_embedding(model), "as_linear", lambda x: x @ head.T)
    try:
        yield
    finally:
        object.__delattr__(_embedding(model), "as_linear")


def _embedding(model):
    """The embedding module of an mlx-lm language model (text-only or with a ``language_model``)."""
    return model.model.embed_tokens if hasattr(model, "model") else model.language_model.model.embed_tokens


if __name__ == "__main__":
    main()
