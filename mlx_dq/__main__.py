"""Run the mlx_dq command line as ``python -m mlx_dq``."""

from mlx_dq.cli import main

if __name__ == "__main__":
    main(prog_name="mlx_dq")
