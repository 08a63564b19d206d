"""A fresh memory cgroup (v2, else v1) for a benchmark's or a test's child process, and its counters.

``memory_cgroup(limit)`` makes a child of a cgroup v2 mount's root (memory enabled in its
subtree), else of this process's own v1 memory cgroup, sets its limit (and, on v1, the same
memory+swap limit, so that nothing is swapped out instead), and yields a ``Cgroup``: a process
joins it by writing its pid to ``procs`` (``sh -c 'echo $$ > PROCS && exec ...'``). Its counters
read the limit, the memory charged now (page cache included), the anonymous part of it, the peak
and the OOM kills. Where none can be made (not root, no writable mount) it raises ``NoCgroupError``
naming what was tried. The folder is removed on exit (once its processes have ended).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from offcache.engine import machine as _machine


class NoCgroupError(RuntimeError):
    """No memory cgroup can be made here: the reason names each place tried."""


@dataclass
class Cgroup:
    folder: str
    version: int  # 1 or 2
    limit: int

    @property
    def procs(self) -> str:
        return os.path.join(self.folder, "cgroup.procs")

    def _read(self, name: str) -> str | None:
        try:
            with open(os.path.join(self.folder, name)) as f:
                return f.read()
        except OSError:
            return None

    def _int(self, name: str) -> int | None:
        text = self._read(name)
        return int(text) if text is not None and text.strip().isdigit() else None

    def _keyed(self, name: str) -> dict[str, int]:
        out = {}
        for line in (self._read(name) or "").splitlines():
            key, _, value = line.partition(" ")
            if value.strip().isdigit():
                out[key] = int(value)
        return out

    def current(self) -> int | None:
        """The memory charged to the cgroup now (anonymous memory and page cache)."""
        return self._int("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def peak(self) -> int | None:
        """The most it was charged (v2: memory.peak, kernel 5.19 or later; else None)."""
        return self._int("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def anon(self) -> int | None:
        """Its anonymous memory: what the kernel cannot reclaim without swap (v1: rss, v2: anon)."""
        stat = self._keyed("memory.stat")
        return stat.get("anon" if self.version == 2 else "rss")

    def oom_kills(self) -> int | None:
        """Processes the OOM killer ended in it (v1: memory.oom_control's oom_kill, kernel 4.13 or later)."""
        return self._keyed("memory.events" if self.version == 2 else "memory.oom_control").get("oom_kill")


def candidates(name: str) -> list[tuple[str, str, str | None]]:
    """(folder to make, limit file, subtree_control to enable memory in) for v2, then v1."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f.read().splitlines():
            _, controllers, path = line.split(":", 2)
            own["" if controllers == "" else "memory" if "memory" in controllers.split(",") else controllers] = path
    out = []
    for root, point, fs, opts in _machine.mounts():
        if fs == "cgroup2" and os.path.exists(os.path.join(point, "cgroup.controllers")):
            # A child of the mount's root: the root is exempt from the no-internal-processes rule.
            out.append((os.path.join(point, name), "memory.max", os.path.join(point, "cgroup.subtree_control")))
        elif fs == "cgroup" and "memory" in opts.split(",") and "memory" in own:
            rel = own["memory"][len(root) :] if root != "/" and own["memory"].startswith(root) else own["memory"]
            out.append((os.path.join(point + rel, name), "memory.limit_in_bytes", None))  # under our own cgroup
    return out


@contextlib.contextmanager
def memory_cgroup(limit: int, name: str | None = None) -> Iterator[Cgroup]:
    """A fresh memory cgroup limited to `limit` bytes; raises NoCgroupError where none can be made."""
    if os.geteuid() != 0:
        raise NoCgroupError("making a memory cgroup needs root")
    tried = []
    for folder, limit_file, subtree in candidates(name or f"offcache-{os.getpid()}"):
        try:
            if subtree:
                with open(subtree, "w") as f:
                    f.write("+memory")
            os.mkdir(folder)
        except OSError as exc:
            tried.append(f"{folder}: {exc.strerror}")
            continue
        try:
            try:
                with open(os.path.join(folder, limit_file), "w") as f:
                    f.write(str(limit))
            except OSError as exc:
                tried.append(f"{folder}/{limit_file}: {exc.strerror}")
                continue
            if limit_file == "memory.limit_in_bytes":
                with contextlib.suppress(OSError), open(os.path.join(folder, "memory.memsw.limit_in_bytes"), "w") as f:
                    f.write(str(limit))  # no swap either, where swap accounting exists
            yield Cgroup(folder, 2 if limit_file == "memory.max" else 1, limit)
            return
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    raise NoCgroupError("no writable memory cgroup: " + ("; ".join(tried) or "no cgroup v2 mount, no v1 memory mount"))
