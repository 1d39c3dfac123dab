"""Exports that load without this repository (``vlm.hub_code``): the flat copies of the package, ``auto_map``, and a
saved VLM + processor and a saved text backbone loaded in a Python where ``vlm``, ``vision_tower`` and
``data_pipelines`` cannot be imported, through the Auto classes and ``pipeline`` with ``trust_remote_code=True``."""

import ast
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from PIL import Image

from data_pipelines.tokenizer import load_tokenizer
from vision_tower import ImageProcessor
from vlm import ConceptMoEForCausalLM, ConceptMoEVLM
from vlm.backbone.config import ConceptMoEConfig
from vlm.hub_code import HEADER, HubCodeError, _imported_modules, check_folder, flat_name, module_closure
from vlm.processor import VLMProcessor

ROOTS = ["vlm.model", "vlm.config", "vlm.processor", "vision_tower.image_processor"]

# Run in a child Python: the project's packages are unimportable there, as on a machine that only has the folder.
BLOCK = """
import importlib.abc, sys
class _NoProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vlm", "vision_tower", "data_pipelines", "eval"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, _NoProject())
"""


def run_elsewhere(code: str, tmp_path) -> str:
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK + textwrap.dedent(code)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_every_copy_imports_only_its_siblings_and_installed_packages():
    closure = module_closure(ROOTS)
    assert {"vlm.backbone.chunking", "vision_tower.stem", "data_pipelines.chat", "vlm.hub_code"} <= set(closure)
    assert not {"vlm.training", "data_pipelines.loader", "eval"} & {m.rsplit(".", 1)[0] for m in closure}
    names = {flat_name(m) for m in closure}
    from vlm.hub_code import flat_source

    for module in closure:
        source = flat_source(module)
        assert source.startswith(HEADER.format(module=module))
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module in names, f"{module}: .{node.module} is not copied"
            top = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            top += [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in top:
                assert name.split(".")[0] in sys.stdlib_module_names | {
                    "torch",
                    "transformers",
                    "timm",
                    "PIL",
                    "numpy",
                    "safetensors",
                    "tokenizers",
                }, f"{module} imports {name}"


@pytest.mark.parametrize(
    "code", ["import vlm.backbone.model", "from vlm.backbone import model", "from .config import X"]
)
def test_import_forms_a_flat_copy_cannot_express_are_refused(code):
    with pytest.raises(HubCodeError):
        _imported_modules("example", ast.parse(code))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A tiny VLM + processor saved as training's export saves them, and the logits of one prompt here."""
    out = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    processor = VLMProcessor(load_tokenizer(), ImageProcessor(patch_size=16, max_patches=64))
    model = ConceptMoEVLM.from_preset(
        "tiny", image_token_id=processor.image_token_id, vocab_size=len(processor.tokenizer), max_patches=64
    ).eval()
    model.set_special_token_ids(**processor.special_token_ids)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    image = Image.new("RGB", (90, 60), (200, 30, 30))
    image.save(out / "picture.png")
    inputs = processor(text=["<image>\nWhat colour is the square?"], images=[[image]])
    with torch.no_grad():
        torch.save(model(**inputs).logits, out / "reference_logits.pt")
    return out


def test_saved_folder_names_its_code_in_auto_map(export):
    config = json.loads((export / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "vlm_config.ConceptMoEVLMConfig",
        "AutoModel": "vlm_model.ConceptMoEVLM",
        "AutoModelForImageTextToText": "vlm_model.ConceptMoEVLM",
    }
    processor = json.loads((export / "processor_config.json").read_text())
    assert processor["auto_map"] == {"AutoProcessor": "vlm_processor.VLMProcessor"}
    assert processor["image_processor"]["auto_map"] == {
        "AutoImageProcessor": "vision_tower_image_processor.ImageProcessor"
    }
    for entry in [*config["auto_map"].values(), processor["auto_map"]["AutoProcessor"]]:
        assert (export / f"{entry.split('.')[0]}.py").is_file()


@pytest.fixture(scope="module")
def text_export(tmp_path_factory):
    """A tiny text backbone saved with ``save_pretrained``, and the logits of random ids here."""
    out = tmp_path_factory.mktemp("lm")
    torch.manual_seed(0)
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", vocab_size=300)).eval()
    model.save_pretrained(out)
    ids = torch.randint(0, 300, (1, 24))
    torch.save({"ids": ids, "logits": model(input_ids=ids).logits.detach()}, out / "reference.pt")
    return out


def test_loads_and_answers_where_the_project_is_not_installed(export, text_export, tmp_path):
    assert json.loads((text_export / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "vlm_backbone_model.ConceptMoEForCausalLM"
    )
    out = run_elsewhere(
        f"""
        import os
        import torch
        from PIL import Image
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, pipeline
        folder, lm = {str(export)!r}, {str(text_export)!r}
        for auto in (AutoModelForImageTextToText, AutoProcessor):  # without trust_remote_code: HF's refusal
            try:
                auto.from_pretrained(folder)
                raise SystemExit(f"{{auto.__name__}} loaded custom code without trust_remote_code")
            except ValueError as err:
                assert "trust_remote_code" in str(err), err
        model = AutoModelForImageTextToText.from_pretrained(folder, trust_remote_code=True).eval()
        processor = AutoProcessor.from_pretrained(folder, trust_remote_code=True)
        print("classes", type(model).__name__, type(processor).__name__, type(processor.image_processor).__name__)
        image = Image.open(folder + "/picture.png")
        inputs = processor(text=["<image>\\nWhat colour is the square?"], images=[[image]])
        with torch.no_grad():
            logits = model(**inputs).logits
        print("vlm_diff", (logits - torch.load(folder + "/reference_logits.pt")).abs().max().item())
        messages = [{{"role": "user", "content": [{{"type": "image", "image": image}},
                                                 {{"type": "text", "text": "What colour is the square?"}}]}}]
        chat = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                             return_tensors="pt")
        new = model.generate(**chat, max_new_tokens=3, do_sample=False).shape[1] - chat["input_ids"].shape[1]
        print("generated", new)
        reply = pipeline("image-text-to-text", model=folder, trust_remote_code=True)(text=messages, max_new_tokens=2)
        print("pipeline", reply[0]["generated_text"][-1]["role"])
        model.save_pretrained("resaved")  # from the copies: the new folder carries them along and loads
        processor.save_pretrained("resaved")
        code = lambda d: sorted(p for p in os.listdir(d) if p.endswith(".py"))
        AutoModelForImageTextToText.from_pretrained("resaved", trust_remote_code=True)
        again = AutoProcessor.from_pretrained("resaved", trust_remote_code=True)
        print("resaved", code("resaved") == code(folder), type(again).__name__)
        text_model = AutoModelForCausalLM.from_pretrained(lm, trust_remote_code=True).eval()
        ref = torch.load(lm + "/reference.pt")
        print("lm_diff", (text_model(input_ids=ref["ids"]).logits - ref["logits"]).abs().max().item())
        """,
        tmp_path,
    )
    assert "classes ConceptMoEVLM VLMProcessor ImageProcessor" in out
    assert float(re.search(r"vlm_diff (\S+)", out)[1]) < 1e-5
    assert float(re.search(r"lm_diff (\S+)", out)[1]) < 1e-5
    assert "generated 3" in out and "pipeline assistant" in out and "resaved True VLMProcessor" in out


def test_push_to_hub_from_save_pretrained_is_refused_before_anything_is_written(tmp_path):
    model = ConceptMoEForCausalLM(ConceptMoEConfig.from_preset("tiny", vocab_size=300))
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "x", push_to_hub=True)
    assert not (tmp_path / "x").exists()


def test_a_missing_export_folder_is_named_as_such_not_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    loaders = (ConceptMoEVLM.from_pretrained, ConceptMoEForCausalLM.from_pretrained, VLMProcessor.from_pretrained)
    for path in (tmp_path / "nothing", "./nothing", "runs/demo/hf"):  # more than one "/", or plainly local
        for load in loaders:
            with pytest.raises(FileNotFoundError, match=r"no such folder"):
                load(path)
    check_folder("owner/name")  # could be a Hub id: left to transformers
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"^owner/name: no such folder"):
        check_folder("owner/name")
