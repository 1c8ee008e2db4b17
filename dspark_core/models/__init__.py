"""Target and draft models.

Entry points: :func:`dspark_core.models.loading.load_target` (path or alias ->
target with ``.tokenizer``), :class:`dspark_core.models.base.ForwardBatch` /
:func:`~dspark_core.models.base.make_forward_batch`,
:func:`dspark_core.models.speculators_io.load_draft` /
:func:`~dspark_core.models.speculators_io.save_draft`,
:func:`dspark_core.models.reference.greedy_generate` (the exactness reference)
and the random factories in :mod:`dspark_core.models.random_models`.
"""
