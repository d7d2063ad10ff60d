"""Stage settings as data: each stage's options, their defaults and their allowed values, in one place.

The library functions (:func:`mlx_dq.measure.stream.measure`, :func:`mlx_dq.conversion.pipeline.convert`,
:func:`mlx_dq.conversion.pipeline.quantize_model`) and the command line both take their
defaults from these classes (the click options are built from them and a test
checks they agree), so one set of arguments gives the same model from the
shell and from Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dq.errors import InputError
from mlx_dq.quant.spec import DEFAULT_DAMP, METHODS, QuantizerSpec

IMPORTANCE_MODES = ("residual", "kl", "none")
EXPERT_MODES = ("per_expert", "shared")
DTYPES = ("float16", "bfloat16", "auto")
HEAD_CHUNK = 128  # positions per head call: logits are [chunk, vocab] float32, never [calibration tokens, vocab]
TEACHER_CACHE_BYTES = 2 << 30  # distillation keeps the source's log-probabilities in memory up to this, else recomputes


class _Settings:
    """Shared behaviour: built from keyword options (unknown names refused), checked, and turned into a dict."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names of this stage."""
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``options`` split into (this stage's, the rest)."""
        mine = {k: v for k, v in options.items() if k in cls.names()}
        return mine, {k: v for k, v in options.items() if k not in mine}

    def with_options(self, **options: Any):  # noqa: ANN201 - returns the same settings class
        """A copy with ``options`` changed; a name this stage does not have is a TypeError, as for a function."""
        unknown = sorted(set(options) - set(self.names()))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no option(s) {', '.join(unknown)}")
        new = replace(self, **options)  # type: ignore[type-var]
        new.check()
        return new

    def check(self) -> None:
        """Raise ValueError for a value outside its allowed range."""

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain values (paths as strings), for manifests and digests."""
        return {f.name: (str(v) if isinstance(v := getattr(self, f.name), Path) else v)
                for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class CalibSettings(_Settings):
    """Calibration rows: which text, how many rows of how many tokens, and the seed choosing them."""

    calib: str | Path | tuple[str, ...] | None = None  # several: sources sharing the rows (data.calib)
    rows: int = 32
    seq_len: int = 512
    seed: int = 0

    def check(self) -> None:
        if self.rows < 1 or self.seq_len < 2:
            raise InputError(f"need rows >= 1 and seq_len >= 2; got rows={self.rows}, seq_len={self.seq_len}")


@dataclass(frozen=True)
class MeasureSettings(_Settings):
    """What ``measure`` does: calibration, option grid, importance and the quantizer whose errors are measured.

    ``clip`` None means off (see :meth:`resolved_clip`); ``convert`` clips its GPTQ scales either way.
    """

    calib: str | Path | tuple[str, ...] | None = None  # several: sources sharing the rows (data.calib)
    rows: int = 16
    seq_len: int = 512
    seed: int = 0
    grid: str | Path | None = None
    importance: str = "residual"
    # One row of each of the five bundled calibration files (the rows are interleaved file by file,
    # calib.sample_rows_balanced): the tensors' importance is priced on every kind of text, not on one.
    importance_rows: int = 5
    batch_size: int = 4
    expert_mode: str = "per_expert"
    clip: bool | None = None
    method: str = "gptq"
    damp: float = DEFAULT_DAMP
    kl_scale: bool = True
    head_chunk: int = HEAD_CHUNK
    # Options measured on 256 output rows of each wide linear layer (measure.output_row_sample): rows are
    # independent in GPTQ and rounding, so a stratified sample prices each option nearly as all rows do, for a
    # fraction of the work (docs/cost.md#sampled-output-rows).
    sample_rows: int = 256

    def check(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.importance not in IMPORTANCE_MODES:
            raise InputError(f"importance must be one of {IMPORTANCE_MODES}, got {self.importance!r}")
        if self.rows < 1 or self.seq_len < 2 or self.batch_size < 1 or self.importance_rows < 1:
            raise InputError(
                "need rows >= 1, seq_len >= 2, batch_size >= 1 and importance_rows >= 1; got "
                f"rows={self.rows}, seq_len={self.seq_len}, batch_size={self.batch_size}, "
                f"importance_rows={self.importance_rows}"
            )
        if self.sample_rows < 0:
            raise InputError(f"sample_rows must be >= 0, got {self.sample_rows}")
        if self.damp < 0:
            raise InputError(f"damp must be >= 0, got {self.damp}")

    def quantizer(self) -> QuantizerSpec:
        """The quantizer whose errors are measured: this method, clip search (:attr:`resolved_clip`) and damping."""
        return QuantizerSpec(method=self.method, clip=self.resolved_clip, damp=self.damp)

    @property
    def resolved_clip(self) -> bool:
        """The clip search actually used: as given, else off.

        Why off for GPTQ too: GPTQ's weighted scale search still runs, the clip candidates are a large share of its
        work, and the plans measured without them convert no worse (docs/quality.md#figures-behind-the-code)."""
        return False if self.clip is None else bool(self.clip)

    @property
    def resolved_kl_scale(self) -> bool:
        """KL units apply to residual importance only."""
        return self.kl_scale and self.importance == "residual"


@dataclass(frozen=True)
class QuantizeSettings(CalibSettings):
    """How ``convert`` quantizes: calibration rows, method, sequential inputs, clip search, damping, output dtype."""

    method: str = "gptq"
    sequential: bool = True
    clip: bool = True
    damp: float = DEFAULT_DAMP
    dtype: str = "float16"
    promote_mixed: bool = False

    def check(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.dtype not in DTYPES:
            raise InputError(f"dtype must be float16, bfloat16 or auto (the source's), got {self.dtype!r}")
        if self.damp < 0:
            raise InputError(f"damp must be >= 0, got {self.damp}")
        super().check()

    def quantizer(self, scale_dtype: Any = mx.float16) -> QuantizerSpec:
        """The quantizer convert applies: this method, clip search, damping and promotion, scales in
        ``scale_dtype`` (the resolved output dtype)."""
        return QuantizerSpec(method=self.method, clip=self.clip, damp=self.damp, promote_mixed=self.promote_mixed,
                             scale_dtype=scale_dtype)

    def measure_defaults(self) -> dict[str, Any]:
        """The measurement options that follow from these settings: the same rows and the same quantizer.

        The measurement convert makes uses its calibration rows (text, count, length,
        seed), its method and its damping, so the errors the plan is built on are those of this
        conversion's quantizer; it measures without the clip candidates either way
        (:meth:`MeasureSettings.resolved_clip` says why).
        """
        return {"calib": self.calib, "rows": self.rows, "seq_len": self.seq_len, "seed": self.seed,
                "method": self.method, "clip": False, "damp": self.damp}


@dataclass(frozen=True)
class PlanSettings(_Settings):
    """What ``convert`` plans for: the bpw target, embedding/head option, kept tensors, stock-loadable options."""

    bpw: float | None = None
    head_option: str | None = None
    keep: tuple[str, ...] = field(default=())
    keep_outside_budget: bool = False
    mlx_lm_compatible: bool = False
    frequent_rows: bool = True  # embeddings store the calibration's tokens' rows finer (mlx_dq.quant.rowsplit)


@dataclass(frozen=True)
class DistillSettings(CalibSettings):
    """What one distillation run does: its calibration rows, steps, optimizer and what it trains."""

    rows: int = 40  # each row once in the 40 steps: rows seen several times overfit (docs/quality.md#distillation)
    seq_len: int = 128
    steps: int = 40
    batch_size: int = 1
    lr: float = 1e-4
    temperature: float = 1.0
    train_norms: bool = False

    def check(self) -> None:
        if self.rows < 1 or self.seq_len < 3:
            raise InputError(f"need rows >= 1 and seq_len >= 3; got rows={self.rows}, seq_len={self.seq_len}")
        if self.steps < 1:
            raise InputError(f"need steps >= 1, got {self.steps}")
        if not 1 <= self.batch_size <= self.rows:
            raise InputError(f"batch_size must be between 1 and rows ({self.rows}), got {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise InputError(f"temperature must be a positive number, got {self.temperature}")
