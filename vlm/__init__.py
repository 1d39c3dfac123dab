"""ConceptMoE backbone: ``from vlm import ConceptMoEConfig, ConceptMoEForCausalLM``."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from vlm.config import ConceptMoEConfig
from vlm.model import ConceptMoEForCausalLM, ConceptMoEModel
from vlm.outputs import ConceptMoECausalLMOutput

AutoConfig.register(ConceptMoEConfig.model_type, ConceptMoEConfig, exist_ok=True)
AutoModel.register(ConceptMoEConfig, ConceptMoEModel, exist_ok=True)
AutoModelForCausalLM.register(ConceptMoEConfig, ConceptMoEForCausalLM, exist_ok=True)

__all__ = ["ConceptMoEConfig", "ConceptMoEForCausalLM", "ConceptMoEModel", "ConceptMoECausalLMOutput"]
