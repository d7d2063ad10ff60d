"""Does the calibration text's domain decide the held-out loss? Helpers for experiments/calibration_domain.md.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/calibration_domain.py \\
        split legal OUT                      # OUT/legal_a.txt, OUT/legal_b.txt: the first / second half of its documents
        generate smollm2-135m OUT/gen.txt    # text the float source writes itself (48 x 512 tokens, seed 0)
        baseline smollm2-135m OUT/legal_b.txt legal   # mlx-lm 4-bit g64's KL on each text (8 x 512 tokens, seed 0)

Calibrating on one half of a text and evaluating on the other keeps the calibration rows out of the evaluation rows
(``mlx_dq eval OUT --text OUT/legal_b.txt``), so the in-domain figure is still out of sample.
"""

from __future__ import annotations

import time
from pathlib import Path

import baselines
import click
import mlx.core as mx

from mlx_dq.data import calib
from mlx_dq.data.eval_texts import eval_texts
from mlx_dq.evaluation import metrics
from mlx_dq.model.sources import load_model


@click.group()
def cli() -> None:
    """Calibration-domain experiment helpers."""


@cli.command()
@click.argument("name")
@click.argument("out", type=click.Path(file_okay=False))
def split(name: str, out: str) -> None:
    """Write the named evaluation text's documents in two halves, NAME_a.txt and NAME_b.txt."""
    docs = eval_texts(name)
    half = len(docs) // 2
    Path(out).mkdir(parents=True, exist_ok=True)
    for suffix, part in (("a", docs[:half]), ("b", docs[half:])):
        path = Path(out) / f"{name}_{suffix}.txt"
        path.write_text("\n\n".join(part), encoding="utf-8")
        click.echo(f"{path}: {len(part)} documents, {sum(map(len, part))} characters")


@cli.command()
@click.argument("model")
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--rows", default=48, show_default=True, help="Texts generated at once.")
@click.option("--tokens", default=512, show_default=True, help="Tokens per text.")
@click.option("--temp", default=0.8, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("--seed", default=0, show_default=True)
def generate(model: str, out: str, rows: int, tokens: int, temp: float, top_p: float, seed: int) -> None:
    """Sample text from the float source, each row started from a random vocabulary token (as LLM-QAT's
    data-free calibration does), so the text covers what the model itself writes rather than one domain."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    net, tokenizer, config = load_model(model)
    mx.random.seed(seed)
    vocab = int(config.get("vocab_size") or net.args.vocab_size)
    bos = tokenizer.bos_token_id
    x = mx.random.randint(0, vocab, (rows, 1)).astype(mx.int32)
    if bos is not None:
        x = mx.concatenate([mx.full((rows, 1), bos, dtype=mx.int32), x], axis=1)
    sampler = make_sampler(temp=temp, top_p=top_p)
    cache = make_prompt_cache(net)
    t0 = time.perf_counter()
    pieces = [x]
    logits = net(x, cache=cache)[:, -1, :]
    for _ in range(tokens):
        nxt = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[:, None].astype(mx.int32)
        pieces.append(nxt)
        logits = net(nxt, cache=cache)[:, -1, :]
        mx.eval(logits)
    ids = mx.concatenate(pieces, axis=1).tolist()
    text = "".join(tokenizer.decode([t for t in row if t != bos]).replace("\n\n\n", "\n\n") + "\n\n" for row in ids)
    Path(out).write_text(text, encoding="utf-8")
    click.echo(f"{out}: {rows} x {tokens} tokens in {time.perf_counter() - t0:.0f} s")


@cli.command()
@click.argument("model")
@click.argument("texts", nargs=-1, required=True)
@click.option("--rows", default=8, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
def baseline(model: str, texts: tuple[str, ...], rows: int, seq_len: int) -> None:
    """mlx-lm 4-bit g64's KL against the float32 source on each text (the rows ``mlx_dq eval`` draws, seed 0)."""
    net, tokenizer, config = load_model(model)
    q4 = metrics.dequantize_model(baselines.uniform(net, config, 4, 64)[0])
    for text in texts:
        docs, _ = calib.resolve_eval_texts(text)
        tokens = calib.sample_rows(tokenizer, docs, rows, seq_len, 0)
        click.echo(f"{text}: mlx-lm 4-bit g64 KL {metrics.kl_divergence(net, q4, tokens)['kl']:.4f}")


if __name__ == "__main__":
    cli()
