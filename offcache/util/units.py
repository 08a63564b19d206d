"""Sizes and durations as text, and the command lines' positive-integer argument."""

from __future__ import annotations

import argparse


def human(n: int) -> str:
    """A byte count in the largest binary unit it reaches: '1.5GiB', '512B'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"


def bytes_text(n: int) -> str:
    """Exact bytes, with the human size beside them past a KiB: '2048 bytes (2KiB)'."""
    if n < 1024:
        return f"{n} bytes"
    return f"{n} bytes ({human(n)})"


def seconds_text(t: float) -> str:
    return f"{t:.1f} s" if t >= 1 else f"{t * 1e3:.3f} ms"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value
