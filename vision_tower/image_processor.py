"""Images -> NaFlex patch batches at native aspect ratio within a patch budget.

Each image is resized (aspect ratio kept) to the largest grid of ``patch_size * pixel_shuffle`` pixel blocks that fits
``max_patches`` and, unless ``upscale``, the image's own size (native resolution: a small image costs few tokens).
It is then normalised and cut into patches with timm's ``Patchify`` (channels-last flattening, (y, x) coordinates
in row-major order). Grids are multiples of ``pixel_shuffle`` in both dimensions, so a 2x2 pixel shuffle never
meets a ragged edge, and an image becomes ``gh * gw // pixel_shuffle**2`` language-model tokens.

``ImageProcessor`` is a transformers image processor (``BaseImageProcessor``): ``save_pretrained`` writes
``preprocessor_config.json``, and ``from_pretrained`` / ``AutoImageProcessor`` (registered by ``import vlm``) read it,
the ``image_processor`` entry of a processor's ``processor_config.json``, or the legacy ``image_processor_config.json``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from timm.data import Patchify
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.utils import IMAGE_PROCESSOR_NAME, PROCESSOR_NAME

logger = logging.getLogger(__name__)

CONFIG_NAME = IMAGE_PROCESSOR_NAME  # "preprocessor_config.json", HF's name
LEGACY_CONFIG_NAME = "image_processor_config.json"  # written before the processor became a transformers one
_CONFIG_FILES = (PROCESSOR_NAME, CONFIG_NAME, LEGACY_CONFIG_NAME)  # where a folder's settings are looked up, in order
_LOADING_KWARGS = (
    "cache_dir",
    "force_download",
    "proxies",
    "token",
    "local_files_only",
    "revision",
    "subfolder",
    "image_processor_filename",
    "_from_pipeline",
    "_from_auto",
)
SETTINGS = ("patch_size", "max_patches", "pixel_shuffle", "mean", "std", "upscale")
_HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
_VALUE_RANGES = {"I": (255.0, 65535.0), "F": (1.0, 255.0, 65535.0)}  # candidate white levels, smallest first


def fit_grid(height: int, width: int, block: int, budget: int, upscale: bool = False) -> tuple[int, int]:
    """Blocks (bh, bw) at the largest scale s whose grid fits bh * bw <= budget, with s <= 1 unless ``upscale``.

    The grid at scale s is (max(1, floor(height * s / block)), max(1, floor(width * s / block))): the block-aligned
    image never exceeds the scaled one, so each side keeps the aspect ratio to within one block. The grid changes
    only where a side fills whole blocks (s = k * block / side), so trying those scales is exact and needs no float
    search (timm's ``get_image_size_for_seq`` binary search gives up below 1/100 of the budget, e.g. on 1x1).
    """
    best, best_scale = (1, 1), (0, 1)  # scale as a fraction (num, den), compared by cross-multiplication
    for side, other, swap in ((height, width, False), (width, height, True)):
        k = 1
        while upscale or k * block <= side:  # s = k * block / side <= 1: never enlarge past the native size
            k_other = max(1, other * k // side)  # the other side's blocks at this scale
            if k * k_other > budget:
                break  # k * k_other grows with k
            if k * best_scale[1] > best_scale[0] * side:
                best_scale, best = (k, side), ((k_other, k) if swap else (k, k_other))
            k += 1
    return best


def _to_rgb(image: Image.Image) -> Image.Image:
    """An 'RGB' image, or an 'F' image in [0, 1] for high-bit-depth grayscale (kept in float: no 8-bit clipping).

    Alpha is composited over white. 'I;16*' is read as 16-bit; 'I' as 8- or 16-bit and 'F' as [0, 1], 8- or
    16-bit, the smallest range that holds the image's maximum (these modes carry no range of their own); values
    outside clip to [0, 1].
    """
    if image.mode in _HIGH_DEPTH_MODES:
        a = np.nan_to_num(np.asarray(image, dtype=np.float32), nan=0.0)
        top = float(a.max())
        ranges = _VALUE_RANGES.get(image.mode, (65535.0,))  # the I;16 family is 16-bit by definition
        scale = next((s for s in ranges if top <= s), top)
        return Image.fromarray(np.clip(a / scale, 0.0, 1.0).astype(np.float32))  # float32 2-D -> mode "F"
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = (image.convert("LA") if image.mode == "La" else image).convert("RGBA")  # PIL: no La -> RGBA
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_image(image, index: int) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"ImageProcessor expects PIL.Image.Image items; item {index} is a {type(image).__name__}")
    if image.width < 1 or image.height < 1:
        raise ValueError(f"ImageProcessor: image {index} is empty ({image.width}x{image.height})")
    return image


class ImageProcessor(BaseImageProcessor):
    """PIL images -> ``patches`` / ``patch_coord`` / ``patch_valid`` / ``grid_hw`` / ``num_tokens`` tensors.

    ``max_patches`` is the budget before the pixel shuffle (``max_patches // pixel_shuffle**2`` LM tokens per image at
    most). Large images shrink into the budget; small ones keep their resolution (rounded down to whole blocks), or with
    ``upscale=True`` grow to fill the budget as timm's NaFlex transforms / SigLIP-2 do. Every image gets at least
    one ``pixel_shuffle x pixel_shuffle`` block.

    A transformers ``BaseImageProcessor`` for saving, loading and the Auto classes; the pixels are its own (the
    backends' resize / crop kwargs do not apply), and ``preprocess`` takes one image (see below).
    """

    model_input_names = ["patches", "patch_coord", "patch_valid", "grid_hw", "num_tokens"]

    def __init__(
        self,
        patch_size: int = 16,
        max_patches: int = 256,
        pixel_shuffle: int = 2,
        mean: Sequence[float] = (0.5, 0.5, 0.5),
        std: Sequence[float] = (0.5, 0.5, 0.5),
        upscale: bool = False,
    ):
        def need(ok: bool, name: str, rule: str, value) -> None:
            if not ok:
                raise ValueError(f"ImageProcessor: {name} {rule}, got {value!r}")

        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        need(is_int(patch_size) and patch_size >= 1, "patch_size", "must be a positive int", patch_size)
        need(pixel_shuffle in (1, 2, 4) and is_int(pixel_shuffle), "pixel_shuffle", "must be 1, 2 or 4", pixel_shuffle)
        need(is_int(max_patches), "max_patches", "must be an int", max_patches)
        need(
            max_patches >= pixel_shuffle**2,
            "max_patches",
            f"must be >= pixel_shuffle**2 = {pixel_shuffle**2}",
            max_patches,
        )
        for name, values in (("mean", mean), ("std", std)):
            ok = isinstance(values, Sequence) and len(values) == 3 and all(isinstance(v, int | float) for v in values)
            need(ok, name, "must be 3 numbers (one per RGB channel)", values)
        need(all(s > 0 for s in std), "std", "must be > 0", std)
        need(isinstance(upscale, bool), "upscale", "must be a bool", upscale)
        super().__init__()
        self.patch_size, self.max_patches, self.pixel_shuffle = patch_size, max_patches, pixel_shuffle
        self.mean, self.std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
        self.upscale = upscale
        self._patchify = Patchify(patch_size, channels_last=True)

    # ------------------------------------------------------------------ sizes (arithmetic only)
    def grid_for(self, height: int, width: int) -> tuple[int, int]:
        """Patch grid (gh, gw) of an image of this pixel size; both are multiples of ``pixel_shuffle``."""
        block, budget = self.patch_size * self.pixel_shuffle, self.max_patches // self.pixel_shuffle**2
        bh, bw = fit_grid(height, width, block, budget, self.upscale)
        return bh * self.pixel_shuffle, bw * self.pixel_shuffle

    def num_tokens_for(self, image: Image.Image) -> int:
        """How many LM tokens ``image`` becomes, from its size alone (no pixels are read)."""
        gh, gw = self.grid_for(_check_image(image, 0).height, image.width)
        return gh * gw // self.pixel_shuffle**2

    # ------------------------------------------------------------------ pixels
    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """One image -> normalised float tensor [3, gh * patch_size, gw * patch_size] (before patchifying)."""
        gh, gw = self.grid_for(_check_image(image, 0).height, image.width)
        size = (gw * self.patch_size, gh * self.patch_size)  # PIL sizes are (width, height)
        img = _to_rgb(image)
        img = img if img.size == size else img.resize(size, Image.Resampling.BICUBIC)
        if img.mode == "F":  # float grayscale: bicubic may overshoot [0, 1]
            x_3HW = torch.from_numpy(np.array(img, dtype=np.float32)).clamp_(0, 1)[None].expand(3, -1, -1)
        else:
            x_3HW = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float() / 255.0
        mean, std = torch.tensor(self.mean)[:, None, None], torch.tensor(self.std)[:, None, None]
        return (x_3HW - mean) / std

    def __call__(self, images: Sequence[Image.Image] | Image.Image, return_tensors: str | None = "pt") -> BatchFeature:
        """A batch of n images (n may be 0; a single image counts as a batch of one), padded to the longest.

        Returns a ``BatchFeature`` (a mapping) of torch tensors; ``return_tensors`` is there for HF callers
        (``"pt"`` or None, both torch)."""
        if return_tensors not in ("pt", None):
            raise ValueError(f"ImageProcessor: return_tensors={return_tensors!r} is not supported; use 'pt'")
        if isinstance(images, Image.Image):
            images = [images]
        if isinstance(images, str | bytes) or not isinstance(images, Sequence):
            raise TypeError(f"ImageProcessor expects a sequence of PIL images, got a {type(images).__name__}")
        images = [_check_image(image, i) for i, image in enumerate(images)]
        per_image = [self._patchify(self.preprocess(image)) for image in images]
        n, dim = len(images), self.patch_size * self.patch_size * 3
        length = max((len(p["patches"]) for p in per_image), default=0)
        out = {
            "patches": torch.zeros(n, length, dim),
            "patch_coord": torch.zeros(n, length, 2, dtype=torch.long),  # padding at (0, 0): timm reads max coords
            "patch_valid": torch.zeros(n, length, dtype=torch.bool),
            "grid_hw": torch.tensor([self.grid_for(im.height, im.width) for im in images], dtype=torch.long).view(n, 2),
        }
        for i, p in enumerate(per_image):
            k = len(p["patches"])
            out["patches"][i, :k] = p["patches"]
            out["patch_coord"][i, :k] = p["patch_coord"]
            out["patch_valid"][i, :k] = True
        out["num_tokens"] = out["grid_hw"].prod(-1) // self.pixel_shuffle**2
        return BatchFeature(data=out)

    # ------------------------------------------------------------------ persistence (HF-style)
    def to_dict(self) -> dict:
        return {
            "image_processor_type": type(self).__name__,
            "patch_size": self.patch_size,
            "max_patches": self.max_patches,
            "pixel_shuffle": self.pixel_shuffle,
            "mean": list(self.mean),
            "std": list(self.std),
            "upscale": self.upscale,
        }

    def save_pretrained(self, save_directory: str | Path, push_to_hub: bool = False, **kwargs) -> Path:
        """Writes ``preprocessor_config.json`` into ``save_directory``; returns its path."""
        return Path(super().save_pretrained(str(save_directory), push_to_hub=push_to_hub, **kwargs)[0])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, **kwargs) -> ImageProcessor:
        """From a folder holding ``processor_config.json`` (a processor's, ``image_processor`` entry),
        ``preprocessor_config.json`` or the legacy ``image_processor_config.json`` (in that order), from one of
        those files itself, or a Hub id. ``kwargs`` may override settings (``max_patches=...``)."""
        path = Path(str(pretrained_model_name_or_path)).expanduser()
        folder = path / kwargs.get("subfolder", "")
        missing = FileNotFoundError(
            f"ImageProcessor.from_pretrained: no {CONFIG_NAME} (nor {PROCESSOR_NAME}, nor the legacy "
            f"{LEGACY_CONFIG_NAME}) at {folder}"
        )
        if path.is_dir() and not any((folder / name).is_file() for name in _CONFIG_FILES):
            raise missing
        if not path.exists() and (path.is_absolute() or str(pretrained_model_name_or_path).startswith((".", "~"))):
            raise missing  # a local path, not a Hub id
        return super().from_pretrained(str(path) if path.exists() else pretrained_model_name_or_path, **kwargs)

    @classmethod
    def get_image_processor_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict, dict]:
        """transformers' lookup (a processor config's ``image_processor`` entry, else ``preprocessor_config.json``),
        plus a file given directly (a processor config too) and folders with only the legacy file."""
        path = Path(str(pretrained_model_name_or_path))
        folder = path / kwargs.get("subfolder", "")
        legacy = folder / LEGACY_CONFIG_NAME
        only_legacy = legacy.is_file() and not any((folder / name).is_file() for name in _CONFIG_FILES[:2])
        if path.is_file() or only_legacy:
            config = json.loads((path if path.is_file() else legacy).read_text())
            for name in _LOADING_KWARGS:
                kwargs.pop(name, None)
            nested = config.get("image_processor")
            return (nested if isinstance(nested, dict) else config), kwargs
        return super().get_image_processor_dict(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_dict(cls, image_processor_dict: dict, **kwargs):
        """The settings of a saved config (type keys dropped, the pre-rename ``merge`` read as ``pixel_shuffle``,
        unknown keys ignored with a warning), overridden by those in ``kwargs``."""
        config = dict(image_processor_dict)
        return_unused_kwargs = kwargs.pop("return_unused_kwargs", False)
        for key in ("image_processor_type", "processor_class", "feature_extractor_type", "auto_map"):
            config.pop(key, None)
        if "merge" in config:  # the field's name before it was renamed: files saved then still load
            config.setdefault("pixel_shuffle", config.pop("merge"))
        if unknown := sorted(set(config) - set(SETTINGS)):
            logger.warning("ImageProcessor.from_pretrained: ignoring unknown keys %s", unknown)
        settings = {k: v for k, v in config.items() if k in SETTINGS}
        settings.update({k: kwargs.pop(k) for k in SETTINGS if k in kwargs})
        processor = cls(**settings)
        return (processor, kwargs) if return_unused_kwargs else processor

    @classmethod
    def from_json_file(cls, json_file: str | Path) -> ImageProcessor:
        return cls.from_dict(json.loads(Path(json_file).read_text()))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items() if k != "image_processor_type")
        return f"{type(self).__name__}({args})"
