"""Running the command line in-process, and checking that a refusal is one clean line."""

from __future__ import annotations

from click.testing import CliRunner

from mlx_dq.cli import main


def cli(*args, input: bytes | str | None = None):
    """Run the CLI in-process; an exception that escapes the command stays in ``result.exception`` (a traceback)."""
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_error_line(result, *needles: str) -> str:
    """A refusal: exit code 1 or 2, exactly one ``Error:`` line and no traceback, naming every needle
    (case-insensitive, anywhere in the output); returns that line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback instead of an error: {result.exception!r}\n{result.output}")
    assert result.exit_code in (1, 2), result.output
    lines = [ln for ln in result.output.splitlines() if "Error:" in ln]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for n in needles:
        assert n.lower() in result.output.lower(), result.output
    return lines[0]
