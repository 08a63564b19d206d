"""Where a disk-offloaded checkpoint is read from: a network or memory file system gets a warning.

A weight offloaded to disk by ``load_offloaded_model`` is read from the checkpoint's own file at each
onload (once per calibration pass, and again while saving). On a network file system every one of
those reads crosses the network; on a memory file system (tmpfs) the "disk" share is memory already,
so offloading it frees nothing. Either way the user is told once per load, with the folder, the file
system, the bytes and the expected cost.
"""

from __future__ import annotations

import os
import warnings

from offcache.engine import machine as _machine
from offcache.util.units import bytes_text

# A network read's bandwidth for the expected cost: a 10 Gb/s link, in bytes per second.
NETWORK_BYTES_PER_S = 1.25e9


class CheckpointFileSystemWarning(UserWarning):
    """A checkpoint read as a disk offload lives on a network or memory file system."""


_read_from: dict[str, int] = {}  # folder of a checkpoint file -> bytes offloaded to disk from it


def note(checkpoint_file: str, nbytes: int) -> None:
    """Count `nbytes` of a weight that will be read from `checkpoint_file` at each onload."""
    folder = os.path.dirname(os.path.realpath(checkpoint_file))
    _read_from[folder] = _read_from.get(folder, 0) + int(nbytes)


def messages(read_from: dict[str, int]) -> list[str]:
    """One message per folder on a network or memory file system, with the bytes and the expected cost."""
    out = []
    for folder, nbytes in sorted(read_from.items()):
        fs = _machine.filesystem_type(folder)
        if fs in _machine.NETWORK_FS:
            seconds = nbytes / NETWORK_BYTES_PER_S
            out.append(
                f"offcache: the checkpoint in {folder} is on a network file system ({fs}): the "
                f"{bytes_text(nbytes)} offloaded to disk are read from it over the network at every pass "
                f"(each calibration pass, and again while saving), about {seconds:.1f} s per pass at 10 Gb/s "
                "and more when the link is shared; copy the checkpoint to a local disk first"
            )
        elif fs in _machine.MEMORY_FS:
            out.append(
                f"offcache: the checkpoint in {folder} is on a memory file system ({fs}): the "
                f"{bytes_text(nbytes)} offloaded to disk are memory already, so offloading them frees "
                "nothing and they still count against the machine's memory; put the checkpoint on a "
                "local disk"
            )
    return out


def take_messages() -> list[str]:
    """The messages for the weights noted since the last call (then forgotten)."""
    read_from = dict(_read_from)
    _read_from.clear()
    return messages(read_from)


def warn(messages_: list[str], stacklevel: int = 3) -> None:
    for message in messages_:
        warnings.warn(message, CheckpointFileSystemWarning, stacklevel=stacklevel)
