"""Quantizers: MLX affine storage, round-to-nearest with clip search, GPTQ, and the one dispatch."""
