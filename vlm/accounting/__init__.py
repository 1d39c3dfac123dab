"""Accounting and conversion on top of the backbone: parameter and FLOP counts with compute matching
(``flops``), the inference cost model (``inference_cost``) and HF MoE -> ConceptMoE conversion (``convert``)."""
