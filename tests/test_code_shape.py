"""Code shape: functions short enough to read in one screen, and the formatter in charge of the layout."""

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vlm", "data_pipelines", "eval", "vision_tower")
MAX_FUNCTION_LINES = 60
MAX_FMT_SKIPS = 10


def long_functions(path: Path) -> list[str]:
    """``path:line name (N lines)`` for every function of ``path`` over the limit (``def`` to last line)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_over_60_lines():
    offenders = [hit for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) for hit in long_functions(path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_fmt_skip_is_rare():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    hits = []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "# fmt: skip" in line:
                hits.append(f"{name}:{number}")
    assert len(hits) <= MAX_FMT_SKIPS, f"{len(hits)} '# fmt: skip' (at most {MAX_FMT_SKIPS}):\n" + "\n".join(hits)


def test_test_files_have_unique_names():
    """tests/ has no __init__.py, so pytest imports each test file by its bare name: two files of one name in
    different folders stop the whole suite at collection ("import file mismatch")."""
    seen: dict[str, list[str]] = {}
    for path in sorted(Path(__file__).resolve().parent.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}
