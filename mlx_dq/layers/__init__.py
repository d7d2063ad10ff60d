"""Quantized layers: mixed-proportion Linear / Embedding / expert banks and their kernels."""
