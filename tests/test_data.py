"""Bad local data files: empty, with lines that are not JSON objects, with bytes that are not UTF-8.
Each gives one warning (or, when nothing is left, a ValueError) that names the file and the lines."""
import json
import os
import sys
import warnings
from types import SimpleNamespace

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tasks import load_gsm8k, load_math, load_mbpp, load_problems  # noqa: E402

GOOD = [{"question": "1+1?", "answer": "so 2\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}]


def write(path, lines):
    """lines: dicts (dumped as JSON), str (written as is) or bytes; one per line."""
    with open(path, "wb") as f:
        for x in lines:
            x = json.dumps(x) if isinstance(x, dict) else x
            f.write((x if isinstance(x, bytes) else x.encode()) + b"\n")
    return str(path)


@pytest.mark.parametrize("loader", [load_gsm8k, load_math, load_mbpp])
@pytest.mark.parametrize("name, content", [("d.jsonl", b""), ("d.json", b""), ("d.parquet", b""),
                                           ("d.jsonl", b"\n  \n"), ("d.json", b"[]"), ("d.json", b"  \n")])
def test_an_empty_file_is_a_clear_error(tmp_path, loader, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match="empty") as err:
        loader(str(path))
    assert str(path) in str(err.value)


def test_lines_that_are_not_json_objects_are_skipped_and_counted(tmp_path):
    path = write(tmp_path / "g.jsonl", [GOOD[0], '{"question": "3+3?", "answer": "#### 6"', "[1, 2]", "",
                                        '"a string"', GOOD[1], "{not json}", {"question": "no answer"}])
    with pytest.warns(UserWarning) as rec:
        probs = load_gsm8k(path)
    assert [p.answer for p in probs] == ["2", "4"]
    assert [str(w.message) for w in rec] == [
        f"gsm8k ({path}): skipped 5 of 7 malformed rows: invalid JSON: 2 (lines 2, 7), "
        f"not a JSON object: 2 (lines 3, 5), missing 'answer': 1"]


def test_a_file_of_bad_lines_is_a_value_error_naming_it(tmp_path):
    path = write(tmp_path / "bad.jsonl", ["{oops", "42", b"\xff\xfe"])
    with pytest.raises(ValueError) as err:
        load_gsm8k(path)
    assert str(err.value) == (f"gsm8k ({path}): skipped 3 of 3 malformed rows: invalid JSON: 1 (line 1), "
                              f"not a JSON object: 1 (line 2), not UTF-8: 1 (line 3)")


def test_a_row_that_is_not_utf8_is_named_with_its_file(tmp_path):
    bad = '{"question": "caf\xe9?", "answer": "#### 1"}'.encode("latin-1")
    path = write(tmp_path / "latin.jsonl", [GOOD[0], bad, GOOD[1]])
    with pytest.warns(UserWarning) as rec:
        probs = load_gsm8k(path)
    assert len(probs) == 2 and len(rec) == 1
    assert str(rec[0].message) == f"gsm8k ({path}): skipped 1 of 3 malformed rows: not UTF-8: 1 (line 2)"


def test_json_files_hold_an_array_or_json_lines(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([GOOD[0], "not a row", GOOD[1]], indent=2))
    with pytest.warns(UserWarning, match=r"not a JSON object: 1 \(item 2\)"):
        assert [p.answer for p in load_gsm8k(str(arr))] == ["2", "4"]
    lines = write(tmp_path / "l.json", GOOD)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(GOOD[0], indent=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [p.answer for p in load_gsm8k(lines)] == ["2", "4"]
        assert [p.answer for p in load_gsm8k(str(one))] == ["2"]


def test_a_bom_and_blank_lines_are_fine_and_limit_stops_reading(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\r\n\r\n" + json.dumps(GOOD[1]).encode()
                     + b"\n{broken\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken line is past the limit: never read, no warning
        assert [p.answer for p in load_gsm8k(str(path), limit=2)] == ["2", "4"]
    with pytest.warns(UserWarning, match=r"invalid JSON: 1 \(line 4\)"):
        load_gsm8k(str(path))


def test_load_problems_holds_out_the_last_rows_of_a_local_file(tmp_path):
    path = write(tmp_path / "g.jsonl", GOOD + [b"\x80"])
    cfg = SimpleNamespace(task="gsm8k", data=path, n_train=0, n_eval=1)
    with pytest.warns(UserWarning, match="not UTF-8"):
        train, held_out = load_problems(cfg)
    assert [p.answer for p in train] == ["2"] and [p.answer for p in held_out] == ["4"]
