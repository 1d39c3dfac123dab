"""Reading a source MoE checkpoint folder for ``vlm.accounting.convert``, checked before any weight is read: every
tensor the architecture has must be stored (safetensors, any sharding, fused or per-expert layout) with its shape;
a missing, misshapen or unknown tensor, or an unreadable file, is a one-line :class:`ConversionError`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig

logger = logging.getLogger(__name__)
MAX_LISTED = 5  # tensor names quoted in one error or warning line


class ConversionError(ValueError):
    """A source that cannot be converted completely and exactly (missing / misshapen / unknown tensors, an
    unreadable file or config); the message is one line."""


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def listed(items: list[str]) -> str:
    """The first ``MAX_LISTED`` items, then how many more."""
    more = f", ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def saved_shapes(hf_config: PretrainedConfig, fam, per_expert: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the source model with its shape, from a weightless (meta) build: fused experts, or
    (``per_expert``) as ``save_pretrained`` writes them, one gate / up / down tensor per expert."""
    try:
        with torch.device("meta"):
            sd = AutoModelForCausalLM.from_config(hf_config).state_dict()
    except (ValueError, TypeError, AttributeError, RuntimeError) as e:
        raise ConversionError(f"config.json describes no buildable model ({first_line(e)})") from None
    out = {}
    for key, t in sd.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)", key)
        if not per_expert or m is None:
            out[key] = tuple(t.shape)
            continue
        moe, what = f"{m.group(1)}{fam.saved_moe}.", m.group(2)
        gate, up, down = (f"{moe}experts.{{}}.{name}.weight" for name in fam.saved_experts)
        if what == "gate.weight":
            out[moe + what] = tuple(t.shape)
        elif what == "experts.gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
            out |= {name.format(j): (t.shape[1] // 2, t.shape[2]) for j in range(t.shape[0]) for name in (gate, up)}
        else:  # [E, D, F]
            out |= {down.format(j): tuple(t.shape[1:]) for j in range(t.shape[0])}
    return out


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (a missing shard shows up as missing tensors)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{folder}: no *.safetensors weights (only safetensors checkpoints can be converted)")
    return files


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Tensor name -> (file, shape), from the headers only; a truncated or corrupt file is refused."""
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(file, "pt") as f:
                found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{file}: not a readable safetensors file ({first_line(e)})") from None
        twice = sorted(set(found) & set(where))
        if twice:
            raise ConversionError(f"{file}: tensors also stored in another shard ({listed(twice)})")
        where |= {k: (file, shape) for k, shape in found.items()}
    return where


def check_tensors(src, found: dict, expected: dict, optional: set[str], allow_extra: bool) -> list[str]:
    """Refuse (one line) missing tensors, wrong shapes and, unless ``allow_extra``, unknown tensors; returns
    the unknown ones."""
    missing = [k for k in expected if k not in found and k not in optional]
    wrong = [f"{k} {list(found[k][1])} != {list(v)}" for k, v in expected.items() if k in found and found[k][1] != v]
    extra = sorted(set(found) - set(expected))
    problems = [f"{len(missing)} missing ({listed(missing)})"] if missing else []
    problems += [f"{len(wrong)} with a wrong shape ({listed(wrong)})"] if wrong else []
    if extra and not allow_extra:
        problems.append(f"{len(extra)} not in the architecture ({listed(extra)}; --allow-extra ignores them)")
    if problems:
        raise ConversionError(f"{src}: cannot convert the checkpoint exactly, tensors: " + "; ".join(problems))
    return extra


def _load(found: dict, keys: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted({found[k][0] for k in keys}):
        try:
            with safe_open(file, "pt") as f:
                out |= {k: f.get_tensor(k) for k in keys if found[k][0] == file}
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"{file}: cannot read tensors ({first_line(e)})") from None
    return out


def _fuse_experts(sd: dict[str, torch.Tensor], fam, layers: int, experts: int) -> None:
    """In place: the saved per-expert tensors -> HF's in-memory layout, ``mlp.experts.gate_up_proj`` [E, 2F, D]
    (gate rows first) and ``mlp.experts.down_proj`` [E, D, F], and the router under ``mlp.gate``."""
    for i in range(layers):
        moe = f"model.layers.{i}.{fam.saved_moe}."
        gate, up, down = ([sd.pop(f"{moe}experts.{j}.{n}.weight") for j in range(experts)] for n in fam.saved_experts)
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(down)
        sd[f"model.layers.{i}.mlp.gate.weight"] = sd.pop(moe + "gate.weight")


def read_checkpoint(src: str | os.PathLike, hf_config: PretrainedConfig, fam, allow_extra: bool = False):
    """(state dict in HF's in-memory layout, unknown tensors left out) of a checked checkpoint folder of the
    family ``fam`` (a ``vlm.accounting.convert.Family``)."""
    found = _headers(_shard_files(Path(src)))
    per_expert = not any(k.endswith(".experts.gate_up_proj") for k in found)  # save_pretrained's layout
    expected = saved_shapes(hf_config, fam, per_expert)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    extra = check_tensors(src, found, expected, {"lm_head.weight"} if tied else set(), allow_extra)
    if extra:
        logger.warning("%s: ignoring %d tensors not in the architecture: %s", src, len(extra), listed(extra))
    sd = _load(found, [k for k in expected if k in found])
    if per_expert:
        _fuse_experts(sd, fam, hf_config.num_hidden_layers, getattr(hf_config, fam.experts))
    if tied:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    return sd, extra
