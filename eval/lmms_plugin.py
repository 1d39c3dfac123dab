"""lmms-eval model plugin: ``lmms-eval --model conceptmoe --model_args pretrained=DIR[,key=value...]``.

Registered through the ``lmms_eval.models`` entry point (``pyproject.toml``: ``conceptmoe =
"eval.lmms_entry:manifests"``; that module imports nothing at load time, so importing this one before or after
``lmms_eval.models`` both work, see ``eval/lmms_entry.py``). ``DIR`` holds ``ConceptMoEVLM.save_pretrained`` and
``VLMProcessor.save_pretrained`` output (what ``python -m vlm.training.export`` writes).

``--model_args`` (all optional except ``pretrained``):

- ``device`` (default ``cuda`` when available, else ``cpu``), ``dtype`` (``float32`` | ``bfloat16`` | ``float16``);
  the batch size is lmms-eval's own ``--batch_size N`` (lmms-eval passes it to the model itself);
- ``max_patches``: image patch budget for every image. Default: the saved processor's, i.e. the budget the model
  was trained at. ``task``: a task's ``image_max_patches`` generation kwarg where it gives one (``cmoe_longdoc``
  asks for 1536, its pages at native resolution), the saved budget elsewhere. A budget the model never saw in
  training shifts what its router sees: a 64-patch-trained router that merges a page into ~5 concepts at 64
  patches (image R 15) still makes ~5 of 1536 (image R ~300), docs/study.md "R where it matters";
- chunking studies: ``chunking`` (``dynamic`` | ``fixed``: a boundary every ``target_r`` tokens, i.e. a forced
  eval-time R | ``none`` on a chunked model is refused), ``target_r``, ``noise_tau`` (boundary noise only ever
  applies in training mode; evaluation runs in eval mode), ``modality_boundaries`` (true / false),
  ``image_chunking`` (``raster`` / ``rows`` / ``snake`` / ``zorder`` / ``router2d``, ``vlm.image_scan``);
- ``stats_dir``: where the per-sample R records go (default: ``--output_path``'s model folder, next to
  lmms-eval's ``*_results.json``), ``record_stats`` (default true);
- ``chat_template``: unset or ``default``: every task context is one user message ``{"role": "user", "content":
  context}`` rendered by ``processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
  (``data_pipelines.chat``'s template; an older processor without one renders the same string through
  ``data_pipelines.chat.render``), and generation also stops at ``<|end|>``; ``none``: the raw context, for base
  models trained without the template; any other value: the path of a Jinja template file used instead.

Per sample (every request) one JSON line in ``STATS_DIR/r_stats_<task>.jsonl``: ``task``, ``doc_id``, ``group``,
``tokens``, ``concepts``, ``r``, ``r_text``, ``r_image`` and the per-modality counts, measured on the prompt
forward (for loglikelihood: context + continuation). ``scripts/r_report.py OUTPUT_PATH`` reads them.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

# Bound before anything imports lmms_eval: an install made before the entry point moved to eval.lmms_entry still
# names "eval.lmms_plugin:manifests", and lmms-eval may load it while this module is half-imported.
from eval.lmms_entry import manifests  # noqa: F401  # isort: skip

import torch
from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from PIL import Image
from tqdm import tqdm

from eval import lmms_generation as gen

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _as_bool(value, name: str) -> bool:
    """``true`` / ``false`` (and 1/0, yes/no) from ``--model_args``, else a one-line ValueError."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"conceptmoe: {name}={value!r} is not a boolean (use true / false)")


def output_path_from_argv(argv: list[str]) -> str | None:
    """``--output_path X`` (or ``--output_path=X``) of the running lmms-eval command line, if any."""
    for i, arg in enumerate(argv):
        if arg == "--output_path" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--output_path="):
            return arg.split("=", 1)[1]
    return None


def default_stats_dir(pretrained: str, argv: list[str] | None = None) -> Path | None:
    """The folder where lmms-eval writes its results: ``OUTPUT_PATH/<sanitised model name>``."""
    from lmms_eval.utils import sanitize_model_name

    out = output_path_from_argv(sys.argv if argv is None else argv)
    return None if out is None else Path(out) / sanitize_model_name(str(pretrained))


