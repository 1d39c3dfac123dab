"""The plugin in process: batched log-likelihoods against a direct computation, chunking overrides, bad docs."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from eval import lmms_generation as gen
from eval.lmms_plugin import ConceptMoELMMs, manifests, output_path_from_argv
from eval.ppl import evaluate_ppl, windows

REPO = Path(__file__).resolve().parents[2]
IMPORTS = {
    "plugin_first": "import eval.lmms_plugin\nfrom lmms_eval.models import get_model",
    "lmms_eval_first": "from lmms_eval.models import get_model\nimport eval.lmms_plugin",
    "entry_point_module_first": "import eval.lmms_entry\nfrom lmms_eval.models import get_model",
}


@pytest.fixture(scope="module")
def plugin(tiny_checkpoint, tmp_path_factory):
    return ConceptMoELMMs(pretrained=str(tiny_checkpoint), stats_dir=str(tmp_path_factory.mktemp("stats")))


def _request(context, continuation, images=None, doc_id=0):
    visual = None if images is None else (lambda doc: images)
    return SimpleNamespace(args=(context, continuation, visual, doc_id, "t", "test"))


def test_manifest_and_argv():
    (m,) = manifests()
    assert m.model_id == "conceptmoe" and m.simple_class_path == "eval.lmms_plugin.ConceptMoELMMs"
    assert output_path_from_argv(["x", "--output_path", "o"]) == "o"
    assert output_path_from_argv(["--output_path=p"]) == "p" and output_path_from_argv([]) is None


@pytest.mark.parametrize("order", sorted(IMPORTS))
def test_model_resolves_in_any_import_order(order):
    """lmms-eval loads the entry points while ``lmms_eval.models`` initialises, which importing the plugin first
    triggers from inside the plugin's own import; in every order, a fresh process resolves ``conceptmoe``."""
    code = IMPORTS[order] + "\ncls = get_model('conceptmoe')\nprint('RESOLVED', cls.__module__, cls.__name__)"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{order}: exit {proc.returncode}\n{output[-3000:]}"
    assert "RESOLVED eval.lmms_plugin ConceptMoELMMs" in proc.stdout, output[-3000:]
    assert "Failed to load model entry-point manifests" not in output, output[-3000:]


def test_loglikelihood_batched_matches_direct_forward(plugin):
    plugin.task_dict = {"t": {"test": [{}, {}, {}]}}
    image = Image.new("RGB", (64, 48), (200, 30, 30))
    reqs = [
        _request("The colour is", " red", [image], 0),
        _request("A long context about docstrings and", " modules", None, 1),
        _request("", " hello", None, 2),
    ]
    plugin.batch_size = 3
    batched = plugin.loglikelihood(reqs)
    plugin.batch_size = 1
    single = plugin.loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(batched, single):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb and a < 0
    # direct: tokens of " modules" after the context (as a chat user turn + assistant header), one unpadded forward
    tok, model = plugin.processor.tokenizer, plugin.model
    prompt = "<|user|>A long context about docstrings and<|end|><|assistant|>"
    ctx = tok(prompt, add_special_tokens=False)["input_ids"]
    cont = tok(" modules", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)[0]
    direct = sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))
    assert batched[1][0] == pytest.approx(direct, abs=1e-4)


def test_bad_doc_is_skipped_and_counted(plugin):
    def broken(doc):
        raise FileNotFoundError("image /x/y.png cannot be read (FileNotFoundError)")

    plugin.task_dict = {"t": {"test": [{}]}}
    req = SimpleNamespace(args=("ctx", {"max_new_tokens": 2}, broken, 0, "t", "test"))
    assert plugin.generate_until([req]) == [""]
    assert plugin.failures["t"] >= 1
    with pytest.raises(NotImplementedError):
        plugin.generate_until_multi_round([req])


def test_generation_stops_and_records_stats(plugin, capsys):
    plugin.task_dict = {"t": {"test": [{"group": "g"}, {"group": "g"}]}}
    reqs = [
        SimpleNamespace(args=("Hello", {"max_new_tokens": 3, "until": ["\n"]}, None, 0, "t", "test")),
        SimpleNamespace(args=("A longer prompt here", {"max_new_tokens": 3, "until": ["\n"]}, None, 1, "t", "test")),
    ]
    plugin.batch_size = 2
    out = plugin.generate_until(reqs)
    assert len(out) == 2 and all(isinstance(o, str) and "\n" not in o for o in out)
    lines = (plugin.stats_dir / "r_stats_t.jsonl").read_text().splitlines()
    assert len(lines) >= 2 and '"group": "g"' in lines[-1]
    assert gen.cut_at_stop("abc\ndef</s>", ["\n"]) == "abc"
    bar = capsys.readouterr().err  # lmms-eval's convention: a bar of the requests on rank 0
    assert "Model Responding: 100%" in bar and "2/2" in bar


def test_chunking_overrides(tiny_checkpoint):
    p = ConceptMoELMMs(pretrained=str(tiny_checkpoint), chunking="fixed", target_r="4", record_stats="false")
    assert p.model.language_model.model.config.chunking == "fixed"
    item = {"prompt": "one two three four five six seven eight nine ten eleven twelve", "images": []}
    _, (stats,) = gen.generate_batch(
        p.model, p.processor, [item], gen.GenSettings(until=[], max_new_tokens=1), None, p._device
    )
    assert stats["concepts"] == math.ceil(stats["tokens"] / 4)  # a boundary every 4 tokens, exactly
    with pytest.raises(ValueError, match="chunking"):
        ConceptMoELMMs(pretrained=str(tiny_checkpoint), chunking="none")
    with pytest.raises(FileNotFoundError):
        ConceptMoELMMs(pretrained="/nonexistent/ckpt")


