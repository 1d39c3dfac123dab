"""The arms of the study: compute-matched model configs and the training YAML of each (arm, seed).

The baseline is a plain-MoE preset (``baseline``, e.g. ``tiny-moe``: ``vlm/backbone/presets.py``) at the vocabulary
of the tokenizer the runs train with, so that the matched shapes are those of the model actually trained (the
embedding and LM head are part of the total parameters that must match). Every chunked arm is
``vlm.accounting.flops.match(baseline, target_r, strategy, **chunked_defaults, **arm.match)``: total parameters and
linear (non-attention) FLOPs per token within 2% of the baseline, the rule of ConceptMoE (arXiv 2601.21420, §3.5;
``docs/paper.md`` §9). An arm whose match report is not ``within_tolerance`` is refused (``ArmError``, one line).

``after_match`` holds chunking settings ``match`` cannot take but that change no weight shape (e.g.
``target_r_by_modality``, which needs ``chunking: dynamic`` where ``match`` builds its plain baseline): they are set
on the matched config, which is then re-checked. ``vlm`` holds VLM-level fields (``modality_boundaries``), ``train``
fields of the training YAML's ``train`` section for this arm alone (e.g. ``router_lr_scale``).

The training YAML of a run is ``train_base`` verbatim plus ``model.preset: <baseline>``, ``model.overrides``
(every field of the matched config that differs from the preset, less those the run sets itself, like
``vocab_size``), the shards and ``train.seed``. A staged study (``stages``) builds the model so in its first stage
and chains the others through their exports (``train_yaml``).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

from data_pipelines.tokenizer import load_tokenizer
from vlm.accounting.flops import TOLERANCE, match, match_report
from vlm.backbone.config import ConceptMoEConfig
from vlm.config import ConceptMoEVLMConfig

# Fields the training run sets from its tokenizer and data (vlm/training/config.py SET_BY_RUN): never overridden.
SET_BY_RUN = ("vocab_size", "image_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "max_patches")
FIELDS = [k for k in inspect.signature(ConceptMoEConfig.__init__).parameters if k not in ("self", "kwargs")]


class ArmError(ValueError):
    """An arm that cannot be built or is not compute-matched; the message is one line."""


@dataclass
class Arm:
    """One arm: its matched backbone config, the overrides that build it from the preset, its match report."""

    name: str
    config: ConceptMoEConfig
    overrides: dict
    report: dict
    strategy: int | None
    serves: list = field(default_factory=list)
    note: str = ""
    train: dict = field(default_factory=dict)  # this arm's own train-section fields

    @property
    def targets(self) -> dict:
        """The R each series is held at: ``{"r": R}`` (global target), or ``{"r_text": .., "r_image": ..}`` with
        per-modality targets; ``{}`` for the unchunked baseline."""
        cfg = self.config
        if not cfg.chunked:
            return {}
        by_mod = cfg.target_r_by_modality
        if by_mod:
            names = {"0": "r_text", "1": "r_image"}
            return {names[str(m)]: float(r) for m, r in by_mod.items() if str(m) in names}
        return {"r": float(cfg.target_r)}

    def summary(self) -> dict:
        """What ``study.json`` and the match table show of the arm."""
        return {
            "name": self.name,
            "strategy": self.strategy,
            "chunking": self.config.chunking,
            "target_r": self.config.effective_r,
            "targets": self.targets,
            "overrides": self.overrides,
            "match_report": self.report,
            "serves": self.serves,
            "note": self.note,
            "train": self.train,
        }


def baseline_config(preset: str, tokenizer: str | None = None) -> ConceptMoEConfig:
    """The baseline preset at the vocabulary of ``tokenizer`` (the shipped one when None), as training builds it."""
    return ConceptMoEConfig.from_preset(preset, vocab_size=len(load_tokenizer(tokenizer)))


def _fields(cfg: ConceptMoEConfig) -> dict:
    return {k: copy.deepcopy(getattr(cfg, k)) for k in FIELDS}


def preset_overrides(preset_cfg: ConceptMoEConfig, cfg: ConceptMoEConfig) -> dict:
    """Every field of ``cfg`` that differs from ``preset_cfg``, less those the run sets itself."""
    base, mine = _fields(preset_cfg), _fields(cfg)
    return {k: v for k, v in mine.items() if base[k] != v and k not in SET_BY_RUN}


def build_arm(spec: dict, baseline: ConceptMoEConfig, chunked_defaults: dict) -> Arm:
    """One arm from its ``study.yaml`` entry (see the module docstring)."""
    name = spec["name"]
    serves, note = list(spec.get("serves") or ()), str(spec.get("note") or "")
    vlm_fields = dict(spec.get("vlm") or {})
    if spec.get("chunking") == "none":
        cfg, strategy = baseline, None
    else:
        strategy, target = spec.get("strategy", 1), spec.get("target_r")
        if target is None:
            raise ArmError(f"arm {name}: a chunked arm needs target_r")
        kwargs = {**chunked_defaults, **(spec.get("match") or {})}
        if spec.get("chunking"):
            kwargs["chunking"] = spec["chunking"]
        try:
            cfg = match(baseline, float(target), int(strategy), return_report=False, **kwargs)
            if spec.get("after_match"):
                cfg = ConceptMoEConfig(**{**_fields(cfg), **spec["after_match"]})
        except (ValueError, TypeError) as err:
            raise ArmError(f"arm {name}: {str(err).splitlines()[0]}") from None
    report = match_report(baseline, cfg)
    if not report["within_tolerance"]:
        raise ArmError(
            f"arm {name}: not compute-matched: params {100 * report['params_mismatch']:+.2f}%, linear FLOPs "
            f"{100 * report['flops_linear_mismatch']:+.2f}% (tolerance {100 * TOLERANCE:g}%); change its strategy"
        )
    try:  # VLM fields (image_chunking, modality_boundaries) checked now, not when the run starts training
        ConceptMoEVLMConfig(text_config=cfg, **vlm_fields)
    except (ValueError, TypeError) as err:
        raise ArmError(f"arm {name}: vlm: {str(err).splitlines()[0]}") from None
    overrides = {**preset_overrides(baseline, cfg), **vlm_fields}
    return Arm(name, cfg, overrides, report, strategy, serves, note, dict(spec.get("train") or {}))


def build_arms(study: dict, specs: list[dict]) -> list[Arm]:
    """Every arm of ``specs`` (the baseline first), matched against the baseline preset."""
    first = (study.get("stages") or [study["train_base"]])[0]
    tokenizer = (first.get("data") or {}).get("tokenizer")
    baseline = baseline_config(study["baseline"], tokenizer)
    return [build_arm(spec, baseline, dict(study.get("chunked_defaults") or {})) for spec in specs]


def format_report(arm: Arm) -> str:
    """One line of the match report, as the study prints it."""
    r = arm.report
    shape = ", ".join(f"{k}={v}" for k, v in arm.overrides.items()) or "the baseline itself"
    return (
        f"{arm.name}: params {100 * r['params_mismatch']:+.2f}%, "
        f"linear FLOPs/token {100 * r['flops_linear_mismatch']:+.2f}%, "
        f"attention FLOPs x{r['attn_flops_ratio']:.2f}, KV cache x{r['kv_cache_ratio']:.2f} "
        f"({'within' if r['within_tolerance'] else 'OUTSIDE'} {100 * TOLERANCE:g}%): {shape}"
    )


def stage_names(study: dict) -> list[str]:
    """The training stages of every run, in order: the config's ``stages``, then ``train`` (``train_base``)."""
    return [s["name"] for s in study.get("stages") or ()] + ["train"]


