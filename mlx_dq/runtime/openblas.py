"""Use Debian's OpenBLAS for MLX's CPU matrix products when the ``mlx_dq`` command starts on Linux.

The ``mlx[cpu]`` wheel's own float32 GEMM is much slower than OpenBLAS
(pthread build) preloaded, with the same results (docs/cost.md#openblas-on-linux). A library can only
be preloaded before the process starts, so the command re-executes itself once
with ``LD_PRELOAD`` set (and a one-line note on stderr). ``MLX_DQ_NO_OPENBLAS=1``
turns this off; a guard variable stops any second re-exec; macOS is never touched.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

OPENBLAS_PATH = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
OPT_OUT_VAR = "MLX_DQ_NO_OPENBLAS"
GUARD_VAR = "MLX_DQ_OPENBLAS_REEXEC"
PATH_VAR = "MLX_DQ_OPENBLAS_PATH"  # another OpenBLAS build to preload (tests, other distributions)
_FALSE = ("", "0", "false", "no", "off")
INSTALL = "apt-get install libopenblas0-pthread"  # Debian/Ubuntu's package of the library at OPENBLAS_PATH
# a typical ratio of float32 matmul rates with it preloaded / without, for the estimate's time with OpenBLAS (a
# process without it cannot time the rate with it; docs/cost.md#figures-behind-the-code)
SPEEDUP = 14.0


def preload_value(platform: str, environ: Mapping[str, str], lib_exists: bool, lib: str = OPENBLAS_PATH) -> str | None:
    """The ``LD_PRELOAD`` value to re-execute with, or None to run as is.

    None on anything but Linux, when the user opted out, after one re-exec
    (guard set), when the library is missing, or when an OpenBLAS is already preloaded.
    """
    if not platform.startswith("linux"):
        return None
    if environ.get(OPT_OUT_VAR, "").strip().lower() not in _FALSE:
        return None
    if environ.get(GUARD_VAR):
        return None
    if not lib_exists:
        return None
    current = environ.get("LD_PRELOAD", "")
    entries = [e for e in current.replace(":", " ").split() if e]
    if any("libopenblas" in os.path.basename(e) for e in entries):
        return None
    return ":".join([lib, *entries])


def missing(platform: str | None = None, environ: Mapping[str, str] | None = None,
            lib_exists: bool | None = None) -> bool:
    """Whether this Linux run is left with MLX's own slow CPU matmuls because there is no OpenBLAS to preload
    (the library is not installed): then the command says what to install. False where the user opted out or
    an OpenBLAS is already preloaded. Defaults: this process's platform, environment and library."""
    platform, environ = platform or sys.platform, os.environ if environ is None else environ
    if not platform.startswith("linux") or environ.get(OPT_OUT_VAR, "").strip().lower() not in _FALSE:
        return False
    if any("libopenblas" in os.path.basename(e) for e in environ.get("LD_PRELOAD", "").replace(":", " ").split()):
        return False
    return not (os.path.isfile(environ.get(PATH_VAR) or OPENBLAS_PATH) if lib_exists is None else lib_exists)


def maybe_reexec() -> None:
    """Re-execute this Python process once with OpenBLAS preloaded when :func:`preload_value` says so."""
    lib = os.environ.get(PATH_VAR) or OPENBLAS_PATH
    value = preload_value(sys.platform, os.environ, os.path.isfile(lib), lib)
    argv = getattr(sys, "orig_argv", None)
    if value is None or not argv or not sys.executable:
        return
    env = dict(os.environ, LD_PRELOAD=value, **{GUARD_VAR: "1"})
    print(f"mlx_dq: preloading OpenBLAS ({lib}) for faster CPU matrix products; {OPT_OUT_VAR}=1 turns this off",
          file=sys.stderr, flush=True)
    try:
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError as e:  # could not re-execute: carry on without it
        print(f"mlx_dq: could not re-execute with OpenBLAS ({e}); continuing without it", file=sys.stderr)
