"""offcache's main job: copies measured side by side with the alternatives.

Run ``python -m offcache.bench [--quick] [--out DIR] [--device cuda:0]``.
"""
