"""Multi-rank serving over ``torch.distributed`` (see ``docs/multi-rank.md``).

``nnodes == 1`` never imports this package: the single-rank path builds its
engine exactly as before. With ``nnodes > 1`` every rank joins one process
group (:mod:`.group`), shards the Llama target across the ranks
(:mod:`.tp`), follows rank 0's step decisions (:mod:`.control`) and installs
the one cost table rank 0 fitted (:mod:`.table`). :mod:`.launch` ties it
together for ``dspark-core serve``.
"""
