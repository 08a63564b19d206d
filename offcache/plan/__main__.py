"""``python -m offcache.plan``."""

import sys

from offcache.plan.cli import main

sys.exit(main())
