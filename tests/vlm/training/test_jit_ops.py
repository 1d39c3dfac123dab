"""Whether DeepSpeed will JIT-compile an op (``vlm.training.jit_ops``): the torch-extensions folder, a cached build
told from a missing, stale or foreign one, the optimiser op a DeepSpeed JSON asks for, and the line logged."""

import json
import os
import sys
from pathlib import Path

import pytest

from vlm.training.jit_ops import build_notice, extensions_root, is_cached, optimizer_builder

CONFIGS = Path(__file__).resolve().parents[3] / "scripts" / "configs"


def _build(root: Path, name: str, sources: list[str]) -> Path:
    """What ``torch.utils.cpp_extension.load`` leaves: ``build.ninja`` naming the sources, then ``<name>.so``."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("".join(f"build {Path(s).stem}.o: compile {s}\n" for s in sources))
    library = folder / f"{name}.so"
    library.write_bytes(b"\x7fELF")
    newest = max(os.stat(s).st_mtime for s in sources)
    os.utime(library, (newest + 10, newest + 10))
    return library


def test_a_cached_build_is_told_from_a_missing_stale_or_foreign_one(tmp_path):
    sources = [tmp_path / "src" / "a.cpp", tmp_path / "src" / "b.cpp"]
    for src in sources:
        src.parent.mkdir(exist_ok=True)
        src.write_text("int f();\n")
    sources = [str(s) for s in sources]
    root = tmp_path / "ext"
    assert not is_cached("op", sources, root)  # nothing built yet
    library = _build(root, "op", sources)
    assert is_cached("op", sources, root)
    other = [str(tmp_path / "elsewhere" / "a.cpp"), sources[1]]  # built from another install's sources
    assert not is_cached("op", other, root)
    os.utime(sources[0], (library.stat().st_mtime + 5,) * 2)  # a source edited after the build
    assert not is_cached("op", sources, root)
    os.utime(sources[0], (library.stat().st_mtime - 5,) * 2)
    library.unlink()  # a build that never finished linking
    assert not is_cached("op", sources, root)


def test_extensions_root_follows_torch(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    root = extensions_root()
    assert root.parent == Path(get_default_build_root())
    assert root.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}_")


def test_optimizer_builder_of_the_deepspeed_json():
    shipped = json.loads((CONFIGS / "zero2.json").read_text())
    assert optimizer_builder(shipped) is None  # "torch_adam": true, as every shipped config: nothing to compile
    fused = {"optimizer": {"type": "AdamW", "params": {"torch_adam": False}}}
    assert optimizer_builder(fused) == optimizer_builder({"optimizer": {"type": "Adam"}}) == "FusedAdamBuilder"
    offload = {**fused, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert optimizer_builder(offload) == "CPUAdamBuilder"
    assert optimizer_builder({"optimizer": {"type": "Lamb"}}) is None and optimizer_builder({}) is None


def test_the_line_before_deepspeed_compiles_its_cpu_collectives(monkeypatch, tmp_path):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:  # a GPU accelerator has no such op: DeepSpeed builds nothing, nothing is said
        assert build_notice("ShareMemCommBuilder") is None
        return
    notice = build_notice("ShareMemCommBuilder")
    assert (
        notice == f"compiling DeepSpeed's deepspeed_shm_comm op (about 1-2 min, once per machine; cached in {tmp_path})"
    )
    _build(tmp_path, builder.NAME, [os.path.abspath(builder.deepspeed_src_path(p)) for p in builder.sources()])
    assert build_notice("ShareMemCommBuilder") is None  # built once: later runs say nothing
    assert build_notice("NoSuchBuilder") is None


@pytest.mark.parametrize("local_rank, logged", [("0", True), ("1", False)])
def test_announce_logs_once_per_machine(monkeypatch, tmp_path, caplog, local_rank, logged):
    from vlm.training.jit_ops import announce_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    with caplog.at_level("INFO", logger="vlm.training.jit_ops"):
        announce_build("FusedAdamBuilder")
    assert any("fused_adam" in r.getMessage() for r in caplog.records) == logged
