"""The commands the docs give, checked against the code: the README and ``docs/*.md`` code blocks (and the
Makefile's recipes) may only name ``make`` targets the Makefile defines, ``python -m`` modules that exist, options
that the named script or module (or the project module it hands its arguments to) declares, and, under
``runs/demo/``, only what ``make demo`` writes. ``tests/test_readme.py`` checks the paths and runs the Python
blocks; the README's Python blocks must also print what they compute (a bare expression prints nothing in a
script)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from test_readme import BLOCKS, README, REPO, _expand_braces

DOCS = [README, REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
MAKEFILE = REPO / "Makefile"
PROJECT = ("vlm", "vision_tower", "data_pipelines", "eval")


def code_blocks(text: str) -> list[str]:
    """The shell code blocks (fence info ``bash`` / ``sh`` / ``shell`` / ``console`` or none) of markdown."""
    blocks, current, shell = [], None, False
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, shell = [], line[3:].strip() in ("", "bash", "sh", "shell", "console")
            else:
                blocks += ["\n".join(current) + "\n"] if shell else []
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands(text: str) -> list[str]:
    """Shell commands of the code blocks: continuation lines joined, comments and prompts dropped, split at
    ``&&`` / ``;`` / ``|``."""
    out = []
    for block in code_blocks(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip().removeprefix("$ ")
            out.extend(" ".join(part.split()) for part in re.split(r"&&|;|\|(?!\|)", line) if part.strip())
    return out


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", MAKEFILE.read_text(), flags=re.M))


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _module_exists(module: str) -> bool:
    """A project module by its spec; another by its installed distribution (``find_spec("pip")`` would switch
    setuptools' distutils shim off for the rest of the process, and torch's inductor then fails to import
    setuptools)."""
    if module.split(".")[0] in PROJECT:
        return _spec(module) is not None
    if module.split(".")[0] in sys.stdlib_module_names:
        return True
    try:
        importlib.metadata.distribution(module.split(".")[0].replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _module_source(module: str) -> Path | None:
    spec = _spec(module)
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def declared_options(path: Path) -> set[str]:
    """Every ``"--option"`` string in ``path`` and in the project modules it imports (one level down, and the
    ``__main__`` of a package)."""
    sources = [path]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PROJECT:
            sources += [p for p in (_module_source(node.module),) if p is not None]
    texts = [src.read_text() for src in sources]
    options = {opt for text in texts for opt in re.findall(r"""["'](--[\w-]+)["']""", text)}
    if any('f"--{' in text for text in texts):  # options made from a config dataclass's fields (--eval-every)
        fields = {f for text in texts for f in re.findall(r"^    (\w+): [\w.| \[\],]+ = ", text, flags=re.M)}
        options |= {"--" + f.replace("_", "-") for f in fields}
    return options


def program(command: str) -> tuple[str, Path | None, list[str]] | None:
    """(name, source, the words after it) of a project script or ``python -m`` project module in ``command``."""
    words = command.split()
    for i, word in enumerate(words):
        if word.startswith("scripts/") and word.endswith(".py"):
            return word, REPO / word, words[i + 1 :]
        if word == "-m" and i + 1 < len(words):
            module = words[i + 1]
            if module.split(".")[0] not in PROJECT:
                return None
            source = _module_source(module) or _module_source(f"{module}.__main__")
            return module, source, words[i + 2 :]
    return None


def demo_outputs() -> list[str]:
    """What ``make demo`` writes under ``$(DEMO_RUN)``, as ``runs/demo/...`` paths (braces expanded)."""
    found = re.findall(r"\$\(DEMO_RUN\)(/[\w./{},-]*)", MAKEFILE.read_text())
    return sorted({p.rstrip(",.") for f in found for p in _expand_braces("runs/demo" + f)})


def doc_commands() -> list[tuple[str, str]]:
    return [(source.name, c) for source in DOCS for c in commands(source.read_text(encoding="utf-8"))]


def test_named_make_targets_and_modules_exist():
    targets, missing = make_targets(), []
    for source, command in doc_commands():
        words = command.split()
        if words[:1] == ["make"]:
            missing += [f"{source}: make {w}" for w in words[1:2] if "=" not in w and w not in targets]
        for i, word in enumerate(words[:-1]):
            if word == "-m" and not _module_exists(words[i + 1]):
                missing.append(f"{source}: python -m {words[i + 1]}")
    assert not missing, "commands in the docs that do not exist:\n" + "\n".join(missing)


def test_options_given_to_project_commands_are_declared_by_them():
    missing, checked = [], 0
    for source, command in doc_commands():
        found = program(command)
        if found is None:
            continue
        name, path, rest = found
        if path is None or not path.is_file():
            missing.append(f"{source}: {name} (no source)")
            continue
        declared = declared_options(path)
        for word in rest:
            option = re.match(r"\[?(--[\w-]+)", word)
            if option:
                checked += 1
                if option[1] not in declared:
                    missing.append(f"{source}: {name} {option[1]}")
    assert checked > 50 and not missing, "options the docs give that the command does not take:\n" + "\n".join(missing)


def test_demo_paths_in_the_docs_are_what_make_demo_writes():
    outputs = demo_outputs()
    assert "runs/demo/stage2/hf" in outputs and "runs/demo/eval" in outputs
    wrong = []
    for source in [*DOCS, MAKEFILE]:
        for path in set(re.findall(r"runs/demo(?:/[\w.{},*-]+)*", source.read_text(encoding="utf-8"))):
            for p in _expand_braces(path.rstrip(",.")):
                if not any(p == o or o.startswith(p + "/") or p.startswith(o + "/") for o in outputs):
                    if p != "runs/demo":
                        wrong.append(f"{source.name}: {p}")
    assert not wrong, "runs/demo paths that make demo does not write:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_prints_what_it_computes(index):
    line, code = BLOCKS[index]
    tree = ast.parse(code)
    bare = [
        ast.unparse(node)[:60]
        for node in tree.body
        if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call | ast.Constant)
    ]
    assert not bare, f"README.md:{line}: bare expressions print nothing when run as a script: {bare}"
    assert "print(" in code, f"README.md:{line}: the block prints nothing"


def test_checkers_catch_what_they_are_for():
    text = "```bash\nmake no-such-target\npython -m vlm.nothing_here --x\n"
    text += "python scripts/r_report.py --nope \\\n  --out d\n```\n"
    assert commands(text) == [
        "make no-such-target",
        "python -m vlm.nothing_here --x",
        "python scripts/r_report.py --nope --out d",
    ]
    assert "no-such-target" not in make_targets() and "demo" in make_targets()
    name, path, rest = program(commands(text)[2])
    assert "--nope" not in declared_options(path) and rest == ["--nope", "--out", "d"]


def test_contributing_example_runs_as_written(tmp_path):
    """CONTRIBUTING.md's "Adding a run setting" block, in a child Python from the repository root (it edits the
    schema of the process it runs in): its printed values are the ones its comments promise."""
    import subprocess
    import sys

    text = (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    (code,) = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    promised = re.findall(r"print\(.*\)  # (.+)$", code, flags=re.M)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == promised
