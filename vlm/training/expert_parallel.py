"""``train.expert_parallel: N`` on DeepSpeed: every MoE layer's routed experts split over N ranks, DeepSpeed's own
expert-parallel groups and MoE gradient reduction.

What DeepSpeed provides and is used as it is:

- the process groups: ``deepspeed.utils.groups._create_expert_and_data_parallel(N)`` makes the expert-parallel
  groups (N consecutive ranks: they exchange tokens) and the expert-data-parallel groups (the ranks holding the
  same experts: they reduce the experts' gradients), both named ``ep_size_N``;
- the parameter marking: each expert weight gets ``allreduce = False`` and ``group_name = "ep_size_N"``, as
  ``deepspeed.moe.experts.Experts`` marks its experts, so that ZeRO stages 0-2 reduce expert gradients over the
  expert-data-parallel group only (divided by the whole data-parallel size, as DeepSpeed does: the gradient
  equals the data-parallel average without EP), keep their optimizer state in their own groups
  (``deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer``) and count them once in the
  gradient norm;
- the engine's MoE switch: DeepSpeed turns its MoE handling on when the model holds a
  ``deepspeed.moe.layer.MoE``. The toolkit's layer keeps its own router, losses and dropless dispatch
  (``vlm.backbone.expert_parallel``), so each split layer is given a subclass that is also a DeepSpeed ``MoE``
  (``DeepSpeedExpertLayer``: nothing of DeepSpeed's layer runs, its ``__init__`` is never called).

Where this departs from DeepSpeed-MoE, and why: dispatch is dropless with variable split sizes (DeepSpeed's
``MOELayer`` pads every expert to a capacity), and the experts stay one stacked tensor per weight (grouped matmuls)
rather than one module per expert, so DeepSpeed's per-expert checkpoint files do not apply: each rank writes its
experts to ``expert_shard_RANK.safetensors`` inside the checkpoint instead (``save_expert_shard``), and resume
and export read those. ZeRO stage 3 is refused: DeepSpeed itself supports only its AutoEP layers there.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from vlm.backbone.expert_parallel import EXPERT_WEIGHTS, ExpertShard, shard_experts
from vlm.backbone.moe import MoE
from vlm.training.config import ConfigError

SHARD_PREFIX, SHARD_SUFFIX = "expert_shard_", ".safetensors"
SHARD_FILE = SHARD_PREFIX + "{rank:05d}" + SHARD_SUFFIX  # one per expert-parallel rank, in the checkpoint folder


def group_name(size: int) -> str:
    """DeepSpeed's name of the expert-parallel groups of size ``size``."""
    return f"ep_size_{size}"


