"""The ``lmms_eval.models`` entry point (``pyproject.toml``: ``conceptmoe = "eval.lmms_entry:manifests"``).

Deliberately imports nothing at module level. lmms-eval loads every entry point while ``lmms_eval.models`` is being
initialised, and that initialisation can start from inside the import of our own plugin module
(``eval.lmms_plugin`` imports ``lmms_eval``). An entry-point module that itself imported lmms-eval, or the plugin,
would then be found half-initialised, lmms-eval would swallow the error and ``conceptmoe`` would stay "not found"
for the rest of the process. Here the manifest class is imported only when lmms-eval calls :func:`manifests`,
after ``lmms_eval.models.registry_v2`` is fully loaded, and the model class (``eval.lmms_plugin.ConceptMoELMMs``)
only when lmms-eval resolves the model, so the import order of ``eval.lmms_plugin`` and ``lmms_eval.models`` does
not matter.
"""

MODEL_ID = "conceptmoe"
CLASS_PATH = "eval.lmms_plugin.ConceptMoELMMs"


def manifests() -> list:
    """The entry point's payload: the ``conceptmoe`` model id and its class (a list of one ``ModelManifest``)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=MODEL_ID, simple_class_path=CLASS_PATH)]
