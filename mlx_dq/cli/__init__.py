"""The mlx_dq command line: a thin layer over the Python API."""

from mlx_dq.cli.commands import main

__all__ = ["main"]
