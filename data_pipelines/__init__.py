"""data_pipelines: webdataset shards in and out, sample schema, tokenizer, packing, the training loader.

``from data_pipelines import make_dataloader``. Names resolve lazily (PEP 562), so importing a light
submodule such as ``data_pipelines.schema`` does not pull in torch / timm.
"""

_LAZY = {
    "make_dataloader": "data_pipelines.loader",
    "write_shards": "data_pipelines.writer",
    "load_manifest": "data_pipelines.writer",
    "load_tokenizer": "data_pipelines.tokenizer",
    "Modality": "data_pipelines.schema",
    "SampleSchema": "data_pipelines.schema",
    "Sample": "data_pipelines.schema",
    "Segment": "data_pipelines.schema",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'data_pipelines' has no attribute {name!r}")