def test_ppl_on_text(tiny_checkpoint):
    assert windows([5, 6, 7], 1, 2) == [[1, 5, 6], [6, 7]]
    out = evaluate_ppl(str(tiny_checkpoint), seq_len=16, texts=["def f(x):\n    return x + 1\n" * 4, "Hello."])
    assert out["predicted_tokens"] > 0 and 0 < out["bits_per_token"] < 20
    assert out["ppl"] == pytest.approx(2 ** out["bits_per_token"], rel=1e-6) and out["r"] >= 1


def test_chat_template_modes_build_the_expected_prompt_ids(tiny_checkpoint, eval_tasks_dir, tmp_path):
    """Default: the task context as one user message through the processor's chat template, generation prompt
    appended (the training conversation's text up to the answer); ``chat_template=none``: the raw context."""
    from data_pipelines.chat import END_OF_TURN, ROLE_TOKENS, render
    from data_pipelines.synthetic import conversations, generate
    from eval.tasks import common

    data_dir = eval_tasks_dir / "cmoe_sceneqa" / "data"
    docs, _ = common.parse_lines((data_dir / "test.jsonl").read_text().splitlines(), data_dir, "cmoe_sceneqa")
    doc = docs[0]
    context = common.sceneqa_text(doc)
    g = doc["generator"]
    *_, base = generate("scenes", g["index"] + 1, g["seed"], g["split"])
    (conv,) = [
        c
        for c in conversations.conversations("scenes_chat", base, g["seed"], g["split"], g["index"])
        if c.meta["question"] == doc["question"]
    ]
    prompts = {}
    for mode in (None, "none"):
        p = ConceptMoELMMs(pretrained=str(tiny_checkpoint), record_stats="false", chat_template=mode)
        proc = p.processor
        tok = proc.tokenizer
        special = {t: tok.convert_tokens_to_ids(t) for t in (*ROLE_TOKENS.values(), END_OF_TURN)}
        assert len(set(special.values()) | {tok.unk_token_id}) == 5  # four tokens of their own
        p.task_dict = {"cmoe_sceneqa": {"test": [doc]}}
        req = SimpleNamespace(args=(context, {"max_new_tokens": 1}, common.sceneqa_visual, 0, "cmoe_sceneqa", "test"))
        (item,) = p._prepare([req])
        assert item["error"] is None and len(item["images"]) == 1
        enc = proc(text=[item["prompt"]], images=[item["images"]])
        body = [proc.image_token_id] * int(enc["num_tokens"][0])
        body += tok(context.removeprefix("<image>"), add_special_tokens=False)["input_ids"]
        if mode is None:
            body = [special["<|user|>"], *body, special["<|end|>"], special["<|assistant|>"]]
        assert enc["input_ids"][0].tolist() == list(proc.prefix_ids) + body + list(proc.suffix_ids), mode
        prompts[mode] = item["prompt"]
        stops = gen.GenSettings.from_kwargs({"until": ["\n"]}, proc, gen.chat_stops(p.chat_template)).stop_token_ids
        assert tok.eos_token_id in stops and (special["<|end|>"] in stops) == (mode is None)
    assert prompts["none"] == context
    assert prompts[None] == f"<|user|>{context}<|end|><|assistant|>"
    assert prompts[None] == render(conv.turns[:1], add_generation_prompt=True)  # the scenes_chat conversation's
    assert render(conv.turns).startswith(prompts[None])  # training text = eval prompt + answer + <|end|>
    # the processor's template, and the same template from a file, render the same string
    assert gen.chat_prompt(proc, context, gen.DEFAULT_TEMPLATE) == prompts[None]
    from data_pipelines.chat import CHAT_TEMPLATE

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    assert gen.chat_prompt(proc, context, gen.resolve_chat_template(str(template))) == prompts[None]
    with pytest.raises(ValueError, match="chat_template"):
        gen.resolve_chat_template("/nonexistent/template.jinja")


def test_task_image_budget_only_on_request(tiny_checkpoint, tmp_path):
    """By default an image gets the budget the checkpoint was trained at, whatever a task hints (a larger budget
    shifts the router's image R, docs/study.md); ``max_patches=task`` honours the task's ``image_max_patches``."""
    page = Image.new("RGB", (512, 512), "white")
    kwargs = {"max_new_tokens": 1, "until": ["\n"], "image_max_patches": 1024}
    image_tokens = {}
    for max_patches in (None, "task"):
        stats = tmp_path / str(max_patches)
        p = ConceptMoELMMs(pretrained=str(tiny_checkpoint), stats_dir=str(stats), max_patches=max_patches)
        p.task_dict = {"t": {"test": [{"group": "g"}]}}
        p.generate_until([SimpleNamespace(args=("<image>\nRead it.", kwargs, lambda doc: [page], 0, "t", "test"))])
        record = json.loads((stats / "r_stats_t.jsonl").read_text().splitlines()[-1])
        image_tokens[max_patches] = record["tokens_by_modality"]["1"]
    assert p.processor.image_processor.max_patches == 64  # the trained budget, saved with the checkpoint
    assert image_tokens["task"] == 16 * image_tokens[None]  # 1024 patches against 64, the same 2x2 merge
