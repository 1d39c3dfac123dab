"""ConceptMoE backbone and VLM: ``from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM``."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from vlm.backbone.config import ConceptMoEConfig
from vlm.backbone.model import ConceptMoEForCausalLM, ConceptMoEModel
from vlm.backbone.outputs import ConceptMoECausalLMOutput
from vlm.config import ConceptMoEVLMConfig
from vlm.model import ConceptMoEVLM
from vlm.processor import VLMProcessor

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
