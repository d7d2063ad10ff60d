"""Write an AWQ-equalised float32 copy of a model, to measure whether equalisation before GPTQ helps mlx-dq.

Runs mlx-lm's own AWQ scale search (``mlx_lm.quant.awq.scale_block``: per-channel scales from the inputs' mean
magnitude, the exponent chosen on the block's output error under round-to-nearest at ``--bits`` g64) one decoder
layer at a time over the bundled calibration rows, folds the scales into the preceding norm / linear, and saves the
result as an MLX model folder. No clipping and no quantization: the copy computes the source's function (up to float
rounding, printed per layer), so ``mlx_dq convert --model COPY`` followed by ``mlx_dq eval OUT --base SOURCE``
measures equalisation + mlx-dq against the unchanged source. Results: benchmarks/results/out_of_sample/experiments/.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/equalise_source.py smollm2-135m /tmp/eq --bits 3 --rows 8 --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask
from mlx_lm.quant import awq

from mlx_dq.data.calib import calibration_rows
from mlx_dq.errors import MlxDqError
from mlx_dq.model.sources import resolve
from mlx_dq.safety import guard_output_folder, make_partial_folder, publish_folder


def _capturing(module: nn.Module) -> nn.Module:
    """A stand-in for a linear layer that stores its inputs on it as ``input_feat`` (what mlx-lm's search reads)."""
    if not isinstance(module, nn.Linear):
        return module

    class Catcher(nn.Module):
        def __call__(self, x, *args, **kwargs):
            prev = getattr(module, "input_feat", None)
            module.input_feat = x if prev is None else mx.concatenate([prev, x], 0)
            return module(x, *args, **kwargs)

    return Catcher()


def equalise(spec: str, dst: Path, bits: int, rows: int, seq_len: int, n_grid: int) -> None:
    """Equalise ``spec``'s decoder layers with mlx-lm's AWQ scale search and save the float32 copy at ``dst``."""
    src = resolve(spec)
    config = awq.AWQ_MODEL_CONFIGS.get(src.config["model_type"])
    if config is None:
        raise SystemExit(f"mlx-lm's AWQ has no scale configuration for {src.config['model_type']!r}")
    # never into the source or a non-empty folder; built in a partial sibling so a killed run looks unfinished
    guard_output_folder(dst, force=False, protected=[("source model", src.path)])
    model = src.model(mx.float32)
    _, tokens = calibration_rows(src.tokenizer(), None, rows, seq_len, 0)
    inner = model.model

    def rtn(w: mx.array) -> mx.array:
        return mx.dequantize(*mx.quantize(w, bits=bits, group_size=64), bits=bits, group_size=64)

    h = inner.embed_tokens(tokens)
    if src.config["model_type"].startswith("gemma"):  # gemma scales its embeddings (in bfloat16, as mlx-lm does)
        h = h * mx.array(src.config["hidden_size"] ** 0.5, mx.bfloat16).astype(h.dtype)
    mask = create_attention_mask(h, None)
    t0 = time.perf_counter()
    for i, block in enumerate(inner.layers):
        leaves = block.leaf_modules()
        block.update_modules(tree_map(_capturing, leaves, is_leaf=nn.Module.is_module))
        out = awq.run_layer(block, h, mask=mask)
        block.update_modules(leaves)
        awq.scale_block(block=block, configs=config.scale_configs, quantize_func=rtn, n_grid=n_grid,
                        layer_kwargs={"mask": mask})
        for _, m in block.named_modules():
            if hasattr(m, "input_feat"):
                del m.input_feat
        drift = float(mx.abs(out - awq.run_layer(block, h, mask=mask)).max())
        print(f"layer {i}: max |output change| {drift:.2e}, {time.perf_counter() - t0:.0f} s", flush=True)
        h = out
    tmp = make_partial_folder(dst)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(src.config, indent=1))
    src.save_tokenizer(tmp)
    publish_folder(tmp, dst)
    print(f"wrote {dst}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("output", type=Path)
    ap.add_argument("--bits", type=int, default=3, help="round-to-nearest width the scales are searched at (g64)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--grid", type=int, default=20, help="exponents tried per scale group (mlx-lm's n_grid)")
    a = ap.parse_args()
    try:
        equalise(a.model, a.output, a.bits, a.rows, a.seq_len, a.grid)
    except MlxDqError as e:  # a bad model or output folder: one line, as the CLI says it
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
