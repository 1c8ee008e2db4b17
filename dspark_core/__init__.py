"""dspark-core: adaptive speculative decoding with DSpark drafts."""

__version__ = "0.1.0"
