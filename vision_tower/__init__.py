"""vision_tower: images -> patch batches (ImageProcessor) -> per-patch features (VisionTower, timm NaFlexViT or
ViT) -> pixel-shuffle merge -> Projector into the backbone width."""

from vision_tower.image_processor import ImageProcessor, fit_grid
from vision_tower.merge import pixel_shuffle_merge
from vision_tower.projector import Projector
from vision_tower.tower import VisionFeatures, VisionTower, load_timm_weights

__all__ = [
    "ImageProcessor",
    "Projector",
    "VisionFeatures",
    "VisionTower",
    "fit_grid",
    "load_timm_weights",
    "pixel_shuffle_merge",
]
