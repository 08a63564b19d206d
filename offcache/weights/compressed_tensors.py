"""``offcache.weights.compressed_tensors``, the path docs and users import: offcache/weights/ct_patch.py itself.

The module's own name no longer shares the upstream package's (``compressed_tensors``); this one
keeps the documented path working, as the same module object (so a name set on one is set on both).
"""

import sys

from offcache.weights import ct_patch

sys.modules[__name__] = ct_patch
