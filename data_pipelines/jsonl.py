"""Lenient JSONL reading, the one line-by-line JSON reader of the toolkit (source documents, ``data_pipelines.sources``;
the R report's logs, ``eval.r_report_io``; the eval tasks' docs, ``eval.tasks.common``): one JSON value per line,
blank lines passed over, a bad line skipped and handed to the caller to count and log — never a crash."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator


def bad_json_reason(err: ValueError) -> str:
    """One line saying why a line is not JSON: ``Expecting ',' delimiter at column 31``, ``not UTF-8 (...)``."""
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at column {err.colno}"
    if isinstance(err, UnicodeDecodeError):
        return f"not UTF-8 ({err.reason} at byte {err.start})"
    return str(err).splitlines()[0] if str(err).strip() else type(err).__name__


def read_json_lines(
    lines: Iterable[str | bytes | None], on_bad: Callable[[int, str], None], objects_only: bool = True
) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` for every line of ``lines`` (numbered from 1; ``str`` or UTF-8 ``bytes``, e.g. an
    open file) that holds one JSON value, an object unless ``objects_only`` is False. Empty and blank lines are
    passed over; for any other line that is not valid JSON (or not an object) ``on_bad(line number, reason)`` is
    called once (``reason``: one line, see :func:`bad_json_reason`) and the line is skipped."""
    for lineno, line in enumerate(lines, start=1):
        if not line or not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            on_bad(lineno, bad_json_reason(err))
            continue
        if objects_only and not isinstance(value, dict):
            on_bad(lineno, f"a JSON {type(value).__name__}, not an object")
            continue
        yield lineno, value
