"""Guards that keep user data safe: atomic writes, output-folder checks, leftover cleanup, input checks.

Every writer of mlx-dq goes through these so that a bad argument or a killed
process never destroys a source, never overwrites a file that is not ours, and
never leaves a half-written file or folder that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from .names import MANIFEST_NAME, MANIFEST_SCHEMA

PARTIAL_MARKER = ".mlx_dq_partial"
_LEFTOVER = re.compile(r"^\.(.+)\.(partial|old)-(\d+)$")


# --------------------------------------------------------------------------- atomic files
def _umask_mode(mode: int = 0o666) -> int:
    """``mode`` with the process umask applied (what ``open()`` would give a new file)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def write_text_atomic(text: str | Any, path: str | os.PathLike) -> None:
    """Write ``text`` (or call ``text(f)`` to write) so a reader never sees a half-written file.

    The file gets the mode any new file gets (0644 under umask 022), not mkstemp's 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if callable(text):
                text(f)
            else:
                f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(doc: Any, path: str | os.PathLike) -> None:
    """Write JSON atomically (no NaN/Infinity: they are not JSON)."""
    def dump(f: Any) -> None:
        json.dump(doc, f, indent=1, allow_nan=False)
        f.write("\n")

    write_text_atomic(dump, path)


def check_writable_file(path: str | os.PathLike, what: str = "output") -> None:
    """ValueError unless ``path`` can be created or replaced (its nearest existing folder is writable)."""
    p = Path(path)
    if p.exists() and p.is_dir():
        raise ValueError(f"{what} {p} is a folder, expected a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {what} {p}: folder {parent} is not writable")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file (resolving links; False when either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def guard_output_file(
    path: str | os.PathLike, flag: str, *, inputs: Iterable[tuple[str, Any]] = (),
    others: Iterable[tuple[str, Any]] = (), force: bool = False, kind: str = "", is_kind: Any = None,
) -> None:
    """Refuse an output file that would destroy something (ValueError saying why), before any work is done.

    Never an input of the same command (``inputs``: ``(what, path)``) nor another output of it
    (``others``: ``(flag, path)``); an existing file replaced only when ``is_kind(path)`` says it is
    ``kind`` (what the command writes) or with ``force``; its folder must be writable.
    """
    for what, p in inputs:
        if p is not None and same_file(path, p):
            raise ValueError(f"{flag} {path} is the input {what}: refusing to overwrite it")
    for other_flag, p in others:
        if p is not None and same_file(path, p):
            raise ValueError(f"{flag} and {other_flag} name the same file")
    check_writable_file(path, flag)
    if Path(path).exists() and not force and is_kind is not None and not is_kind(path):
        raise ValueError(f"{path} exists and is not {kind}: refusing to overwrite it (pass --force)")


def csv_with_header(first: str) -> Any:
    """A check that a file is a CSV whose first header field is ``first`` (one mlx-dq wrote)."""
    def check(path: str | os.PathLike) -> bool:
        try:
            with open(path, encoding="utf-8") as fh:
                return fh.readline().split(",")[0].strip() == first
        except (OSError, ValueError):
            return False

    return check


# --------------------------------------------------------------------------- output folders
def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it (both resolved)."""
    return a == b or b in a.parents


def is_mlx_dq_output(folder: Path) -> bool:
    """Whether ``folder`` holds an mlx-dq manifest (so replacing it deletes only an earlier mlx-dq output)."""
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA


def guard_output_folder(out: str | os.PathLike, force: bool, protected: Iterable[tuple[str, str | os.PathLike]] = ()) -> None:
    """Refuse an output folder that would destroy something: ValueError / FileExistsError saying why.

    ``protected`` lists ``(what, path)`` inputs (source model, measurement, plan):
    the output may not be, contain or lie inside any of them. An existing
    non-empty folder is replaced only with ``force`` and only when it is an
    earlier mlx-dq output (it has an mlx-dq manifest); an existing folder must be
    writable (its mode is kept).
    """
    out = Path(out)
    real = out.resolve()
    for what, p in protected:
        if p is None:
            continue
        pr = Path(p).resolve()
        if _inside(real, pr) or _inside(pr, real):
            raise ValueError(
                f"output {out} is, contains or lies inside the {what} {p}: writing there would delete it; "
                "choose another output folder"
            )
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder; refusing to replace it")
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {out} is read-only; refusing to replace it")
    if any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} already exists and is not empty; pass force=True (--force) to replace it")
        if not is_mlx_dq_output(out):
            raise FileExistsError(
                f"{out} is not an earlier mlx-dq output (no {MANIFEST_NAME}); --force replaces only mlx-dq "
                "outputs: remove it yourself or choose another folder"
            )


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(parent: str | os.PathLike) -> list[Path]:
    """Remove ``.NAME.partial-PID`` / ``.NAME.old-PID`` folders in ``parent`` left by killed conversions.

    Only folders whose process is gone are removed: partial ones carrying
    mlx-dq's marker, and replaced earlier outputs (with their manifest) once the
    new output is in place; returns what was removed.
    """
    parent = Path(parent)
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or not p.is_dir() or p.is_symlink() or _pid_alive(int(m.group(3))):
            continue
        if m.group(2) == "partial" and (p / PARTIAL_MARKER).exists():
            pass
        elif m.group(2) == "old" and is_mlx_dq_output(p) and (parent / m.group(1)).exists():
            pass  # an earlier output already replaced; kept while the new one is missing (killed between renames)
        else:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def make_partial_folder(out: Path) -> Path:
    """A fresh hidden sibling of ``out`` to build it in, marked so a later run can clean it if this one dies."""
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out.parent)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / PARTIAL_MARKER).write_text("an unfinished mlx-dq conversion; safe to delete when no convert runs\n")
    return tmp


def publish_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` into place as ``out``, keeping an existing folder's mode."""
    (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
    if out.exists():
        os.chmod(tmp, out.stat().st_mode & 0o7777)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


# --------------------------------------------------------------------------- numbers
def finite_number(value: Any, what: str, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite real number in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        raise ValueError(f"{what} is out of range: {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if positive and x <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{what} must be >= {minimum:g}, got {value!r}")
    return x


def check_finite_weight(key: str, w: Any) -> None:
    """ValueError naming tensor ``key`` when its weights (an mx.array) hold NaN or infinite values: a corrupt model."""
    import mlx.core as mx

    flat = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(1, -1)
    step = max(1, (1 << 24) // max(1, int(flat.shape[-1])))  # 16M weights at a time: no full-size temporaries
    bad = sum(int(mx.logical_not(mx.isfinite(flat[i:i + step])).sum().item()) for i in range(0, flat.shape[0], step))
    if bad:
        raise ValueError(f"tensor {key!r} has {bad} NaN or infinite weight(s): the model file is corrupt")


def check_bpw(bpw: float) -> float:
    """A bits-per-weight target that could ever be met: finite and in (0, 16]."""
    if not isinstance(bpw, (int, float)) or isinstance(bpw, bool) or not math.isfinite(bpw) or not 0 < bpw <= 16:
        raise ValueError(f"bits-per-weight target must be a number above 0 and at most 16, got {bpw!r}")
    return float(bpw)