def moe_layers(model: torch.nn.Module) -> dict[str, MoE]:
    """Every MoE layer of ``model`` by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def expert_parameters(model: torch.nn.Module) -> int:
    """The routed-expert parameters ``model`` holds (this rank's share when they are split)."""
    return sum(getattr(m, w).numel() for m in moe_layers(model).values() for w in EXPERT_WEIGHTS)


def check_expert_parallel(model: torch.nn.Module, size: int, world_size: int, zero_stage: int) -> None:
    """One-line ``ConfigError`` unless ``size`` divides the world size and every layer's expert count."""
    if size == 1:
        return
    layers = moe_layers(model)
    if not layers:
        raise ConfigError(f"train.expert_parallel={size} needs MoE layers; this model has none (ffn: dense)")
    if world_size % size:
        raise ConfigError(f"train.expert_parallel={size} must divide the number of processes ({world_size})")
    counts = sorted({m.num_experts for m in layers.values()})
    if any(n % size for n in counts):
        raise ConfigError(f"train.expert_parallel={size} must divide every layer's num_experts (here {counts})")
    if zero_stage == 3:
        raise ConfigError(
            "train.expert_parallel > 1 works with ZeRO stages 0-2; DeepSpeed's stage 3 takes only its AutoEP layers"
        )


@functools.cache
def _deepspeed_layer_class(cls: type) -> type:
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class DeepSpeedExpertLayer(cls, DeepSpeedMoE):
        """The toolkit's MoE layer, seen by the DeepSpeed engine as one of its MoE layers (module docstring); ``cls``
        comes first in the method order, so its ``forward`` runs."""

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups were made before the engine (enable_expert_parallel)

        @property
        def expert_group_name(self) -> str:
            return group_name(self.expert_shard.size)

        @property
        def ep_size(self) -> int:
            return self.expert_shard.size

        @property
        def num_local_experts(self) -> int:
            return 0  # DeepSpeed's per-expert files: none (the experts are saved by save_expert_shard)

    DeepSpeedExpertLayer.__name__ = DeepSpeedExpertLayer.__qualname__ = f"DeepSpeedExpert{cls.__name__}"
    return DeepSpeedExpertLayer


def enable_expert_parallel(model: torch.nn.Module, size: int) -> tuple[int, int]:
    """Split every MoE layer's experts over DeepSpeed's expert-parallel groups of ``size`` ranks (call after
    ``deepspeed.init_distributed`` and before ``deepspeed.initialize``; the weights must be equal on every rank).
    Returns (expert parameters this rank holds, expert parameters of the model)."""
    from deepspeed.utils import groups

    total = expert_parameters(model)
    name = group_name(size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    group = groups._get_expert_parallel_group(name)
    rank = dist.get_rank(group=group)
    for moe in moe_layers(model).values():
        shard_experts(moe, ExpertShard(group=group, size=size, rank=rank, num_experts=moe.num_experts))
        for weight in EXPERT_WEIGHTS:
            param = getattr(moe, weight)
            param.allreduce, param.group_name = False, name
        moe.__class__ = _deepspeed_layer_class(type(moe))
    return expert_parameters(model), total


def expert_parallel_size(model: torch.nn.Module) -> int:
    """N of a model whose experts are split (1 when they are not)."""
    shards = [m.expert_shard for m in moe_layers(model).values() if m.expert_shard is not None]
    return shards[0].size if shards else 1


def save_expert_shard(model: torch.nn.Module, folder: str) -> None:
    """This rank's experts into ``folder`` (written by the first rank of each expert-data-parallel group)."""
    size = expert_parallel_size(model)
    if size == 1:
        return
    from deepspeed.utils import groups

    if groups._get_expert_data_parallel_rank(group_name(size)) != 0:
        return
    rank = groups._get_expert_parallel_rank(group_name(size))
    tensors = {
        f"{path}.{weight}": getattr(moe, weight).detach().float().contiguous()
        for path, moe in moe_layers(model).items()
        for weight in EXPERT_WEIGHTS
    }
    save_file(tensors, os.path.join(folder, SHARD_FILE.format(rank=rank)), metadata={"expert_parallel": str(size)})


def load_expert_shard(model: torch.nn.Module, folder: str) -> None:
    """This rank's experts from ``folder`` (what ``save_expert_shard`` wrote)."""
    size = expert_parallel_size(model)
    if size == 1:
        return
    from deepspeed.utils import groups

    path = os.path.join(folder, SHARD_FILE.format(rank=groups._get_expert_parallel_rank(group_name(size))))
    tensors = load_file(path)
    with torch.no_grad():
        for name, moe in moe_layers(model).items():
            for weight in EXPERT_WEIGHTS:
                getattr(moe, weight).copy_(tensors[f"{name}.{weight}"])


def saved_expert_parallel(folder: str) -> int:
    """N of the run that wrote the checkpoint ``folder`` (1: no expert shard files)."""
    return sum(f.startswith(SHARD_PREFIX) and f.endswith(SHARD_SUFFIX) for f in os.listdir(folder)) or 1


def gather_expert_shards(state: dict, folder: str) -> dict:
    """A checkpoint's full state dict: ``state`` (the module weights rank 0 saved, holding its own experts only)
    with every expert weight replaced by the concatenation of all ranks' shards, in rank order."""
    n = saved_expert_parallel(folder)
    if n == 1:
        return state
    shards = [load_file(os.path.join(folder, SHARD_FILE.format(rank=r))) for r in range(n)]
    out = dict(state)
    for key in shards[0]:
        out[key] = torch.cat([shard[key] for shard in shards]).to(state[key].dtype)
    return out


def split_expert_state(state: dict, size: int) -> list[dict]:
    """The expert weights of a full state dict split for ``size`` ranks (rank ``r``'s shard, as
    ``save_expert_shard`` writes it); ``gather_expert_shards`` joins them back exactly."""
    keys = [k for k in state if k.rsplit(".", 1)[-1] in EXPERT_WEIGHTS]
    for key in keys:
        if state[key].shape[0] % size:
            raise ValueError(f"{key}: {state[key].shape[0]} experts do not split over {size} ranks")
    return [{k: state[k].chunk(size)[r].contiguous() for k in keys} for r in range(size)]
