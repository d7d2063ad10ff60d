"""Guards that keep user data safe: atomic writes, output-folder checks, leftover cleanup, input checks.

Every writer of mlx-dq goes through these so that a bad argument or a killed
process never destroys a source, never overwrites a file that is not ours, and
never leaves a half-written file or folder that looks complete.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from mlx_dq.errors import InputError, OutputError
from mlx_dq.names import CARRIED_FILES, MANIFEST_NAME, MANIFEST_SCHEMA, MODEL_FILE

PARTIAL_MARKER = ".mlx_dq_partial"
_LEFTOVER = re.compile(r"^\.(.+)\.(partial|old)-(\d+)$")

# The rule every writing command follows, for its --help.
WRITE_RULE = ("Never replaces an input (a file the run reads, or any file in a source model folder) nor anything "
              "mlx-dq did not write: such a run stops before any work and names the files.")
# What mlx-dq itself writes into an output folder: only these may be replaced with it.
OUTPUT_FOLDER_FILES = (MANIFEST_NAME, "config.json", "plan.json", "measurement.json", "README.md", MODEL_FILE,
                       "model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json",
                       "__pycache__", *CARRIED_FILES)

_CLI = contextvars.ContextVar("mlx_dq_cli", default=False)


@contextlib.contextmanager
def cli_messages() -> Iterator[None]:
    """While active, messages name options as the command line spells them (``--force``), not as arguments."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def flag(name: str, value: bool = True) -> str:
    """How a user turns option ``name`` to ``value``: ``--force`` / ``--no-resume`` on the command line,
    ``force=True`` / ``resume=False`` from Python."""
    if _CLI.get():
        return f"--{name.replace('_', '-')}" if value else f"--no-{name.replace('_', '-')}"
    return f"{name}={value}"


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
        raise OutputError(f"{what} {p} is a folder, expected a file name")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {what} {p}: folder {parent} is not writable")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same file (resolving links; False when either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _refuse_dangling(path: Path, what: str) -> None:
    """OutputError for a symbolic link whose target is missing (writing through it fails only at the end)."""
    if path.is_symlink() and not path.exists():
        raise OutputError(f"{what} {path} is a symbolic link to {os.readlink(path)}, which does not exist: "
                          "give the real path or remove the link")


def _refuse_inputs(out: Path, what: str, inputs: Iterable[tuple[str, Any]], folder: bool) -> None:
    """OutputError when ``out`` is an input, lies inside one (a source folder), or (a folder) holds one."""
    real = out.resolve()
    for name, p in inputs:
        if p is None or str(p) == "":
            continue
        pr = Path(p).resolve()
        if folder and (_inside(real, pr) or _inside(pr, real)):
            raise OutputError(f"{what} {out} is, contains or lies inside the {name} {p}, an input of this run: "
                              "writing there would delete it; choose another output folder")
        if same_file(out, p):
            raise OutputError(f"{what} {out} is the input {name}: refusing to overwrite it")
        if _inside(real, pr):
            raise OutputError(f"{what} {out} lies inside the input {name} {p}, whose every file this run reads: "
                              "choose a path outside it")


def _is_model_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a model (config.json with weights beside it), whoever wrote it."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def output_folder_of(path: str | os.PathLike) -> Path | None:
    """The mlx-dq output folder (one with a manifest) that ``path`` lies inside, or None."""
    for parent in Path(path).resolve().parents:
        if is_mlx_dq_output(parent):
            return parent
    return None


