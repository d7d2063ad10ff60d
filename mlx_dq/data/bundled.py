"""The texts mlx-dq needs without any download: its bundled calibration set and the default evaluation text.

A module of its own because both the calibration rows (:mod:`mlx_dq.data.calib`) and the named evaluation texts
(:mod:`mlx_dq.data.eval_texts`, which drop any document overlapping the calibration set) read them.
"""

from __future__ import annotations

from importlib import resources

from mlx_dq.errors import InputError


def default_calibration_texts() -> list[str]:
    """The bundled calibration set (project-written mixed text), one string per file, in a fixed order."""
    data = resources.files("mlx_dq") / "data"
    names = sorted(f.name for f in data.iterdir() if f.name.startswith("calib_") and f.name.endswith(".txt"))
    if not names:
        raise InputError(f"bundled calibration text is missing from {data}")
    return [(data / n).read_text(encoding="utf-8") for n in names]


def default_eval_texts() -> list[str]:
    """The default evaluation text: CPython's ``pydoc_data.topics`` documentation, one string per topic.

    It is disjoint from the calibration set, so evaluation never scores calibration rows.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some stripped Python builds drop pydoc_data
        raise InputError(
            "default evaluation text needs the standard library's pydoc_data module, "
            "which this Python lacks; pass an evaluation text file instead"
        ) from None
    return [topics[k] for k in sorted(topics)]
