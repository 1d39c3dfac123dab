"""The image encoder: a timm NaFlexViT (native aspect ratio, padded patch batches) or a plain timm ViT.

Both take the ``ImageProcessor`` batch (patches, (y, x) coordinates, validity) and return per-patch features aligned
with the input patches, prefix tokens (class / register) dropped and padding rows zeroed.
"""

# Shape suffixes (docs/paper.md §0): B images of the patch batch, b the images of one size, L patches per image,
# D feature width, P values per patch (patch_size² × 3), V the valid patches of the batch flattened, 2 a (y, x) pair.

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
from torch import nn

from vision_tower.pool import AttentionPool
from vision_tower.stem import STEMS, PatchConvStem
from vision_tower.words import WORD_PREFIX, WordHead

logger = logging.getLogger(__name__)

# VisionTower's pos_embed names -> timm keyword arguments, per model family (timm 1.0.31).
# NaFlexViT reads any pos_embed other than 'factorized' / 'none' as 'learned'; RoPE is its own switch (rope_type).
_POS_EMBED = {
    "naflex": {
        "learned": dict(pos_embed="learned"),
        "factorized": dict(pos_embed="factorized"),
        "rope": dict(pos_embed="none", rope_type="axial"),
        "none": dict(pos_embed="none"),
    },
    "vit": {"learned": dict(pos_embed="learn"), "none": dict(pos_embed="none")},
}
_WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
SUMMARY_PREFIX = "summary_pool."  # a tower file's keys of the summary pool (VisionTower(summary=True))


@dataclass
class VisionFeatures:
    """Per-patch features aligned with the input patches: row i, slot l is patch l of image i."""

    features_BLD: torch.Tensor  # zero where not valid
    valid_BL: torch.Tensor  # bool
    coord_BL2: torch.Tensor  # long (y, x) on the patch grid


