"""mlx-lm's HTTP server serves mlx-dq output folders: one real chat-completions request each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from mlx_dq.conversion.pipeline import convert
from mlx_dq.model.capture import quantizable_modules
from mlx_dq.model.sources import build_model, resolve

START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def _wait_ready(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if _get(base + "/health") == 200:
                return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not ready after {START_TIMEOUT_S} s")


@pytest.mark.parametrize("mixed", [False, True], ids=["compatible", "mixed"])
def test_mlx_lm_server_answers_a_chat_completion(tiny_llama, tmp_path, mixed):
    mods = quantizable_modules(build_model(resolve(str(tiny_llama)).config))
    recipe = {p: ("0.25:4b_32g/0.75:3b_32g" if mixed and "layers.1.mlp" in p else "1.0:4b_64g") for p in mods}
    out = tmp_path / ("mixed" if mixed else "stock")
    manifest = convert(str(tiny_llama), out, plan=recipe, rows=2, seq_len=32, method="rtn", progress=False)
    assert bool(manifest["mixed_modules"]) == mixed
    assert json.loads((out / "tokenizer_config.json").read_text()).get("chat_template") or \
        (out / "chat_template.jinja").is_file()  # the server applies the chat template

    port = _free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(out), "--host", "127.0.0.1",
           "--port", str(port), "--max-tokens", "8", "--log-level", "WARNING"]
    if mixed:
        cmd.append("--trust-remote-code")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, base)
        body = {"model": str(out), "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "temperature": 0.0}
        req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            assert r.status == 200
            answer = json.loads(r.read())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    assert answer["object"] == "chat.completion"
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 5 and 1 <= usage["completion_tokens"] <= 8
