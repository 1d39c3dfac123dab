"""ConceptMoE backbone and VLM: ``from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM``.

The models and configs are imported and registered with the HF Auto classes here (AutoConfig, AutoModel,
AutoModelForCausalLM, AutoModelForImageTextToText, AutoImageProcessor, AutoProcessor), so that an exported folder
loads with ``AutoProcessor`` / ``AutoModelForImageTextToText`` / ``pipeline("image-text-to-text", model=DIR)``.
``VLMProcessor`` is resolved on first use (PEP 562), and AutoProcessor holds a stand-in that imports it when a
processor is loaded, so ``import vlm`` does not load the tokenizer code of ``data_pipelines``.
"""

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

from vision_tower import ImageProcessor
from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM, ConceptMoEModel
from vlm.backbone.outputs import ConceptMoECausalLMOutput
from vlm.config import ConceptMoEVLMConfig
from vlm.model import ConceptMoEVLM


class _VLMProcessorOnFirstUse:
    """AutoProcessor's entry for ``ConceptMoEVLMConfig`` until a processor is loaded: transformers finds it by its
    name (``processor_class`` in ``processor_config.json``) and calls ``from_pretrained``, which imports
    ``vlm.processor`` and puts the real class in its place."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        from vlm.processor import VLMProcessor

        AutoProcessor.register(ConceptMoEVLMConfig, VLMProcessor, exist_ok=True)
        return VLMProcessor.from_pretrained(*args, **kwargs)


_VLMProcessorOnFirstUse.__name__ = _VLMProcessorOnFirstUse.__qualname__ = "VLMProcessor"

AutoConfig.register(ConceptMoEConfig.model_type, ConceptMoEConfig, exist_ok=True)
AutoModel.register(ConceptMoEConfig, ConceptMoEModel, exist_ok=True)
AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)
AutoConfig.register(ConceptMoEVLMConfig.model_type, ConceptMoEVLMConfig, exist_ok=True)
AutoModel.register(ConceptMoEVLMConfig, ConceptMoEVLM, exist_ok=True)
AutoModelForImageTextToText.register(ConceptMoEVLMConfig, ConceptMoEVLM, exist_ok=True)
# one class for both backends: its pixels are its own (PIL in, torch out)
AutoImageProcessor.register(
    ConceptMoEVLMConfig, image_processor_classes={"pil": ImageProcessor, "torchvision": ImageProcessor}, exist_ok=True
)
AutoProcessor.register(ConceptMoEVLMConfig, _VLMProcessorOnFirstUse, exist_ok=True)

__all__ = [
    "ConceptMoEConfig",
    "ConceptMoEForCausalLM",
    "ConceptMoEModel",
    "ConceptMoECausalLMOutput",
    "ConceptMoEVLMConfig",
    "ConceptMoEVLM",
    "VLMProcessor",
]


def __getattr__(name: str):
    if name == "VLMProcessor":
        from vlm.processor import VLMProcessor

        return VLMProcessor
    raise AttributeError(f"module 'vlm' has no attribute {name!r}")
