"""The disk tier's folder: checked when configured, made only once a run may need it."""

from __future__ import annotations

import os

from offcache.engine import machine as _machine
from offcache.engine.loader import _C

# The auto disk tier's folder while it does not exist yet: made by the first store that may need it.
_pending_disk_dir: str = ""
_disk_dir_room = 0  # bytes stores may still ask for before make_disk_dir asks the engine again
_host_limit = 0  # the host limit configure() resolved


def arm(folder: str, host_limit: int) -> None:
    """configure(): the disk tier is `folder` ('' for none) under `host_limit`; a folder that does
    not exist yet is made by the first store that may need it."""
    global _pending_disk_dir, _disk_dir_room, _host_limit
    _pending_disk_dir = folder if folder and not os.path.isdir(folder) else ""
    _disk_dir_room = 0
    _host_limit = host_limit


def pending() -> bool:
    """Whether the disk tier's folder is still to be made."""
    return bool(_pending_disk_dir)


def make_disk_dir(request_bytes: int = 0, force: bool = False) -> None:
    """Make the auto disk tier's folder once a store may cross the host limit (or `force`).

    Importing offcache makes nothing on disk; the folder appears only when a run holds enough
    host memory that its next values may go to disk. A folder that cannot be made then fails
    that store with the engine's error naming it.
    """
    global _pending_disk_dir, _disk_dir_room
    folder = _pending_disk_dir
    if not folder:
        return
    if not force:
        # Cheap on every store (update() calls this each time until the folder exists): the
        # engine is asked how much it holds only once the stores since its last answer may have
        # used up the room it then had below half the host limit.
        _disk_dir_room -= 2 * request_bytes
        if _disk_dir_room >= 0:
            return
        s = _C.stats()
        held = s["pinned_reserved_bytes"] + s["pageable_bytes"] + 2 * request_bytes
        if held < _host_limit // 2:  # far from the limit: not yet
            _disk_dir_room = _host_limit // 2 - held
            return
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        pass  # the engine's store names the folder and the reason
    _pending_disk_dir = ""


_DISK_FORMS = "'auto' (the default), 'none' (no disk tier) or an existing folder"


def parse(given: str | os.PathLike, name: str) -> tuple[str, str]:
    """(the disk tier's folder or '', why auto found none): checked now, not mid-run."""
    if isinstance(given, (bool, int, float)) or not isinstance(given, (str, os.PathLike)):
        raise TypeError(f"{name} must be {_DISK_FORMS}, got {given!r}")
    path = os.fspath(given)
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{name} must be {_DISK_FORMS}, got {given!r}")
    word = path.strip().lower() if isinstance(given, str) else ""
    if word == "none":
        return "", ""
    if word == "auto":
        return _machine.auto_disk_dir()
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"{name}: {path!r} is not a folder (make it first, or use {_DISK_FORMS})")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name}: cannot write to {path!r}")
    return path, ""
