"""Calibration/evaluation text loading, row sampling and the calib/eval disjointness guarantee."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from script_loader import load_script

from mlx_dq.data import calib


class WordTokenizer:
    """Each whitespace-separated word is an integer token id: rows reveal exactly where they came from."""

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split()]


def numbered_text(n: int) -> str:
    return " ".join(str(i) for i in range(n))


# -- load_texts ------------------------------------------------------------------


def test_load_txt(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first line\nsecond line\n", encoding="utf-8")
    assert calib.load_texts(f) == ["first line\nsecond line\n"]


def test_load_jsonl_text_and_content_fields(tmp_path):
    f = tmp_path / "a.jsonl"
    lines = [json.dumps({"text": "alpha"}), "", json.dumps({"content": "béta", "id": 3}), json.dumps("gamma")]
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert calib.load_texts(f) == ["alpha", "béta", "gamma"]


@pytest.mark.parametrize(
    "line, expected",
    [("{not json", "a.jsonl:2: not valid JSON"), ('{"body": "x"}', 'a.jsonl:2: expected an object with a "text"')],
)
def test_load_jsonl_bad_line_names_file_and_line(tmp_path, line, expected):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=expected):
        calib.load_texts(f)


def test_load_folder_recursive_sorted_and_filtered(tmp_path):
    (tmp_path / "b.txt").write_text("bee", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "ay"}) + "\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("sea", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    assert calib.load_texts(tmp_path) == ["ay", "bee", "sea"]


@pytest.mark.parametrize("content", ["", "   \n\n"])
def test_empty_file_is_an_error_naming_it(tmp_path, content):
    f = tmp_path / "empty.txt"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt"):
        calib.load_texts(f)


def test_empty_folder_is_an_error_naming_it(tmp_path):
    d = tmp_path / "nothing_here"
    d.mkdir()
    (d / "readme.md").write_text("not a text source", encoding="utf-8")
    with pytest.raises(ValueError, match="nothing_here"):
        calib.load_texts(d)


def test_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="does not exist: .*missing.txt"):
        calib.load_texts(tmp_path / "missing.txt")


def test_unsupported_suffix(tmp_path):
    f = tmp_path / "data.csv"
    f.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="data.csv"):
        calib.load_texts(f)


# -- sample_rows -------------------------------------------------------------------


def test_rows_are_disjoint_windows_of_the_stream():
    rows = np.array(calib.sample_rows(WordTokenizer(), [numbered_text(1000)], n_rows=6, seq_len=50, seed=3))
    assert rows.shape == (6, 50) and rows.dtype == np.int32
    # every row is a contiguous window of the token stream ...
    assert (np.diff(rows, axis=1) == 1).all()
    assert rows.min() >= 0 and rows.max() < 1000
    # ... and no two rows share a token
    starts = np.sort(rows[:, 0])
    assert (np.diff(starts) >= 50).all()


def test_rows_from_several_texts_form_one_stream():
    texts = [numbered_text(30), " ".join(str(i) for i in range(30, 60))]
    rows = np.array(calib.sample_rows(WordTokenizer(), texts, n_rows=1, seq_len=60, seed=0))
    assert rows.tolist() == [list(range(60))]


def test_same_seed_same_rows_other_seed_other_rows():
    texts = [numbered_text(5000)]
    a = np.array(calib.sample_rows(WordTokenizer(), texts, 8, 64, seed=11))
    b = np.array(calib.sample_rows(WordTokenizer(), texts, 8, 64, seed=11))
    c = np.array(calib.sample_rows(WordTokenizer(), texts, 8, 64, seed=12))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_more_rows_than_the_text_holds_overlap_but_stay_inside():
    rows = np.array(calib.sample_rows(WordTokenizer(), [numbered_text(100)], n_rows=20, seq_len=40, seed=1))
    assert rows.shape == (20, 40)
    assert (np.diff(rows, axis=1) == 1).all()
    assert rows.max() < 100
    assert len({int(r) for r in rows[:, 0]}) > 1


def test_sampling_with_a_real_tokenizer_is_deterministic():
    from fixtures_models import tiny_tokenizer

    tok = tiny_tokenizer()
    texts = calib.default_calibration_texts()
    a = np.array(calib.sample_rows(tok, texts, 4, 128, seed=5))
    b = np.array(calib.sample_rows(tok, texts, 4, 128, seed=5))
    assert np.array_equal(a, b)
    assert a.max() < tok.vocab_size


@pytest.mark.parametrize("n_rows, seq_len, match", [(0, 16, "n_rows"), (2, 1, "seq_len"), (1, 500, "fewer than one row")])
def test_bad_sizes(n_rows, seq_len, match):
    with pytest.raises(ValueError, match=match):
        calib.sample_rows(WordTokenizer(), [numbered_text(100)], n_rows, seq_len, seed=0)


# -- default texts ----------------------------------------------------------------


def test_default_calibration_is_a_large_mixed_set():
    texts = calib.default_calibration_texts()
    joined = "\n".join(texts)
    assert len(joined.encode("utf-8")) > 60_000
    for marker in ("def ", "fn ", "SELECT", "#include", "<|im_start|>user", "f'(x)", "| Day |", "Français", "中文"):
        assert marker in joined, marker


def test_default_eval_text_is_substantial():
    texts = calib.default_eval_texts()
    assert sum(len(t) for t in texts) > 100_000


def _windows(text: str, k: int) -> set[str]:
    return {text[i : i + k] for i in range(len(text) - k + 1)}


def test_calibration_and_eval_texts_share_no_32_character_window():
    cal = _windows("\n".join(calib.default_calibration_texts()), 32)
    ev = _windows("\n".join(calib.default_eval_texts()), 32)
    assert cal and ev
    assert not cal & ev


def test_window_check_detects_overlap():
    """The disjointness check above is able to fail: a shared passage is found."""
    ev = "\n".join(calib.default_eval_texts())
    leaked = "\n".join(calib.default_calibration_texts()) + ev[5000:5100]
    assert _windows(leaked, 32) & _windows(ev, 32)


@pytest.mark.slow
def test_default_calibration_and_eval_rows_share_no_32_token_window():
    from mlx_dq.model.sources import resolve

    tok = resolve("smollm2-135m").tokenizer()
    cal = np.array(calib.sample_rows(tok, calib.default_calibration_texts(), 128, 512, seed=0))
    ev = np.array(calib.sample_rows(tok, calib.default_eval_texts(), 64, 512, seed=0))

    def windows(rows: np.ndarray, k: int = 32) -> set[bytes]:
        return {r[i : i + k].tobytes() for r in rows for i in range(len(r) - k + 1)}

    assert not windows(cal) & windows(ev)


def test_text_digest_tells_texts_apart():
    assert calib.text_digest(["a", "b"]) == calib.text_digest(["a", "b"])
    assert calib.text_digest(["a", "b"]) != calib.text_digest(["b", "a"])
    assert calib.text_digest(["ab"]) != calib.text_digest(["a", "b"])


def test_generated_calibration_file_matches_its_composer():
    data = Path(calib.__file__).parent
    module = load_script(data / "compose_calibration.py", "compose_calibration")
    assert module.compose() == (data / "calib_generated.txt").read_text(encoding="utf-8")


# -- named evaluation texts --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(calib.EVAL_TEXTS))
def test_named_eval_text_is_substantial(name):
    texts = calib.eval_texts(name)
    assert all(isinstance(t, str) and t.strip() for t in texts)
    assert sum(len(t) for t in texts) > 100_000


def test_named_eval_texts_are_different_kinds():
    joined = {n: "\n".join(calib.eval_texts(n)) for n in calib.EVAL_TEXTS}
    assert "First Citizen:" in joined["shakespeare"]
    assert "\nB: " in joined["dialog"]
    assert "The \"for\" statement" in joined["pydoc"]
    digests = {calib.text_digest(calib.eval_texts(n)) for n in calib.EVAL_TEXTS}
    assert len(digests) == len(calib.EVAL_TEXTS)


@pytest.mark.parametrize("name", sorted(calib.EVAL_TEXTS))
def test_calibration_and_named_eval_text_share_no_32_character_window(name):
    cal = _windows("\n".join(calib.default_calibration_texts()), 32)
    ev = set().union(*(_windows(t, 32) for t in calib.eval_texts(name)))
    assert cal and ev
    assert not cal & ev


def test_overlapping_documents_are_dropped():
    """A document quoting the calibration text is left out; the others stay, in order."""
    cal = "\n".join(calib.default_calibration_texts())
    clean = ["A: hello there, how was the harbour this morning?", "B: grey and still, the boats stayed in."]
    leaked = "A: look at this: " + cal[2000:2100]
    assert calib.drop_calibration_overlap([clean[0], leaked, clean[1]]) == clean


def test_resolve_eval_texts_names_files_and_errors(tmp_path):
    texts, label = calib.resolve_eval_texts(None)
    assert texts == calib.default_eval_texts() and "pydoc" in label
    texts, label = calib.resolve_eval_texts("dialog")
    assert texts == calib.eval_texts("dialog") and "chatterbot" in label
    f = tmp_path / "mine.txt"
    f.write_text("some words of my own", encoding="utf-8")
    assert calib.resolve_eval_texts(str(f)) == (["some words of my own"], str(f))
    with pytest.raises(ValueError, match="unknown evaluation text 'poetry'.*pydoc, shakespeare, dialog"):
        calib.resolve_eval_texts("poetry")
    with pytest.raises(ValueError, match="does not exist"):
        calib.resolve_eval_texts(str(tmp_path / "gone.txt"))


class BosWordTokenizer(WordTokenizer):
    """Like WordTokenizer, but puts token 999 first when asked for special tokens (as Gemma's does)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [int(w) if w.isdigit() else 7 for w in text.split()]
        return ([999] if add_special_tokens else []) + ids


def test_rows_start_with_the_start_token_when_the_tokenizer_adds_one():
    assert calib.bos_token(WordTokenizer()) is None
    assert calib.bos_token(BosWordTokenizer()) == 999
    rows = np.array(calib.sample_rows(BosWordTokenizer(), [numbered_text(1000)], 6, 16, seed=3))
    plain = np.array(calib.sample_rows(WordTokenizer(), [numbered_text(1000)], 6, 15, seed=3))
    assert rows.shape == (6, 16)
    assert (rows[:, 0] == 999).all() and 999 not in rows[:, 1:]
    np.testing.assert_array_equal(rows[:, 1:], plain)  # the same text windows, one shorter
    assert (np.diff(rows[:, 1:], axis=1) == 1).all()


# -- sample_rows_balanced ------------------------------------------------------------


def _source_of(rows: np.ndarray, bounds: list[int]) -> list[int]:
    """Which text each row of numbered texts came from (text k holds the numbers bounds[k]..bounds[k+1]-1)."""
    return [int(np.searchsorted(bounds, r[0], side="right")) - 1 for r in rows]


def test_balanced_rows_share_the_texts_evenly_and_interleave():
    # text 0 is long, texts 1 and 2 short: a plain stream sample would take nearly every row from text 0
    bounds = [0, 5000, 5200, 5400]
    texts = [" ".join(str(i) for i in range(a, b)) for a, b in zip(bounds, bounds[1:])]
    rows = np.array(calib.sample_rows_balanced(WordTokenizer(), texts, n_rows=9, seq_len=40, seed=2))
    assert rows.shape == (9, 40) and rows.dtype == np.int32
    assert (np.diff(rows, axis=1) == 1).all()  # each row one window of one text: never across two
    src = _source_of(rows, bounds)
    assert src[:3] == [0, 1, 2]  # every leading slice spans the texts
    assert [src.count(k) for k in range(3)] == [3, 3, 3]
    for k in range(3):  # disjoint windows inside each text
        starts = np.sort(rows[[i for i, s in enumerate(src) if s == k], 0])
        assert (np.diff(starts) >= 40).all()
        assert starts.min() >= bounds[k] and starts.max() + 40 <= bounds[k + 1]


def test_balanced_rows_give_a_short_texts_share_to_the_others():
    bounds = [0, 5000, 5080, 5400]  # text 1 holds two disjoint 40-token windows only
    texts = [" ".join(str(i) for i in range(a, b)) for a, b in zip(bounds, bounds[1:])]
    rows = np.array(calib.sample_rows_balanced(WordTokenizer(), texts, n_rows=12, seq_len=40, seed=0))
    src = _source_of(rows, bounds)
    assert [src.count(k) for k in range(3)] == [5, 2, 5]
    starts = np.sort(rows[[i for i, s in enumerate(src) if s == 1], 0])
    assert starts.tolist() == [5000, 5040]


def test_balanced_rows_overlap_only_when_every_text_is_used_up():
    texts = [numbered_text(100), " ".join(str(i) for i in range(100, 200))]
    rows = np.array(calib.sample_rows_balanced(WordTokenizer(), texts, n_rows=8, seq_len=40, seed=1))
    src = _source_of(rows, [0, 100, 200])
    assert [src.count(k) for k in range(2)] == [4, 4]
    assert (np.diff(rows, axis=1) == 1).all()


def test_balanced_rows_are_deterministic_and_start_with_the_start_token():
    texts = [numbered_text(3000), " ".join(str(i) for i in range(3000, 3500))]
    a = np.array(calib.sample_rows_balanced(BosWordTokenizer(), texts, 6, 33, seed=4))
    b = np.array(calib.sample_rows_balanced(BosWordTokenizer(), texts, 6, 33, seed=4))
    c = np.array(calib.sample_rows_balanced(BosWordTokenizer(), texts, 6, 33, seed=5))
    plain = np.array(calib.sample_rows_balanced(WordTokenizer(), texts, 6, 32, seed=4))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert (a[:, 0] == 999).all()
    np.testing.assert_array_equal(a[:, 1:], plain)


def test_balanced_rows_skip_texts_shorter_than_a_row_and_refuse_when_none_is_long_enough():
    texts = [numbered_text(10), " ".join(str(i) for i in range(10, 500))]
    rows = np.array(calib.sample_rows_balanced(WordTokenizer(), texts, 3, 40, seed=0))
    assert rows.min() >= 10
    with pytest.raises(ValueError, match="no text has 600 tokens"):
        calib.sample_rows_balanced(WordTokenizer(), texts, 3, 600, seed=0)


def _row_origins(tok, texts: list[str], rows) -> list[int]:
    """The index of the one text each row is a window of (a row found in two texts fails)."""
    streams = [calib.tokenize_texts(tok, [t]) for t in texts]

    def origin(row: np.ndarray) -> int:
        hits = [k for k, s in enumerate(streams)
                if any(np.array_equal(s[i : i + len(row)], row) for i in np.flatnonzero(s == row[0]))]
        assert len(hits) == 1
        return hits[0]

    return [origin(np.asarray(r)) for r in np.asarray(rows)]


def test_default_calibration_rows_span_every_bundled_file():
    from fixtures_models import tiny_tokenizer

    tok = tiny_tokenizer()
    texts, rows = calib.calibration_rows(tok, None, 10, 64, 0)
    src = _row_origins(tok, texts, rows)
    assert sorted(src[: len(texts)]) == list(range(len(texts)))  # the leading rows: one of each file
    assert [src.count(k) for k in range(len(texts))] == [2] * len(texts)


def test_importance_rows_hold_one_row_of_each_bundled_file():
    """The measurement prices importance on its leading rows; the default count is one row per bundled file."""
    from mlx_dq.settings import MeasureSettings

    assert MeasureSettings.importance_rows == len(calib.default_calibration_texts())


# -- several calibration sources (--calib bundled --calib mine.txt) ---------------------------------------


def test_calib_sources_name_the_bundled_set_and_refuse_a_repeat(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert calib.calib_sources(None) == calib.calib_sources("") == calib.calib_sources(()) == (None,)
    assert calib.calib_sources("bundled") == (None,)
    assert calib.calib_sources(("bundled", "mine.txt")) == (None, "mine.txt")
    assert calib.calib_label(None) == "default" and calib.calib_label(("bundled",)) == "default"
    assert calib.calib_label(("mine.txt", "bundled")) == "mine.txt + bundled"
    assert calib.calib_inputs(("bundled", "a.txt", "b")) == [("calibration text", "a.txt"), ("calibration text", "b")]
    with pytest.raises(ValueError, match="calibration source given twice: mine.txt"):
        calib.calib_sources(("mine.txt", "bundled", "mine.txt"))
    with pytest.raises(ValueError, match="calibration source given twice: bundled"):
        calib.calib_sources(("bundled", None))
    (tmp_path / "bundled").mkdir()  # a path that exists wins over the name, as for evaluation texts
    assert calib.calib_sources("bundled") == ("bundled",)


def test_check_calib_reads_every_user_source(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("some text", encoding="utf-8")
    calib.check_calib(("bundled", good))
    with pytest.raises(ValueError, match="does not exist: .*missing.txt"):
        calib.check_calib(("bundled", good, tmp_path / "missing.txt"))


def test_mixed_rows_share_the_sources_evenly_and_interleave():
    # mine.txt: two documents read as one stream; a short source's share goes to the others
    sources = [("a", [numbered_text(400)]), ("mine.txt", [" ".join(str(i) for i in range(1000, 1100)),
                                                        " ".join(str(i) for i in range(1100, 9000))]),
               ("short", [" ".join(str(i) for i in range(9000, 9080))])]
    rows = np.array(calib.sample_rows_mixed(WordTokenizer(), sources, n_rows=10, seq_len=40, seed=3))
    assert rows.shape == (10, 40)
    src = _source_of(rows, [0, 400, 1000, 9000, 9080])
    assert src[:3] == [0, 2, 3]  # every leading slice spans the sources
    assert [src.count(k) for k in range(4)] == [4, 0, 4, 2]  # "short" holds two disjoint windows only
    assert (np.diff(rows, axis=1) == 1).all()  # a window of one source, never across two
    again = np.array(calib.sample_rows_mixed(WordTokenizer(), sources, n_rows=10, seq_len=40, seed=3))
    other = np.array(calib.sample_rows_mixed(WordTokenizer(), sources, n_rows=10, seq_len=40, seed=4))
    assert np.array_equal(rows, again) and not np.array_equal(rows, other)


def test_mixed_rows_refuse_too_few_rows_and_a_source_shorter_than_a_row():
    sources = [("a", [numbered_text(500)]), ("short.txt", [numbered_text(10)])]
    with pytest.raises(ValueError, match="2 calibration texts .each bundled file counts as one. need at least 2 rows, got 1"):
        calib.sample_rows_mixed(WordTokenizer(), sources, n_rows=1, seq_len=40)
    with pytest.raises(ValueError, match="calibration text short.txt has 10 tokens, fewer than one row"):
        calib.sample_rows_mixed(WordTokenizer(), sources, n_rows=4, seq_len=40)
    # a bundled file (no name) too short for a row is left out, as the bundled draw leaves it out
    rows = np.array(calib.sample_rows_mixed(WordTokenizer(), [(None, [numbered_text(10)]), *sources[:1]], 4, 40))
    assert rows.min() >= 10


def test_calibration_rows_beside_the_bundled_set_give_the_users_text_one_kinds_share(tmp_path):
    from fixtures_models import tiny_tokenizer

    tok = tiny_tokenizer()
    mine = tmp_path / "mine.txt"
    mine.write_text(" ".join(f"zq{i} xv{i}" for i in range(3000)), encoding="utf-8")
    texts, rows = calib.calibration_rows(tok, ("bundled", str(mine)), 12, 64, 0)
    bundled = calib.default_calibration_texts()
    assert texts == [*bundled, mine.read_text(encoding="utf-8")]
    src = _row_origins(tok, texts, rows)
    n = len(texts)  # the bundled files and the user's text, one kind each, in the order given
    assert src[:n] == list(range(n)) and [src.count(k) for k in range(n)] == [2] * n
    with pytest.raises(ValueError, match=f"{n} calibration texts .each bundled file counts as one. need at least {n} rows"):
        calib.calibration_rows(tok, ("bundled", str(mine)), n - 1, 64, 0)
    # one source alone draws as it always did: the bundled set balanced, a user's text as one stream
    np.testing.assert_array_equal(np.asarray(calib.calibration_rows(tok, ("bundled",), 10, 64, 0)[1]),
                                  np.asarray(calib.calibration_rows(tok, None, 10, 64, 0)[1]))
    np.testing.assert_array_equal(np.asarray(calib.calibration_rows(tok, (str(mine),), 10, 64, 0)[1]),
                                  np.asarray(calib.sample_rows(tok, [texts[-1]], 10, 64, 0)))
