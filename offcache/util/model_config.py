"""A transformers model config from a path or the local Hub cache (the planner's and the KV sizer's --config;
the engine's settings are offcache/engine/config.py)."""

from __future__ import annotations

import os

from offcache.util.extras import require


def load_config(name: str | os.PathLike):
    """A transformers config from a config.json, its folder, or a Hub id already in the local cache.

    Never waits on the network; raises ValueError naming what was given when it is none of these.
    """
    AutoConfig = require("transformers", "transformers", "offcache.plan with a model config (--config)").AutoConfig

    path = os.fspath(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--config {path!r}: the folder holds no config.json")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if os.path.isfile(path):
        config_dict = AutoConfig.get_config_dict(path, local_files_only=True)[0]
        return AutoConfig.for_model(**config_dict)
    looks_local = path.startswith((".", "/", "~")) or path.endswith(".json") or path.count("/") > 1
    if not looks_local:
        try:
            return AutoConfig.from_pretrained(path, local_files_only=True)
        except Exception:  # not in the local Hub cache
            pass
    raise ValueError(
        f"--config {path!r} is neither a folder with a config.json, a config.json file, nor a Hub id in the "
        "local cache (the planner does not download)"
    )
