"""Evaluation of a model on token rows: perplexity (KL divergence comes later).

Everything is computed in float32 from the model's logits. On the MLX CPU
backend, evaluate a quantized model through dequantized float32 weights:
CPU quantized matmuls are far slower and low-precision matmuls accumulate
error (see the design notes).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm


def perplexity(model: nn.Module, rows: mx.array, batch_size: int = 8, progress: bool = False) -> float:
    """Perplexity of ``model`` on ``[n, seq_len]`` token rows: exp of the mean next-token loss in float32.

    Every position but the last of each row predicts the next token; the model is used as given.
    """
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n_rows, seq_len >= 2], got shape {tuple(rows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = 0.0
    count = 0
    starts = range(0, rows.shape[0], batch_size)
    for i in tqdm(starts, desc="perplexity", unit="batch", disable=not progress):
        batch = rows[i : i + batch_size]
        logits = model(batch[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="sum")
        total += float(loss.item())
        count += batch[:, 1:].size
    return math.exp(total / count)