class ConceptMoELMMs(lmms):
    """A ConceptMoE VLM checkpoint behind lmms-eval's ``lmms`` interface."""

    def __init__(
        self,
        pretrained: str,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int | str = 1,
        max_patches: int | str | None = None,
        chunking: str | None = None,
        target_r: float | str | None = None,
        noise_tau: float | str | None = None,
        modality_boundaries: bool | str | None = None,
        image_chunking: str | None = None,
        stats_dir: str | None = None,
        record_stats: bool | str = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> None:
        super().__init__()
        from vlm import ConceptMoEVLM, VLMProcessor

        kwargs.pop("max_batch_size", None)
        if kwargs:
            logger.warning("conceptmoe: ignoring unknown model_args %s", sorted(kwargs))
        if not Path(str(pretrained)).is_dir():
            raise FileNotFoundError(f"conceptmoe: pretrained={pretrained!r} is not a folder (an exported checkpoint)")
        if dtype not in DTYPES:
            raise ValueError(f"conceptmoe: dtype={dtype!r} is invalid: use one of {sorted(DTYPES)}")
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.processor = VLMProcessor.from_pretrained(str(pretrained))
        self.model = ConceptMoEVLM.from_pretrained(str(pretrained)).to(self._device, DTYPES[dtype]).eval()
        self.batch_size = max(1, int(batch_size or 1))
        self.task_budget = str(max_patches) == "task"  # honour a task's image_max_patches hint
        self.max_patches = None if max_patches in (None, "", "none", "task") else int(max_patches)
        self.default_max_patches = self.processor.image_processor.max_patches
        gen.apply_chunking_overrides(
            self.model,
            chunking=chunking,
            target_r=None if target_r in (None, "") else float(target_r),
            noise_tau=None if noise_tau in (None, "") else float(noise_tau),
            modality_boundaries=None
            if modality_boundaries is None
            else _as_bool(modality_boundaries, "modality_boundaries"),
            image_chunking=image_chunking or None,
        )
        self.chat_template = gen.resolve_chat_template(chat_template)  # None: raw prompts
        self.record_stats = _as_bool(record_stats, "record_stats")
        self.stats_dir = Path(stats_dir) if stats_dir else default_stats_dir(pretrained)
        self._stats_files: set[Path] = set()
        self.failures: dict[str, int] = {}
        if self.record_stats and self.stats_dir is None:
            logger.warning("conceptmoe: no --output_path and no stats_dir: per-sample R records are not written")

    # ------------------------------------------------------------------ inputs
    def _visuals(self, req_args) -> list[Image.Image]:
        """The request's images (``doc_to_visual`` of its doc), flattened; raises a one-line error on bad ones."""
        doc_to_visual, doc_id, task, split = req_args[2], req_args[3], req_args[4], req_args[5]
        if doc_to_visual is None:
            return []
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        flat = []
        for v in visuals or []:
            flat.extend(v if isinstance(v, list | tuple) else [v])
        for v in flat:
            if not isinstance(v, Image.Image):
                raise TypeError(f"doc_to_visual gave a {type(v).__name__}, only PIL images are supported")
        return flat

    def _prompt(self, context: str, n_images: int) -> str:
        """The context with one ``<image>`` marker per image (as given, or all images first when it has none),
        then through the chat template (``chat_template``; unchanged with ``none``)."""
        n_markers = context.count(IMAGE_MARKER)
        if n_markers == 0 and n_images:
            context = IMAGE_MARKER * n_images + "\n" + context
        elif n_markers != n_images:
            raise ValueError(f"the prompt has {n_markers} {IMAGE_MARKER} markers but the doc has {n_images} images")
        if not context:  # an empty loglikelihood context stays empty: the continuation is scored from EOS
            return context
        return gen.chat_prompt(self.processor, context, self.chat_template)

    def _prepare(self, requests: list[Instance]) -> list[dict]:
        """Per request: prompt, images, or the one-line reason it failed (counted, answered empty / -inf)."""
        items = []
        for req in requests:
            context, task, doc_id = req.args[0], req.args[4], req.args[3]
            item = {"req": req, "task": task, "doc_id": doc_id, "error": None}
            try:
                images = self._visuals(req.args)
                item |= {"prompt": self._prompt(context, len(images)), "images": images}
            except Exception as err:  # noqa: BLE001 - a bad doc must not stop the run
                item["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                self.failures[task] = self.failures.get(task, 0) + 1
                logger.error("conceptmoe: %s doc %s skipped (%s)", task, doc_id, item["error"])
            items.append(item)
        return items

    def _group(self, item: dict):
        """A label of the doc for per-group R (page count, needle cell), when the task's doc carries ``group``."""
        req = item["req"]
        try:
            return self.task_dict[req.args[4]][req.args[5]][req.args[3]].get("group")
        except (KeyError, IndexError, TypeError, AttributeError):
            return None

    # ------------------------------------------------------------------ records
    def _write_stats(self, items: list[dict], stats: list[dict | None], kind: str) -> None:
        """One JSON line per request into ``stats_dir/r_stats_<task>.jsonl`` (truncated on first use)."""
        if not self.record_stats or self.stats_dir is None:
            return
        self.stats_dir.mkdir(parents=True, exist_ok=True)
        for item, row in zip(items, stats):
            if row is None:
                continue
            path = self.stats_dir / f"r_stats_{item['task']}.jsonl"
            mode = "a" if path in self._stats_files else "w"
            self._stats_files.add(path)
            rec = {"task": item["task"], "doc_id": item["doc_id"], "group": self._group(item), "request": kind} | row
            with path.open(mode, encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def _batches(self, items: list[dict], key) -> list[list[dict]]:
        """Valid items grouped by ``key`` (e.g. generation kwargs), longest prompt first, cut to ``batch_size``."""
        groups: dict[str, list[dict]] = {}
        for item in items:
            if item["error"] is None:
                groups.setdefault(key(item), []).append(item)
        batches = []
        for group in groups.values():
            group.sort(key=lambda it: -len(it["prompt"]))
            batches += [group[i : i + self.batch_size] for i in range(0, len(group), self.batch_size)]
        return batches

    def _progress(self, items: list[dict], desc: str) -> tqdm:
        """lmms-eval's models' convention: a bar of the requests on rank 0 (stderr), here of the valid ones."""
        return tqdm(total=sum(it["error"] is None for it in items), desc=desc, disable=self.rank != 0)

    # ------------------------------------------------------------------ lmms interface
    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Batched generation: left-padded prompts, the task's ``until`` / ``max_new_tokens`` / ``temperature``."""
        items = self._prepare(requests)
        key = lambda it: json.dumps(it["req"].args[1], sort_keys=True, default=str)
        answers: dict[int, str] = {}
        bar = self._progress(items, "Model Responding")
        for batch in self._batches(items, key):
            stops = gen.chat_stops(self.chat_template)
            kwargs = gen.GenSettings.from_kwargs(batch[0]["req"].args[1], self.processor, extra_stops=stops)
            hint = kwargs.image_max_patches if self.task_budget else None
            budget = self.max_patches or hint or self.default_max_patches
            texts, stats = gen.generate_batch(self.model, self.processor, batch, kwargs, budget, self._device)
            for item, text in zip(batch, texts):
                answers[id(item)] = text
            self._write_stats(batch, stats if self.record_stats else [None] * len(batch), "generate_until")
            bar.update(len(batch))
        bar.close()
        return [answers.get(id(item), "") for item in items]

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """Batched (sum log p(continuation | context), continuation is the greedy one) from the plain forward."""
        items = self._prepare(requests)
        for item in items:
            cont = item["req"].args[1]
            if not isinstance(cont, str):  # doc_to_target callable (lmms-eval passes it for some tasks)
                r = item["req"].args
                cont = cont(self.task_dict[r[4]][r[5]][r[3]])
            item["continuation"] = str(cont)
        results: dict[int, tuple[float, bool]] = {}
        bar = self._progress(items, "Running loglikelihood requests")
        for batch in self._batches(items, lambda it: "all"):
            scores, stats = gen.loglikelihood_batch(
                self.model, self.processor, batch, self.max_patches or self.default_max_patches, self._device
            )
            for item, score in zip(batch, scores):
                results[id(item)] = score
            self._write_stats(batch, stats if self.record_stats else [None] * len(batch), "loglikelihood")
            bar.update(len(batch))
        bar.close()
        return [results.get(id(item), (float("-inf"), False)) for item in items]

    def generate_until_multi_round(self, requests) -> list[str]:
        """Not supported: the local tasks are single-turn."""
        raise NotImplementedError(
            "conceptmoe: generate_until_multi_round is not implemented (single-turn tasks only; use generate_until)"
        )
