"""ConceptMoE backbone and VLM: ``from vlm import ConceptMoEConfig, ConceptMoEForCausalLM, ConceptMoEVLM``."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from vlm.config import ConceptMoEConfig
from vlm.model import ConceptMoEForCausalLM, ConceptMoEModel
from vlm.outputs import ConceptMoECausalLMOutput
from vlm.processor import VLMProcessor
from vlm.vlm_config import ConceptMoEVLMConfig
from vlm.vlm_model import ConceptMoEVLM

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
