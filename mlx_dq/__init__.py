"""mlx-dq: measurement-driven mixed-precision quantization for MLX."""

__version__ = "0.1.0"


def load(path, lazy: bool = False):
    """Load an mlx-dq output folder (mixed-proportion layers included) as ``(model, tokenizer)``."""
    from .loader import load as _load

    return _load(path, lazy=lazy)
