"""mlx-dq: measurement-driven mixed-precision quantization for MLX."""

__version__ = "0.1.0"


def load(path, lazy: bool = False):
    """Load an mlx-dq output folder (mixed-proportion layers included) as ``(model, tokenizer)``."""
    from mlx_dq.loader import load as _load

    return _load(path, lazy=lazy)


def upload(mlx_path, upload_repo: str, *, private: bool = False) -> str:
    """Upload a complete mlx-dq output folder to the Hugging Face hub repo ``upload_repo``; return its URL."""
    from mlx_dq.api import upload as _upload

    return _upload(mlx_path, upload_repo, private=private)


def __getattr__(name: str):
    """``mlx_dq.convert``: :func:`mlx_dq.api.convert` (mlx-lm's argument names), imported on first use."""
    if name == "convert":
        from mlx_dq.api import convert

        return convert
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
