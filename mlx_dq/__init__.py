"""mlx-dq: measurement-driven mixed-precision quantization for MLX."""

__version__ = "0.1.0"
