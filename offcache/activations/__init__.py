"""Calibration activations: llm-compressor's IntermediatesCache on the engine (cache.py) and the
nested values it stores (tree.py)."""

from offcache.activations.cache import IntermediatesCache, IntermediateValue

__all__ = ["IntermediateValue", "IntermediatesCache"]
