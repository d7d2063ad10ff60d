"""The mlx_dq command line: help everywhere, info and perplexity on tiny models, perplexity itself."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from click.testing import CliRunner

from mlx_dq.cli import main
from mlx_dq.evaluation import metrics as evaluate

COMMANDS = ["info", "perplexity", "measure", "optimize", "convert", "inspect", "eval", "generate", "verify"]


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def perplexity_in(output: str) -> float:
    m = re.search(r"^perplexity: ([0-9.]+)$", output, re.M)
    assert m, output
    return float(m.group(1))


def test_group_help_lists_every_command():
    result = run("--help")
    assert result.exit_code == 0
    for name in COMMANDS:
        assert re.search(rf"^\s+{name}\s", result.stdout, re.M), name


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_command_has_help(name, flag):
    assert name in main.commands
    result = run(name, flag)
    assert result.exit_code == 0
    assert result.stdout.startswith(f"Usage: mlx_dq {name}")


def test_python_dash_m_runs_the_cli():
    proc = subprocess.run([sys.executable, "-m", "mlx_dq", "--help"], capture_output=True, text=True, env=os.environ)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: mlx_dq")


def test_info_on_tiny_llama(tiny_llama):
    # expected parameter count read straight from the saved weight files
    expected = sum(v.size for f in tiny_llama.glob("*.safetensors") for v in mx.load(str(f)).values())
    result = run("info", str(tiny_llama))
    assert result.exit_code == 0, result.output
    assert re.search(r"^source:\s+folder$", result.stdout, re.M)
    assert re.search(r"^architecture:\s+llama$", result.stdout, re.M)
    assert re.search(r"^layers:\s+2$", result.stdout, re.M)
    assert re.search(rf"^parameters:\s+{expected:,}$", result.stdout, re.M)


def test_info_missing_model_names_it(tmp_path):
    result = run("info", str(tmp_path / "no_such_model"))
    assert result.exit_code == 1
    assert "no_such_model" in result.stderr


def test_perplexity_on_tiny_model_with_a_text_file(tiny_llama, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("The river ran past the mill and under the bridge. " * 40, encoding="utf-8")
    args = ["perplexity", "--model", str(tiny_llama), "--text", str(text), "--rows", "3", "--seq-len", "32"]
    first, second = run(*args), run(*args)
    assert first.exit_code == 0, first.output
    ppl = perplexity_in(first.stdout)
    assert math.isfinite(ppl) and ppl > 1.0
    assert perplexity_in(second.stdout) == ppl
    assert "3 rows x 32 tokens" in first.stdout


def test_perplexity_on_default_eval_text(tiny_qwen2):
    result = run("perplexity", "--model", str(tiny_qwen2), "--rows", "2", "--seq-len", "24", "--seed", "4")
    assert result.exit_code == 0, result.output
    assert "pydoc_data.topics" in result.stdout
    assert perplexity_in(result.stdout) > 1.0


def test_perplexity_rejects_an_empty_text_file(tiny_llama, tmp_path):
    empty = tmp_path / "blank.txt"
    empty.write_text("", encoding="utf-8")
    result = run("perplexity", "--model", str(tiny_llama), "--text", str(empty))
    assert result.exit_code == 2
    assert "blank.txt" in result.stderr


def test_perplexity_rejects_a_missing_model(tmp_path):
    result = run("perplexity", "--model", str(tmp_path / "gone"), "--rows", "1", "--seq-len", "8")
    assert result.exit_code == 1
    assert "gone" in result.stderr


class FixedLogits(nn.Module):
    """A stand-in language model whose logits are chosen by the test."""

    def __init__(self, vocab: int, perfect: bool):
        super().__init__()
        self.vocab, self.perfect = vocab, perfect

    def __call__(self, tokens: mx.array) -> mx.array:
        if not self.perfect:
            return mx.zeros((*tokens.shape, self.vocab))
        # rows count upwards, so the next token is always current + 1
        return 50.0 * (mx.arange(self.vocab) == (tokens[..., None] + 1)).astype(mx.float32)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    rows = mx.arange(40, dtype=mx.int32).reshape(4, 10)
    assert evaluate.perplexity(FixedLogits(64, perfect=False), rows, batch_size=3) == pytest.approx(64.0, rel=1e-5)


def test_perplexity_of_a_perfect_predictor_is_one():
    rows = mx.arange(40, dtype=mx.int32).reshape(4, 10)
    assert evaluate.perplexity(FixedLogits(64, perfect=True), rows, batch_size=2) == pytest.approx(1.0, abs=1e-6)


def test_perplexity_rejects_bad_rows():
    with pytest.raises(ValueError, match="rows must be"):
        evaluate.perplexity(FixedLogits(8, perfect=False), mx.zeros((5,), dtype=mx.int32))


@pytest.mark.slow
def test_perplexity_of_the_bundled_model(bundled_gguf):
    result = run("perplexity", "--model", "smollm2-135m", "--rows", "2", "--seq-len", "128")
    assert result.exit_code == 0, result.output
    # a working 135M model on English documentation: far below the uniform 49152, above 1
    assert 2.0 < perplexity_in(result.stdout) < 60.0



def test_perplexity_on_a_named_eval_text(tiny_llama):
    args = ("perplexity", "--model", str(tiny_llama), "--rows", "2", "--seq-len", "24")
    named, default = run(*args, "--text", "dialog"), run(*args)
    assert named.exit_code == 0, named.output
    assert "chatterbot-corpus" in named.stdout
    assert perplexity_in(named.stdout) > 1.0
    assert perplexity_in(named.stdout) != perplexity_in(default.stdout)


def test_perplexity_rejects_an_unknown_text_name(tiny_llama):
    result = run("perplexity", "--model", str(tiny_llama), "--text", "poetry")
    assert result.exit_code == 2
    assert "unknown evaluation text 'poetry'" in result.stderr
