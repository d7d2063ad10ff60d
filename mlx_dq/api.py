"""The Python API in mlx-lm's words: ``mlx_dq.convert(hf_path, mlx_path, bpw=...)`` and ``mlx_dq.upload``.

Argument names follow ``mlx_lm.convert`` where the meaning is the same
(``hf_path``, ``mlx_path``, ``upload_repo``, ``dtype``); the rest are
:func:`mlx_dq.conversion.pipeline.convert`'s options.
"""

from __future__ import annotations

from mlx_dq.conversion.hub import upload_output as upload
from mlx_dq.conversion.pipeline import convert_as_mlx_lm as convert

__all__ = ["convert", "upload"]
