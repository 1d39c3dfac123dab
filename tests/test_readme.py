"""The README as a newcomer reads it: every Python block runs as written, every path it names exists.

- ``test_python_block_runs``: each ```python block of README.md, in one child interpreter started in the repository
  root (``HF_HUB_OFFLINE=1``, a timeout), each block in a fresh namespace: a block that uses a variable it never
  defines fails with ``NameError``, reported under the block's first line. One interpreter for all blocks pays the
  import of torch / transformers / timm (~15 s on a slow core) once instead of once per block.
- ``test_named_paths_exist``: every repo-relative path in README.md, docs/*.md (backticked, and in their code blocks)
  and the Makefile exists. A path is a token that ends in .py / .md / .yaml / .yml / .json / .toml, ends in ``/``,
  or starts with a top-level folder of the repository; a bare file name (``cache.py``) must exist somewhere in the
  tree. Outputs that commands create (``runs/...``, ``data/...``, ``eval/tasks/<task>/data/``, ...) are allowed by
  the explicit lists below.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BLOCK_TIMEOUT_S = 300  # all blocks together; they take ~40 s on two slow cores

# Paths that commands in the docs *create* (outputs), or placeholders for the user's own folders: never checked.
OUTPUT_PREFIXES = (
    "runs/",
    "data/",
    "build/",
    ".venv/",
    "OUT/",
    "DIR/",
    "OUTPUT/",
    "OUTPUT_PATH/",
    "STATS_DIR/",
    "tb/",  # TensorBoard events inside a run folder
    "RUN_DIR",
    "path/to/",
    "img2dataset_out/",
    "eval/tasks/*/data",  # written by scripts/make_eval_data.py (git-ignored)
)
# File names that commands write (inside one of the folders above or an output folder the user picks).
OUTPUT_NAMES = {
    "manifest.json",
    "metrics.json",
    "r_report.json",
    "conversion_report.json",
    "cmoe_niah_grid.json",
    "config.json",
    "processor_config.json",
    "preprocessor_config.json",  # ImageProcessor.save_pretrained
    "generation_config.json",  # ConceptMoEVLM.save_pretrained
    "vlm_processor_config.json",  # written by the processor before it was a transformers one (still read)
    "image_processor_config.json",
    "test.jsonl",
    "ds_config.json",  # a run's effective DeepSpeed config
    "rank_state_*.json",  # a checkpoint's per-rank state (docs/reliability.md)
    "*_results.json",  # lmms-eval's results file
    "vlm_*.py",  # the flat code copies save_pretrained writes into an export (vlm/hub_code.py)
}
# Files outside this repository that the docs cite by name.
EXTERNAL_NAMES = {"ConceptMoE_demo.py"}  # the paper authors' reference demo (docs/paper.md)
PATH_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".toml")
SKIP_DIRS = {".git", ".venv", "__pycache__", "runs", "data", "build", ".pytest_cache", ".ruff_cache", ".grimp_cache"}


# ----------------------------------------------------------------------------------------------------------------
# Python blocks


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number of the first code line, code)`` of every ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 2, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def block_title(line: int, code: str) -> str:
    first = next((s.strip() for s in code.splitlines() if s.strip()), "")
    return f"README.md:{line}: {first}"


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))

# The child: runs every block in a fresh namespace from the repository root and appends one JSON line per event to
# the results file (flushed), so that a block that hangs is still named after the timeout.
RUNNER = textwrap.dedent(
    """
    import json, os, sys, time, traceback
    blocks = json.load(open(sys.argv[1], encoding="utf-8"))
    results = open(sys.argv[2], "a", encoding="utf-8")
    root = os.getcwd()
    def event(**record):
        results.write(json.dumps(record) + "\\n")
        results.flush()
    for index, (line, code) in enumerate(blocks):
        event(index=index, status="started")
        start = time.perf_counter()
        try:
            exec(compile(code, f"README.md block at line {line}", "exec"), {"__name__": "__main__"})
        except BaseException:
            event(index=index, status="failed", seconds=time.perf_counter() - start, error=traceback.format_exc())
        else:
            event(index=index, status="ok", seconds=time.perf_counter() - start)
        finally:
            os.chdir(root)
    """
)


@pytest.fixture(scope="module")
def block_results(tmp_path_factory) -> dict[int, dict]:
    """Run all blocks once; ``{block index: {"status": ok | failed | timeout | not run, ...}}``."""
    tmp = tmp_path_factory.mktemp("readme")
    (tmp / "blocks.json").write_text(json.dumps(BLOCKS), encoding="utf-8")
    results_file = tmp / "results.jsonl"
    results_file.touch()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-c", RUNNER, str(tmp / "blocks.json"), str(results_file)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        tail = (proc.stdout + proc.stderr)[-2000:]
        timed_out = False
    except subprocess.TimeoutExpired as err:
        tail, timed_out = str(err.stderr or "")[-2000:], True
    results: dict[int, dict] = {}
    for line in results_file.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        results[record.pop("index")] = record
    for index in range(len(BLOCKS)):
        record = results.setdefault(index, {"status": "not run"})
        if record["status"] == "started":
            record["status"] = "timeout" if timed_out else "crashed"
        record["output_tail"] = tail
    seconds = ", ".join(f"{r.get('seconds', float('nan')):.1f}" for _, r in sorted(results.items()))
    print(f"README blocks: {len(BLOCKS)} in {time.perf_counter() - start:.1f} s (each: {seconds} s)")
    return results


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, "README.md lost its Python examples (or the ```python fences)"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[block_title(*b)[:80] for b in BLOCKS])
def test_python_block_runs(block_results, index):
    record = block_results[index]
    title = block_title(*BLOCKS[index])
    if record["status"] == "failed":
        pytest.fail(f"{title}\nraised:\n{record['error'][-3000:]}", pytrace=False)
    if record["status"] != "ok":
        pytest.fail(f"{title}\n{record['status']} (limit {BLOCK_TIMEOUT_S} s)\n{record['output_tail']}", pytrace=False)


# ----------------------------------------------------------------------------------------------------------------
# Paths


def top_level_folders() -> set[str]:
    return {
        p.name
        for p in REPO.iterdir()
        if p.is_dir() and p.name not in SKIP_DIRS and not p.name.endswith(".egg-info") and p.name != ".git"
    }


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [x for part in match.group(1).split(",") for x in _expand_braces(head + part + tail)]


def _tokens(text: str) -> list[str]:
    """Whitespace- or ``=``-separated words without surrounding quotes, brackets and sentence punctuation."""
    return [t.lstrip("\"'([").rstrip("\"')];:,.") for t in re.split(r"[\s=]+", text)]


def path_candidates(text: str, *, markdown: bool) -> set[str]:
    """Tokens of ``text`` that look like repo paths (see the module docstring)."""
    tops = top_level_folders()
    starts_top = lambda t: t.split("/", 1)[0] in tops and "/" in t
    found = set()
    if markdown:
        fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
        prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
        spans = re.findall(r"`([^`\n]+)`", prose)
        for token in (t for span in spans for t in _tokens(span)):
            if token.endswith(PATH_SUFFIXES) or token.endswith("/") or starts_top(token.removeprefix("./")):
                found.add(token)
        code_tokens = [t for block in fenced for t in _tokens(block)]
    else:
        code_tokens = _tokens(text)
    found.update(t for t in code_tokens if starts_top(t.removeprefix("./")))
    return {t for t in found if re.search(r"\w", t) and "://" not in t and "$" not in t and not t.startswith("-")}


def _exists(token: str, names: set[str]) -> bool:
    path = re.sub(r"<[^<>]+>", "*", token.removeprefix("./"))
    if "::" in path:  # a test: tests/x/test_y.py::test_name[param] names a function of that file
        path, test = path.split("::", 1)
        name = test.split("[", 1)[0]
        return (REPO / path).is_file() and re.search(rf"^def {re.escape(name)}\(", (REPO / path).read_text(), re.M)
    if path.startswith(OUTPUT_PREFIXES):
        return True
    if "/" not in path.rstrip("/"):  # a bare name: an output or external name, or somewhere in the tree
        name = path.rstrip("/")
        if any(fnmatch.fnmatch(name, pattern) for pattern in OUTPUT_NAMES | EXTERNAL_NAMES):
            return True
        return any(fnmatch.fnmatchcase(n, name) for n in names)
    if "*" in path:
        return any(REPO.glob(path.rstrip("/")))
    return (REPO / path).exists()


def _tree_names() -> set[str]:
    names = set()
    for _root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        names.update(dirs)
        names.update(files)
    return names


def test_named_paths_exist():
    names = _tree_names()
    sources = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")), REPO / "Makefile"]
    missing = []
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for token in sorted(path_candidates(text, markdown=source.suffix == ".md")):
            for path in _expand_braces(token):
                if not _exists(path, names):
                    missing.append(f"{source.relative_to(REPO)}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_path_checker_catches_a_missing_file():
    names = _tree_names()
    text = "see `tests/vlm/test_nothing_here.py` and `docs/ENVIRONMENT.md`, run `scripts/make_shards.py`"
    assert not _exists("tests/test_readme.py::test_no_such_test", names)
    assert _exists("tests/test_readme.py::test_path_checker_catches_a_missing_file[x]", names)
    candidates = path_candidates(text, markdown=True)
    assert {"tests/vlm/test_nothing_here.py", "docs/ENVIRONMENT.md", "scripts/make_shards.py"} <= candidates
    assert [c for c in sorted(candidates) if not _exists(c, names)] == [
        "docs/ENVIRONMENT.md",
        "tests/vlm/test_nothing_here.py",
    ]
    assert _exists("runs/demo/hf", names) and _exists("eval/tasks/<task>/data/", names)
    assert _expand_braces("scripts/configs/zero{1,2,3}.json")[2] == "scripts/configs/zero3.json"


def test_reliability_table_names_real_tests():
    """docs/reliability.md: every test it cites (``file.py::name``, or ``::name`` after a file in the same row)
    is a function of a file under tests/ — the table cannot drift from the suite unnoticed."""
    files = {p.name: p for p in (REPO / "tests").rglob("test_*.py")}
    cited, missing = 0, []
    for row in (REPO / "docs" / "reliability.md").read_text(encoding="utf-8").splitlines():
        current = None
        for file, name in re.findall(r"`(?:[\w/]*/)?(test_\w+\.py)?::(test_\w+)", row):
            current = files.get(file) if file else current
            cited += 1
            if current is None or not re.search(rf"^def {name}\(", current.read_text(), re.M):
                missing.append(f"{file or '(same file)'}::{name}")
    assert cited > 30 and not missing, missing
