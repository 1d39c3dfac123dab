"""The one lenient JSONL reader (data_pipelines.jsonl), used by sources, the R report and the eval tasks."""

import pytest

from data_pipelines.jsonl import read_json_lines

LINES = ['{"a": 1}\n', "\n", "   \n", '{"a": 2', "[1, 2]\n", '"text"', '{"a": 3}']


@pytest.mark.parametrize("as_bytes", [False, True])
def test_objects_kept_blank_lines_passed_over_bad_lines_reported_once_each(as_bytes):
    bad = []
    lines = [line.encode() for line in LINES] if as_bytes else LINES
    got = list(read_json_lines(lines, lambda lineno, why: bad.append((lineno, why))))
    assert got == [(1, {"a": 1}), (7, {"a": 3})]
    assert [lineno for lineno, _ in bad] == [4, 5, 6]
    assert bad[0][1] == "Expecting ',' delimiter at column 8"
    assert bad[1][1] == "a JSON list, not an object" and bad[2][1] == "a JSON str, not an object"


def test_any_value_when_not_objects_only_and_bad_utf8_is_a_bad_line():
    bad = []
    lines = [b'{"a": 1}', b"[1, 2]", b'{"a": "\xff"}', None, b"7"]
    got = list(read_json_lines(lines, lambda lineno, why: bad.append((lineno, why)), objects_only=False))
    assert got == [(1, {"a": 1}), (2, [1, 2]), (5, 7)]
    assert len(bad) == 1 and bad[0][0] == 3 and bad[0][1].startswith("not UTF-8")
