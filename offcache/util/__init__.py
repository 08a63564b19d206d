"""Helpers every layer may use: optional packages, sizes and durations as text, model configs.

The lowest layer of offcache: nothing here imports another part of offcache.
"""
