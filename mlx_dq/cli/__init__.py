"""The mlx_dq command line: a thin layer over the Python API, one module of commands per stage."""

from mlx_dq.cli import convert, inspect, measure, plan, run
from mlx_dq.cli.group import main

for _command in (*measure.COMMANDS, *plan.COMMANDS, *convert.COMMANDS, *inspect.COMMANDS, *run.COMMANDS):
    main.add_command(_command)
del _command

__all__ = ["main"]
