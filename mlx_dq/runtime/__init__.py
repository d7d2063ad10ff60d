"""How mlx-dq runs: OpenBLAS on Linux, worker threads, several ranks over mx.distributed."""