def train_yaml(study: dict, arm: Arm, seed: int, stage: str = "train", run: str = ".") -> dict:
    """The training config of one stage of (arm, seed): the stage's YAML (``train_base`` for ``train``) with the
    arm's ``train`` fields and the seed. The first stage builds the arm's model: ``model.preset`` the baseline and
    the arm's overrides over the stage's own (a tower's settings, say); every later stage starts from the export
    before it (``model.init_from: RUN/<previous stage>/hf``, the stage's own overrides kept: freezing, say). Shards
    default to the study's ``data.dir`` when it is one set."""
    names = stage_names(study)
    index = names.index(stage)
    base = copy.deepcopy(study["train_base"] if stage == "train" else study["stages"][index]) or {}
    base.pop("name", None)
    data = base.setdefault("data", {})
    if isinstance(study["data"], dict):
        shards = study["data"]["dir"]
        data.setdefault("shards", [f"{shards}/train"])
        data.setdefault("eval_shards", [f"{shards}/eval"])
    base["train"] = {**(base.get("train") or {}), **arm.train, "seed": int(seed)}
    own = dict((base.get("model") or {}).get("overrides") or {})
    if index == 0:
        model = {"preset": study["baseline"], "overrides": _plain({**own, **arm.overrides})}
    else:
        model = {"init_from": f"{run}/{names[index - 1]}/hf", **({"overrides": _plain(own)} if own else {})}
    return {"model": model, **{k: v for k, v in base.items() if k != "model"}}


def _plain(node):
    """Plain YAML-safe values (floats, ints, str-keyed dicts)."""
    if isinstance(node, dict):
        return {str(k): _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return node
