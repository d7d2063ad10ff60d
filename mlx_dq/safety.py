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

MANIFEST_NAME = "mlx_dq.json"
MANIFEST_SCHEMA = "mlx_dq.manifest"
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

    bad = int(mx.logical_not(mx.isfinite(w.astype(mx.float32))).sum().item())
    if bad:
        raise ValueError(f"tensor {key!r} has {bad} NaN or infinite weight(s): the model file is corrupt")


def check_bpw(bpw: float) -> float:
    """A bits-per-weight target that could ever be met: finite and in (0, 16]."""
    if not isinstance(bpw, (int, float)) or isinstance(bpw, bool) or not math.isfinite(bpw) or not 0 < bpw <= 16:
        raise ValueError(f"bits-per-weight target must be a number above 0 and at most 16, got {bpw!r}")
    return float(bpw)


# --------------------------------------------------------------------------- inputs that belong to a model
def model_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Module path -> weight shape of every quantizable tensor of the model ``config`` describes (no weights)."""
    from .capture import quantizable_modules
    from .sources import build_model

    return {p: tuple(int(d) for d in m.weight.shape) for p, m in quantizable_modules(build_model(config)).items()}


def _describe(model: dict | None) -> str:
    model = model or {}
    spec = model.get("spec") or "an unnamed model"
    kind = model.get("model_type")
    return f"{spec}" + (f" ({kind})" if kind else "")


def check_belongs_to(
    what: str, path: str, recorded: dict | None, shapes: dict[str, tuple[int, ...]] | dict[str, list[int]],
    source: Any, model_shapes_: dict[str, tuple[int, ...]], allow_other_model: bool,
) -> list[str]:
    """Check a measurement or plan (``what`` read from ``path``) was made for ``source``; returns notes to print.

    ``recorded`` is the model record it carries (spec, model_type, fingerprint);
    ``shapes`` its tensors' shapes. A different fingerprint is refused unless
    ``allow_other_model``; names or shapes the model lacks are always refused.
    Tensors of the model that the file does not cover are listed in the notes
    (they stay 16-bit).
    """
    notes: list[str] = []
    fp = (recorded or {}).get("fingerprint")
    if fp:
        mine = source.fingerprint()
        if fp != mine:
            msg = (f"the {what} {path} was made for another model: {_describe(recorded)}, not {source.spec} "
                   f"({source.config.get('model_type')})")
            if not allow_other_model:
                raise ValueError(msg + "; pass --allow-other-model to reuse it for a model of the same architecture")
            notes.append(msg + " (allowed by --allow-other-model)")
    else:
        notes.append(f"the {what} {path} carries no model fingerprint (another tool's file?): cannot check "
                     f"it was made for {source.spec}; only names and shapes are checked")
    unknown = sorted(k for k in shapes if k not in model_shapes_)
    if unknown:
        raise ValueError(f"the {what} {path} names tensors that {source.spec} does not have: {unknown[:3]}"
                         + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""))
    bad = [(k, tuple(s), model_shapes_[k]) for k, s in shapes.items() if tuple(s) != model_shapes_[k]]
    if bad:
        k, s, m = bad[0]
        raise ValueError(f"the {what} {path} does not match {source.spec}: tensor {k!r} has shape {list(s)} there "
                         f"but {list(m)} in the model" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return notes


def check_plan_input(plan: Any, given: Any, source: Any, allow_other_model: bool) -> list[str]:
    """Check a plan read for ``source`` belongs to it (see :func:`check_belongs_to`); returns notes."""
    where = str(given) if isinstance(given, (str, os.PathLike)) else "given"
    recorded = (plan.source or {}).get("model") if isinstance(plan.source, dict) else None
    return check_belongs_to("plan", where, recorded, {e.key: e.shape for e in plan.tensors}, source,
                            model_shapes(source.config), allow_other_model)


def check_measurement_input(m: Any, given: Any, source: Any, allow_incomplete: bool,
                            allow_other_model: bool) -> list[str]:
    """Check a measurement read for ``source``: complete (unless allowed) and made for it; returns notes."""
    from .measurement import measurement_complete

    where = str(given) if isinstance(given, (str, os.PathLike)) else "given"
    notes = []
    if not measurement_complete(m):
        if not allow_incomplete:
            raise ValueError(
                f"the measurement {where} is unfinished (measured up to layer {m.last_module_idx}; embedding "
                "and head not measured): resume it by running the same measure command again, or pass "
                "--allow-incomplete to leave the unmeasured tensors 16-bit"
            )
        notes.append(f"the measurement {where} is unfinished (allowed by --allow-incomplete)")
    notes += check_belongs_to("measurement", where, m.model, {k: t.shape for k, t in m.tensors.items()},
                              source, model_shapes(source.config), allow_other_model)
    return notes


# --------------------------------------------------------------------------- folder code
def verify_model_file(folder: str | os.PathLike) -> str:
    """Check that the only code a folder asks mlx-lm to import is mlx-dq's own shim; returns what was found.

    ValueError when config.json's ``model_file`` names anything but mlx-dq's model
    file, or when that file differs by one byte from the shim mlx-dq writes
    (``trust_remote_code`` would import it). A folder without ``model_file`` runs
    no folder code.
    """
    from .convert import MODEL_FILE, MODEL_FILE_TEXT

    folder = Path(folder)
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{folder} is not a model folder (no config.json)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path} is not a JSON object")
    if "model_file" not in config:
        return f"{folder}: config.json names no model_file: mlx-lm runs no code from this folder"
    name = config["model_file"]
    if name != MODEL_FILE:
        raise ValueError(f"{cfg_path}: model_file is {name!r}, not mlx-dq's {MODEL_FILE!r}: mlx-lm with "
                         "--trust-remote-code would import that file; do not trust this folder")
    path = folder / MODEL_FILE
    if path.is_symlink() or not path.is_file():
        raise ValueError(f"{path} is missing or not a plain file")
    if path.read_bytes() != MODEL_FILE_TEXT.encode("utf-8"):
        raise ValueError(f"{path} differs from the model file mlx-dq writes: it was altered; do not trust this "
                         "folder with --trust-remote-code (mlx_dq.load and mlx_dq generate never run it)")
    return f"{folder}: {MODEL_FILE} is byte-identical to mlx-dq's shim and config.json names exactly it"
