"""offcache's main job: copies measured side by side with the alternatives.

Run ``python -m offcache.bench [SECTION ...] [--quick] [--tiny] [--out DIR] [--device cuda:0]``
(sections: all, transfer, overlap, small, pipeline, kv, soak, oneshot; ``--help`` lists them).
"""
