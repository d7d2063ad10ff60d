"""Readers and writers of other quantization tools' files, one module per format.

- :mod:`.dynquant`: ``dynquant_checkpoint_v2`` manifests (per-module bits of a packed checkpoint);
- :mod:`.mlx_kept16`: MLX affine configs with a ``kept_16bit`` list and a ``tensors`` table;
- :mod:`.dashq`: the output record of the dashq GPTQ-family quantizer (technique flags, results);
- :mod:`.exl2`: what ExLlamaV2 measurements lack (embedding/head) and how their options map to MLX
  (the reader itself is :mod:`mlx_dq.measure.records`).

:func:`detect` names the form of any JSON document these modules or mlx-dq itself write;
:func:`load_plan_any` turns a plan file of any form into a plan for a given model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mlx_dq.errors import InputError
from mlx_dq.formats.common import read_json
from mlx_dq.names import MANIFEST_SCHEMA

FORMS = ("mlx_dq.plan", "mlx_dq.manifest", "mlx_dq.measurement", "exl2_v1", "exl2_v2", "dynquant", "mlx_kept16",
         "dashq")


def detect(data: Any) -> str:
    """The form of a parsed JSON document (one of :data:`FORMS`), or ``"unknown"``."""
    from mlx_dq.formats import dashq, dynquant, mlx_kept16
    from mlx_dq.measure.records import detect_format

    if not isinstance(data, dict):
        return "unknown"
    if data.get("format") == "mlx_dq.plan":
        return "mlx_dq.plan"
    if data.get("schema") == MANIFEST_SCHEMA:
        return "mlx_dq.manifest"
    meas = detect_format(data)
    if meas != "unknown":  # the measurement reader calls its own form "mlx_dq"
        return "mlx_dq.measurement" if meas == "mlx_dq" else meas
    for mod in (dynquant, dashq, mlx_kept16):
        if mod.is_form(data):
            return mod.FORM
    return "unknown"


def load_plan_any(path: str | Path, source: Any) -> Any:
    """A plan for ``source`` from ``path``: our plan file, a dynquant manifest or a kept-16-bit MLX config.

    Foreign files are mapped onto the model's module names; the plan's ``source`` lists what was
    mapped, what was not (with the reason) and what MLX could not store as is.
    """
    from mlx_dq.formats.common import model_modules
    from mlx_dq.plan.plan import load_plan

    data = read_json(path)
    kind = detect(data)
    if kind == "mlx_dq.plan":
        return load_plan(path)
    model_type = source.config.get("model_type")
    if kind == "dynquant":
        from mlx_dq.formats.dynquant import to_plan
    elif kind == "mlx_kept16":
        from mlx_dq.formats.mlx_kept16 import to_plan
    else:
        raise InputError(f"{path}: not a plan: expected an mlx_dq plan, a dynquant manifest or an MLX config with "
                         f"kept_16bit (found a {kind} document)")
    return to_plan(data, model_modules(source), model_type, path=str(path))


def json_kind(path: str | os.PathLike) -> str:
    """The form of a JSON file (see :func:`mlx_dq.formats.detect`), ``"unknown"`` when unreadable or not JSON."""
    try:
        return detect(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return "unknown"