def _family(model_name: str) -> str:
    if model_name.startswith("naflexvit"):
        return "naflex"
    if model_name.startswith("vit_"):
        return "vit"
    raise ValueError(f"VisionTower: model_name must be a timm 'naflexvit_*' or 'vit_*' model, got {model_name!r}")


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` / ``.pth`` / ``.pt`` / ``.bin`` (tensors only: never unpickles code)."""
    path = Path(path)
    if path.suffix not in _WEIGHT_SUFFIXES:
        raise ValueError(f"VisionTower: weights must be a {' / '.join(_WEIGHT_SUFFIXES)} file, got {str(path)!r}")
    if not path.is_file():
        raise FileNotFoundError(f"VisionTower: weights file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):  # common training-checkpoint wrappers
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    return state


def load_timm_weights(model: nn.Module, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """Load a local state dict (``state``, else read from ``path``) into the timm ``model`` strictly; a mismatch
    raises one ValueError listing every difference.

    Accepted key layouts: the timm model's own, or a ``VisionTower``'s (``model.`` prefix). A timm classifier
    (``head.*``), the tower's summary pool (``summary_pool.*``) and word head (``word_head.*``) are not the timm
    model's and are dropped here.
    """
    state = load_state_dict_file(path) if state is None else state
    state = {k: v for k, v in state.items() if not k.startswith((SUMMARY_PREFIX, WORD_PREFIX))}
    if state and all(k.startswith("model.") for k in state):
        state = {k[len("model.") :]: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if state[k].shape != own[k].shape
    ]
    if missing or unexpected or mismatched:

        def show(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "") or "none"

        raise ValueError(
            f"VisionTower: weights {str(path)!r} do not fit {type(model).__name__} "
            f"(check model_name / embed_dim / depth / num_heads / patch_size / pos_embed). "
            f"Missing keys: {show(missing)}. Unexpected keys: {show(unexpected)}. Shape mismatches: {show(mismatched)}."
        )
    model.load_state_dict(state, strict=True)
    logger.info("VisionTower: loaded %d tensors from %s", len(state), path)


class VisionTower(nn.Module):
    """A timm ViT as the VLM's image encoder; random init unless ``weights`` (local file) or ``pretrained``.

    ``embed_dim`` / ``depth`` / ``num_heads`` / ``patch_size`` override the named model's size (``None`` keeps the
    model's own, which ``pretrained=True`` needs). ``pos_embed``: ``None`` (the model's default), ``'learned'``,
    ``'none'``, and for NaFlexViT also ``'factorized'`` and ``'rope'`` (axial 2-D RoPE). ``stem``: ``'linear'``
    (timm's patch embedding) or, for NaFlexViT, ``'conv'`` (:class:`~vision_tower.stem.PatchConvStem`, three
    convolutions inside each patch; its weights are part of the tower's state dict). ``summary=True`` adds
    ``summary_pool`` (:class:`~vision_tower.pool.AttentionPool`), read by :meth:`summarize`: one vector per image,
    loaded from ``weights`` with the rest (its ``summary_pool.*`` keys, as ``scripts/pretrain_vision.py`` writes
    them). ``words``: ``0`` (none), the number of words of a :class:`~vision_tower.words.WordHead` (its detectors,
    read from ``weights``' ``word_head.*`` keys when given), or ``True``: as many as ``weights`` holds. Extra keyword
    arguments go to ``timm.create_model`` unchanged.
    """

    def __init__(
        self,
        model_name: str = "naflexvit_base_patch16_gap",
        embed_dim: int | None = 192,
        depth: int | None = 2,
        num_heads: int | None = 3,
        patch_size: int | None = 16,
        pos_embed: str | None = None,
        weights: str | Path | None = None,
        pretrained: bool = False,
        stem: str = "linear",
        summary: bool = False,
        words: bool | int = 0,
        **timm_kwargs,
    ):
        super().__init__()
        self.family = _family(model_name)
        if stem not in STEMS or (stem == "conv" and (self.family != "naflex" or pretrained)):
            raise ValueError(
                f"VisionTower: stem must be one of {STEMS} ('conv' needs a naflexvit model and no "
                f"pretrained timm weights, whose patch embedding is linear), got {stem!r}"
            )
        if not timm.is_model(model_name):
            raise ValueError(f"VisionTower: model_name {model_name!r} is not a timm model (see timm.list_models)")
        sizes = dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, patch_size=patch_size)
        kwargs = {k: v for k, v in sizes.items() if v is not None}
        if pos_embed is not None:
            options = _POS_EMBED[self.family]
            if pos_embed not in options:
                raise ValueError(f"VisionTower: pos_embed must be None or one of {sorted(options)}, got {pos_embed!r}")
            kwargs.update(options[pos_embed])
        if self.family == "vit":
            kwargs["dynamic_img_size"] = True  # any grid, position embeddings resampled per size
        kwargs.update(timm_kwargs)
        self.model_name = model_name
        self.model = timm.create_model(model_name, pretrained=pretrained, num_classes=0, **kwargs)
        self.patch_size = int(
            (self.model.patch_embed.patch_size if self.family == "vit" else self.model.get_patch_size())[0]
        )
        self.num_prefix_tokens = int(self.model.num_prefix_tokens)
        self.stem = stem
        if stem == "conv":  # NaFlexEmbeds applies ``proj`` to the [B, N, p*p*3] patches
            self.model.embeds.proj = PatchConvStem(self.patch_size, self.out_dim)
        self.summary_pool = AttentionPool(self.out_dim) if summary else None
        state = None if weights is None else load_state_dict_file(weights)
        self.word_head = None
        if words:
            count = int(words)
            if words is True:  # as many as the weights file names
                count = len(state.get(WORD_PREFIX + "ids_K", ())) if state is not None else 0
            if count < 1:
                raise ValueError(
                    f"VisionTower: words={words!r} needs a word count, or a weights file with {WORD_PREFIX}* keys "
                    "(scripts/pretrain_vision.py --region-labels / --patch-labels writes them)"
                )
            self.add_word_head([0] * count)  # the ids come with the weights
        if weights is not None:
            self._load(weights, state)

    def add_word_head(self, word_ids) -> WordHead:
        """Give the tower a :class:`~vision_tower.words.WordHead` over ``word_ids`` (stage 0 trains it)."""
        self.word_head = WordHead(self.out_dim, word_ids)
        return self.word_head

    def _load(self, path: str | Path, state: dict[str, torch.Tensor]) -> None:
        load_timm_weights(self.model, path, state)
        if self.word_head is not None:
            self._load_part(self.word_head, WORD_PREFIX, state, path, "words=True", "word head")
        if self.summary_pool is not None:
            self._load_part(self.summary_pool, SUMMARY_PREFIX, state, path, "summary=True", "summary pool")

    def _load_part(self, part: nn.Module, prefix: str, state: dict, path, option: str, what: str) -> None:
        part_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        own = part.state_dict()
        if set(part_state) != set(own) or any(part_state[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"VisionTower: {option} needs the {what}'s weights in {str(path)!r} ({prefix}* keys "
                f"of a {self.out_dim}-wide {what}, as scripts/pretrain_vision.py writes them); found "
                f"{len(part_state)} {prefix}* tensors that do not fit"
            )
        part.load_state_dict(part_state, strict=True)

    @property
    def out_dim(self) -> int:
        return int(self.model.embed_dim)

    def require_summary_pool(self) -> VisionTower:
        """``self``, or a ValueError when the tower was built without ``summary=True``."""
        if self.summary_pool is None:
            raise ValueError("VisionTower: this needs the tower's summary pool: build it with summary=True")
        return self

    def summarize(self, feats: VisionFeatures) -> torch.Tensor:
        """[B, D]: each image's summary, the summary pool's attention over its valid patch features."""
        return self.require_summary_pool().summary_pool(feats.features_BLD, feats.valid_BL)

    def require_word_head(self) -> WordHead:
        """The tower's word head, or a ValueError when it has none."""
        if self.word_head is None:
            raise ValueError(
                "VisionTower: this needs the tower's word head: build it with words=True and a tower file trained "
                "with scripts/pretrain_vision.py --region-labels (or --patch-labels)"
            )
        return self.word_head

    def word_probs(self, feats: VisionFeatures) -> torch.Tensor:
        """[B, L, K]: each patch's probability of every word of the word head; zero on padding."""
        probs_BLK = torch.sigmoid(self.require_word_head()(feats.features_BLD).float())
        return probs_BLK * feats.valid_BL[..., None]

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.model.set_grad_checkpointing(enable)

    def forward(self, patches: torch.Tensor, patch_coord: torch.Tensor, patch_valid: torch.Tensor) -> VisionFeatures:
        """patches [n, L, p*p*3] (channels-last flattening), patch_coord [n, L, 2] (y, x), patch_valid [n, L].

        Valid patches must come first in each row, in row-major order of the image's grid (as ``ImageProcessor``
        makes them): NaFlexViT (timm 1.0.31) adds its position embeddings (learned, factorized and RoPE alike) by
        slot, for the grid its largest coordinates give, not by each patch's own coordinate.
        """
        n, length = patch_valid.shape
        valid_BL = patch_valid.bool()
        # padding at (0, 0): NaFlexViT sizes each image's position grid from its largest coordinates, padding included
        coord_BL2 = torch.where(
            valid_BL[..., None], patch_coord.long(), torch.zeros_like(patch_coord, dtype=torch.long)
        )
        dtype = next(self.model.parameters()).dtype
        patches = patches.to(dtype)
        if n == 0:
            features_BLD = patches.new_zeros(0, length, self.out_dim)
        elif self.family == "naflex":
            out = self.model.forward_features(patches, patch_coord=coord_BL2, patch_valid=valid_BL)
            features_BLD = out["patches"][:, self.num_prefix_tokens :]
        else:
            features_BLD = self._forward_per_size(patches, coord_BL2, valid_BL)
        features_BLD = torch.where(valid_BL[..., None], features_BLD, torch.zeros_like(features_BLD))
        return VisionFeatures(features_BLD=features_BLD, valid_BL=valid_BL, coord_BL2=coord_BL2)

    def _forward_per_size(self, patches_BLP: torch.Tensor, coord_BL2: torch.Tensor, valid_BL: torch.Tensor):
        """Plain ViT: rebuild each image from its valid patches and run the images of one grid size together."""
        n, length, _ = patches_BLP.shape
        p = self.patch_size
        grid_B2 = coord_BL2.amax(1) + 1  # padding coordinates are (0, 0)
        b_V, l_V = valid_BL.nonzero(as_tuple=True)
        y_V, x_V = coord_BL2[b_V, l_V].unbind(-1)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, ((gh, gw), has_patches) in enumerate(zip(grid_B2.tolist(), valid_BL.any(1).tolist())):
            if has_patches:
                groups.setdefault((gh, gw), []).append(i)
        features_BLD = patches_BLP.new_zeros(n, length, self.out_dim)
        if not groups:
            return features_BLD
        out_rows, out_vals = [], []
        for (gh, gw), members in groups.items():
            members_b = torch.tensor(members, device=patches_BLP.device)
            row_of_B = torch.full((n,), -1, dtype=torch.long, device=patches_BLP.device)
            row_of_B[members_b] = torch.arange(len(members), device=patches_BLP.device)
            in_group_V = row_of_B[b_V] >= 0
            g_V, cell_V = row_of_B[b_V][in_group_V], (y_V * gw + x_V)[in_group_V]
            grid_bLP = patches_BLP.new_zeros(len(members), gh * gw, patches_BLP.shape[-1])
            grid_bLP = grid_bLP.index_put((g_V, cell_V), patches_BLP[b_V[in_group_V], l_V[in_group_V]])
            # [b, gh*gw, p*p*3] -> [b, gh, gw, p, p, 3] -> [b, 3, gh, p, gw, p] -> [b, 3, gh*p, gw*p] (pixels)
            images = grid_bLP.view(len(members), gh, gw, p, p, 3).permute(0, 5, 1, 3, 2, 4)
            images = images.reshape(len(members), 3, gh * p, gw * p)
            feats_bLD = self.model.forward_features(images)[:, self.num_prefix_tokens :]
            out_rows.append((b_V[in_group_V], l_V[in_group_V]))
            out_vals.append(feats_bLD[g_V, cell_V])
        b_idx, l_idx = (torch.cat(t) for t in zip(*out_rows))
        return features_BLD.index_put((b_idx, l_idx), torch.cat(out_vals))
