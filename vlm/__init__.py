"""ConceptMoE backbone and VLM: ``from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM``.

The models and configs are imported (and registered with the HF Auto classes) here; ``VLMProcessor`` is resolved on
first use (PEP 562), so ``import vlm`` does not load the tokenizer code of ``data_pipelines``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM, ConceptMoEModel
from vlm.backbone.outputs import ConceptMoECausalLMOutput
from vlm.config import ConceptMoEVLMConfig
from vlm.model import ConceptMoEVLM

AutoConfig.register(ConceptMoEConfig.model_type, ConceptMoEConfig, exist_ok=True)
AutoModel.register(ConceptMoEConfig, ConceptMoEModel, exist_ok=True)
AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)
AutoConfig.register(ConceptMoEVLMConfig.model_type, ConceptMoEVLMConfig, exist_ok=True)
AutoModel.register(ConceptMoEVLMConfig, ConceptMoEVLM, exist_ok=True)
AutoModelForImageTextToText.register(ConceptMoEVLMConfig, ConceptMoEVLM, exist_ok=True)

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
