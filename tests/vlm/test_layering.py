"""The import layers (pyproject.toml ``[tool.importlinter]``, run by ``make lint`` / ``make test``): the tree keeps
them, a planted wrong-way import breaks the contract that forbids it, and ``import vlm`` stays light."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("vlm", "vision_tower", "data_pipelines", "eval")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

VISION_DATA = "vision_tower and data_pipelines never import vlm, eval or the training / evaluation frameworks"
VLM_LAYERS = "vlm: training > the VLM (model, processor, config) > accounting > backbone"
BACKBONE = "vlm.backbone is the text model alone: no VLM, accounting, training, data, vision or eval"
VLM_STACKS = "the VLM (vlm, vlm.config, vlm.model, vlm.processor) never imports training, eval or their frameworks"
VLM_DATA = "the VLM reads data_pipelines through schema (vlm.model) and tokenizer (vlm.processor) only"
ACYCLIC = "no import cycles between the modules of one package"


@pytest.fixture
def tree(tmp_path) -> Path:
    """The packages' Python files and pyproject.toml, copied: what lint-imports analyses below."""

    def not_python(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or not (n.endswith(".py") or Path(folder, n).is_dir())]

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=not_python)
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    # The working directory (lint-imports puts it first on sys.path) and PYTHONPATH hold the copies, so grimp
    # analyses them rather than the editable install's packages (its finder comes after the path entries).
    env = dict(os.environ, PYTHONPATH=str(tree), COLUMNS="500", NO_COLOR="1")
    cmd = [str(LINT_IMPORTS), "pyproject.toml", "--no-cache", "--no-logo"]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def plant(tree: Path, module: str, line: str) -> None:
    path = tree.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    path.write_text(path.read_text() + f"\n{line}\n")


def test_the_tree_keeps_every_contract(tree):
    proc = lint_imports(tree)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout and "BROKEN" not in proc.stdout


@pytest.mark.parametrize(
    "module, line, broken, shown",
    [
        ("vision_tower.merge", "from vlm import ConceptMoEVLM", [VISION_DATA], "vision_tower.merge -> vlm"),
        (
            "vlm.backbone.moe",
            "import vlm.training.loop",
            [VLM_LAYERS, BACKBONE],
            "vlm.backbone.moe -> vlm.training.loop",
        ),
        ("vlm", "import vlm.training.export", [VLM_STACKS], "vlm -> vlm.training.export"),
        (
            "vlm.model",
            "from data_pipelines.loader import make_dataloader",
            [VLM_DATA, VLM_STACKS],  # the loader brings webdataset
            "vlm.model -> data_pipelines.loader",
        ),
        ("eval.r_report_io", "from eval.r_report import summarize", [ACYCLIC], ".r_report_io -> .r_report"),
    ],
    ids=["vision_tower->vlm", "backbone->training", "vlm->training", "vlm.model->loader", "eval-cycle"],
)
def test_a_wrong_way_import_breaks_its_contract(tree, module, line, broken, shown):
    plant(tree, module, line)
    proc = lint_imports(tree)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in broken:  # (others may break too, through the new chain: eval -> vlm -> vlm.training, ...)
        assert f"{name} BROKEN" in proc.stdout, proc.stdout[-4000:]
    assert shown in proc.stdout, proc.stdout[-4000:]  # the offending import is named


def test_import_vlm_loads_no_training_eval_or_data_pipeline_code():
    """``import vlm`` and the models need neither the training nor the evaluation stack nor data loading: of
    data_pipelines only ``schema`` (the Modality enum vlm.model uses) is loaded, since VLMProcessor is lazy."""
    code = (
        "import sys, vlm\n"
        "from vlm import ConceptMoEVLM, ConceptMoEForCausalLM, ConceptMoEConfig\n"
        "print(' '.join(sorted(sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(proc.stdout.split())
    assert "vlm.model" in loaded  # the check saw a real import
    heavy = {m for m in loaded if m.split(".")[0] in ("deepspeed", "lmms_eval", "webdataset", "eval")}
    heavy |= {m for m in loaded if m.startswith(("vlm.training", "vlm.processor"))}
    heavy |= {m for m in loaded if m.startswith("data_pipelines")} - {"data_pipelines", "data_pipelines.schema"}
    assert not heavy, sorted(heavy)
    import vlm

    assert "VLMProcessor" in vlm.__all__ and vlm.VLMProcessor.__module__ == "vlm.processor"  # lazy, still there
