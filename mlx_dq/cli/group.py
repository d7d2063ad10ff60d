"""The ``mlx_dq`` command group: the one error boundary, and helpers the commands share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mlx_dq.errors import MlxDqError

CONTEXT = {"help_option_names": ["-h", "--help"]}


class _Main(click.Group):
    """The command group; run as a program it first preloads OpenBLAS on Linux and records its arguments."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from mlx_dq.runtime.openblas import maybe_reexec

        maybe_reexec()
        return super().__call__(*args, **kwargs)

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        argv = list(args)
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta["mlx_dq.argv"] = argv  # the exact command, for model cards
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command: the one place where an error becomes one ``Error: <message>`` line and exit status 1.

        An :class:`~mlx_dq.errors.MlxDqError` (a user's mistake, a damaged file) prints its message. An OSError is
        the system refusing a path the user gave (missing, permission denied, disk full): it prints as one line
        naming the file, as no command can say more. Anything else is a bug and keeps its traceback."""
        from mlx_dq.runtime.threads import env_workers

        try:
            env_workers()  # a bad MLX_DQ_THREADS fails now, not when the first layer's work is handed out
            return super().invoke(ctx)
        except MlxDqError as e:
            raise click.ClickException(_rank_tag(str(e))) from None
        except OSError as e:
            raise click.ClickException(_rank_tag(_os_error_line(e))) from None


def _os_error_line(e: OSError) -> str:
    """An OSError as one line that names its file(s): ``out/model.safetensors: No space left on device``."""
    if e.filename is None or not e.strerror:
        return str(e)
    return f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") + f": {e.strerror}"


@click.group(name="mlx_dq", cls=_Main, context_settings=CONTEXT)
@click.version_option(package_name="mlx-dq", prog_name="mlx_dq")
@click.pass_context
def main(ctx: click.Context) -> None:
    """mlx-dq: measurement-driven mixed-precision quantization for MLX."""
    from mlx_dq.safety import cli_messages

    ctx.with_resource(cli_messages())  # messages name options as typed here (--force), not as arguments


def _rank_tag(message: str) -> str:
    """``message`` naming this rank when several ranks run under ``mlx.launch``."""
    from mlx_dq.runtime.distributed import tag

    return tag(message)


def is_root() -> bool:
    """True unless this process is a rank other than 0 under ``mlx.launch``."""
    from mlx_dq.runtime.distributed import is_root

    return is_root()


def source_path(model_spec: str | None) -> Any:
    """Where a model spec's files are (its folder or file), or None when it cannot be found (the run says why)."""
    if model_spec is None:
        return None
    if Path(model_spec).exists():
        return model_spec
    from mlx_dq.model.sources import resolve

    try:
        return resolve(model_spec).path
    except (ValueError, OSError):
        return None


CALIB_HELP = ("Calibration .txt/.jsonl file or folder [default: the bundled calibration text]. Repeat to mix: "
              "'--calib bundled --calib mine.txt' adds your text as one more kind beside the bundled files "
              "(rows shared evenly between the bundled files and each text given).")


def calib_arg(values: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """``--calib``'s values as the settings take them: None (the bundled text), one source, or several; each
    source is read now, so a bad one fails before the time estimate is printed."""
    from mlx_dq.data.calib import check_calib

    spec = None if not values else values[0] if len(values) == 1 else tuple(values)
    check_calib(spec)
    return spec