def guard_output_file(
    path: str | os.PathLike, flag_name: str, *, inputs: Iterable[tuple[str, Any]] = (),
    others: Iterable[tuple[str, Any]] = (), kind: str = "", is_kind: Any = None,
) -> None:
    """Refuse an output file that would destroy something (OutputError saying why), before any work is done.

    ``inputs`` (``(what, path)``: files read and source folders) are never written, nor any file inside
    them; nor another output of the run (``others``: ``(flag, path)``), nor an existing file of an mlx-dq
    output folder. An existing file is replaced only when ``is_kind(path)`` says mlx-dq wrote it as ``kind``.
    """
    p = Path(path)
    _refuse_dangling(p, flag_name)
    inputs = list(inputs)
    _refuse_inputs(p, flag_name, inputs, folder=False)
    for other_flag, o in others:
        if o is not None and same_file(path, o):
            raise OutputError(f"{flag_name} and {other_flag} name the same file")
    check_writable_file(path, flag_name)
    if not p.exists():
        return
    owner = output_folder_of(p) or (p.parent if _is_model_folder(p.parent) else None)
    if owner is not None:
        raise OutputError(f"{flag_name} {p} is a file of the model folder {owner}: replacing it would change that "
                          "model; choose a path outside it")
    if is_kind is not None and not is_kind(path):
        raise OutputError(f"{p} exists and is not {kind}: mlx-dq replaces only a file it wrote of that kind; "
                          "move it away or choose another name")


def guard_output_names(folder: str | os.PathLike, names: Iterable[str], *, inputs: Iterable[tuple[str, Any]] = (),
                       is_ours: Any = None, kind: str = "") -> None:
    """Refuse writing the files ``names`` into ``folder`` (others there stay) where one would replace an input
    or an existing file that ``is_ours`` does not recognise as mlx-dq's ``kind``: OutputError naming them."""
    folder = Path(folder)
    _refuse_dangling(folder, "output")
    inputs = list(inputs)
    _refuse_inputs(folder, "output", inputs, folder=False)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"output {folder} exists and is not a folder")
    for name in names:
        _refuse_inputs(folder / name, "output", inputs, folder=False)
    theirs = [n for n in names if (folder / n).exists() and not (is_ours is not None and is_ours(folder / n))]
    if theirs:
        raise OutputError(f"{folder} holds {_listed(theirs)}, not {kind} mlx-dq wrote: writing would replace "
                          "them; move them away or choose another folder")


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


def foreign_files(folder: str | os.PathLike) -> list[str]:
    """Names in an earlier output ``folder`` that mlx-dq does not write there (a user's notes, logs, data)."""
    try:
        names = sorted(p.name for p in Path(folder).iterdir())
    except OSError:
        return []
    return [n for n in names if not any(fnmatch.fnmatch(n, pat) for pat in OUTPUT_FOLDER_FILES)]


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def guard_output_folder(out: str | os.PathLike, force: bool, protected: Iterable[tuple[str, Any]] = ()) -> None:
    """Refuse an output folder that would destroy something: OutputError saying why, before any work.

    ``protected`` lists ``(what, path)`` inputs (source model, measurement, plan, calibration text):
    the output may not be, contain or lie inside any of them. An existing non-empty folder is
    replaced only with ``force``, only when it is an earlier mlx-dq output (it has an mlx-dq
    manifest) and only when it holds nothing but what mlx-dq writes there; an existing folder must
    be writable (its mode is kept) and may not hold the current folder.
    """
    out = Path(out)
    _refuse_dangling(out, "output")
    _refuse_inputs(out, "output", protected, folder=True)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{out} exists and is not a folder; refusing to replace it")
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutputError(f"output folder {out} is read-only; refusing to replace it")
    if not any(out.iterdir()):
        return
    if not is_mlx_dq_output(out):
        raise OutputError(f"{out} is not an earlier mlx-dq output (no {MANIFEST_NAME}); mlx-dq replaces only its "
                          "own output folders: remove it yourself or choose another folder")
    foreign = foreign_files(out)
    if foreign:
        raise OutputError(f"{out} holds files mlx-dq did not write ({_listed(foreign)}): replacing the folder "
                          "would delete them; move them out or choose another folder")
    if _inside(Path.cwd().resolve(), out.resolve()):
        raise OutputError(f"output {out} is or holds the current folder: replacing it would leave this shell in "
                          "a deleted folder; run from outside it")
    if not force:
        raise OutputError(f"{out} already exists and is not empty; pass {flag('force')} to replace it")


