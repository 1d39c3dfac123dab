"""A stderr that says it is a terminal (tqdm draws its bars only there), for the progress-bar tests. Patch it in
inside the test body (``monkeypatch.setattr("sys.stderr", Terminal())``): pytest puts its own capture back on
``sys.stderr`` between a fixture's setup and the test's call."""

import io


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True
