"""The ConceptMoE language backbone (text only): config and presets, transformer layers, MoE, chunk / dechunk,
the model (full forward and incremental decoding) and its caches. Imports torch and transformers only."""
