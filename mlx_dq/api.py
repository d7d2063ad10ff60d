"""The Python API in mlx-lm's words: ``mlx_dq.convert(hf_path, mlx_path, bpw=...)`` and ``mlx_dq.upload``.

Argument names follow ``mlx_lm.convert`` where the meaning is the same
(``hf_path``, ``mlx_path``, ``upload_repo``, ``dtype``); the rest are
:func:`mlx_dq.convert.convert`'s options.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import hub


def upload(mlx_path: str | Path, upload_repo: str, *, private: bool = False) -> str:
    """Upload a complete output folder to the hub repo ``upload_repo``; return the repo URL.

    Everything is checked first (complete folder, repo id, network, token); the
    card's load instructions are then pointed at the repo and the folder is sent.
    """
    from .card import update_card
    from .report import read_manifest

    hub.upload_files(mlx_path)
    hub.check_upload_ready(upload_repo)
    update_card(mlx_path, read_manifest(mlx_path), ref=upload_repo)
    return hub.upload(mlx_path, upload_repo, private=private)


def _python_call(hf_path: Any, mlx_path: Any, bpw: Any, kwargs: dict) -> str:
    args = [repr(str(hf_path)), repr(str(mlx_path))] + ([f"bpw={bpw!r}"] if bpw is not None else [])
    args += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"mlx_dq.convert({', '.join(args)})"


def convert(
    hf_path: str,
    mlx_path: str | Path = "mlx_model",
    bpw: float | None = None,
    *,
    upload_repo: str | None = None,
    dtype: str | None = None,
    private: bool = False,
    command: str | None = None,
    **options: Any,
) -> dict:
    """Measure, optimize and quantize ``hf_path`` to ``bpw`` bits per weight into the MLX folder ``mlx_path``.

    ``hf_path`` is an HF folder, hub id, .gguf file or ``smollm2-135m``; ``dtype``
    the dtype of scales, biases and 16-bit tensors (float16; bfloat16 or auto with ``method="rtn"``); ``upload_repo`` uploads the finished
    folder (checked for network and token before any work starts). Other options
    (``plan``, ``measurement``, ``mlx_lm_compatible``, ``calib``, ``rows``, ...) are
    those of :func:`mlx_dq.convert.convert`. Returns the manifest.
    """
    from .convert import convert as _convert

    if upload_repo is not None:
        hub.check_upload_ready(upload_repo)
    shown = {k: v for k, v in options.items() if k not in ("progress",)}
    if upload_repo is not None:
        shown["upload_repo"] = upload_repo
    if dtype is not None:
        shown["dtype"] = dtype
    manifest = _convert(hf_path, mlx_path, bpw=bpw, dtype=dtype or "float16",
                        command=command or _python_call(hf_path, mlx_path, bpw, shown), card_ref=upload_repo,
                        **options)
    if upload_repo is not None:
        try:
            upload(mlx_path, upload_repo, private=private)
        except hub.HubError as e:
            raise hub.HubError(f"{e}. The converted folder {mlx_path} is complete: upload it later with "
                               f"`mlx_dq upload {mlx_path} {upload_repo}`") from e
    return manifest