@contextlib.contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[None]:
    """Hold ``.NAME.lock`` beside output ``out`` for a run: a second run into the same output stops, naming
    the first one's process, instead of silently replacing its result. A dead process's lock is taken over."""
    real = Path(os.path.realpath(out))
    real.parent.mkdir(parents=True, exist_ok=True)
    lock = real.parent / f".{real.name}.lock"
    for attempt in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if attempt or _pid_alive(pid):
                raise OutputError(f"another mlx-dq run (PID {pid}) is writing {out}: wait for it to finish or "
                                  f"choose another output (its lock: {lock})") from None
            lock.unlink(missing_ok=True)  # its process is gone: a killed run's lock
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


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
        elif m.group(2) == "old" and is_mlx_dq_output(p) and (parent / m.group(1)).exists() and not foreign_files(p):
            pass  # an earlier output already replaced; kept while the new one is missing (killed between renames)
        else:
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def make_partial_folder(out: Path) -> Path:
    """A fresh hidden sibling of ``out`` (of its target when a link) to build it in, marked so a later run can
    clean it if this one dies."""
    out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out.parent)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / PARTIAL_MARKER).write_text("an unfinished mlx-dq conversion; safe to delete when no convert runs\n")
    return tmp


def publish_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` into place as ``out`` (a link's target), keeping an existing folder's mode.

    Files mlx-dq did not write that appeared in the old folder during the run move into the new one;
    a folder that is not mlx-dq's output is never replaced.
    """
    out = Path(os.path.realpath(out))
    (tmp / PARTIAL_MARKER).unlink(missing_ok=True)
    if not out.exists():
        tmp.rename(out)
        return
    if any(out.iterdir()) and not is_mlx_dq_output(out):
        raise OutputError(f"{out} was created during the run and is not an mlx-dq output: refusing to replace it")
    os.chmod(tmp, out.stat().st_mode & 0o7777)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    tmp.rename(out)
    for name in foreign_files(old):
        if not (out / name).exists():
            (old / name).rename(out / name)
    if foreign_files(old):  # a name taken in the new folder too: keep the old folder rather than lose it
        raise OutputError(f"{out} is written, but {old} holds files mlx-dq did not write ({_listed(foreign_files(old))}): "
                          "move them back yourself")
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- numbers
def finite_number(value: Any, what: str, *, minimum: float | None = None, positive: bool = False) -> float:
    """``value`` as a float, ValueError naming ``what`` unless it is a finite real number in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)
    except OverflowError:
        raise InputError(f"{what} is out of range: {value!r}") from None
    if not math.isfinite(x):
        raise InputError(f"{what} must be finite, got {value!r}")
    if positive and x <= 0:
        raise InputError(f"{what} must be positive, got {value!r}")
    if minimum is not None and x < minimum:
        raise InputError(f"{what} must be >= {minimum:g}, got {value!r}")
    return x


def check_finite_weight(key: str, w: Any) -> None:
    """ValueError naming tensor ``key`` when its weights (an mx.array) hold NaN or infinite values: a corrupt model."""
    import mlx.core as mx

    flat = w.reshape(-1, w.shape[-1]) if w.ndim > 1 else w.reshape(1, -1)
    step = max(1, (1 << 24) // max(1, int(flat.shape[-1])))  # 16M weights at a time: no full-size temporaries
    bad = sum(int(mx.logical_not(mx.isfinite(flat[i:i + step])).sum().item()) for i in range(0, flat.shape[0], step))
    if bad:
        raise InputError(f"tensor {key!r} has {bad} NaN or infinite weight(s): the model file is corrupt")


def check_bpw(bpw: float) -> float:
    """A bits-per-weight target that could ever be met: finite and in (0, 16]."""
    if not isinstance(bpw, (int, float)) or isinstance(bpw, bool) or not math.isfinite(bpw) or not 0 < bpw <= 16:
        raise InputError(f"bits-per-weight target must be a number above 0 and at most 16, got {bpw!r}")
    return float(bpw)
