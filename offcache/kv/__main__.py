"""``python -m offcache.kv size ...``: the size of a KV cache and what moving it costs."""

import sys

from offcache.kv.size import main

sys.exit(main())
