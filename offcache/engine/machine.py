"""What this machine has: its memory and its file systems, as offcache's configuration sees them.

Memory: RAM, the process's cgroup limits (v1 and v2, found through /proc/self/cgroup and
mountinfo) and the smaller of the two, which percentages of memory are of. File systems: the
mounts, the type of the one holding a path, and the folder OFFCACHE_DISK_DIR=auto would use
(a real disk with room, not memory). Nothing here changes the machine or the engine.
"""

from __future__ import annotations

import os
import re

from offcache.util.units import human as _human


def total_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_ram_bytes() -> int:
    """The host's available memory (/proc/meminfo's MemAvailable, as psutil's ``available``); RAM where
    that cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return total_ram_bytes()


def _unescape(field: str) -> str:
    """A /proc/self/mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mounts(proc: str = "/proc/self") -> list[tuple[str, str, str, str]]:
    """(root, mount point, file system type, super options) of each mount, from mountinfo."""
    out = []
    try:
        with open(os.path.join(proc, "mountinfo")) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, sep, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if sep and len(a) >= 5 and len(b) >= 3:
            out.append((_unescape(a[3]), _unescape(a[4]), b[0], b[2]))
    return out


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def cgroup_memory_limit(proc: str = "/proc/self") -> int | None:
    """The tightest memory limit of this process's cgroups, v1 and v2; None where none is set.

    The cgroup paths come from /proc/self/cgroup; each is found under the mount of its
    hierarchy (mountinfo gives the mount's root, so a namespaced mount resolves too), and
    every level up to the mount counts, since a parent's limit binds its children.
    """
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    table = mounts(proc)
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2, limit_file = True, "memory.max"
        elif "memory" in controllers.split(","):
            v2, limit_file = False, "memory.limit_in_bytes"
        else:
            continue
        for root, point, fs, opts in table:
            if not (fs == "cgroup2" if v2 else fs == "cgroup" and "memory" in opts.split(",")):
                continue
            rel = path[len(root) :] if root != "/" and (path + "/").startswith(root + "/") else path
            here = os.path.normpath(point + "/" + rel.lstrip("/"))
            if not os.path.isdir(here):
                here = point
            while True:
                limit = _read_limit(os.path.join(here, limit_file))
                if limit is not None:
                    found.append(limit)
                if os.path.normpath(here) == os.path.normpath(point) or here in ("/", ""):
                    break
                here = os.path.dirname(here)
    return min(found) if found else None


def usable_memory_bytes() -> int:
    """The memory this process may use: the smaller of RAM and its cgroup's limit.

    Containers, Kubernetes pods and Slurm jobs run under a cgroup limit far below the
    machine's RAM; percentages (OFFCACHE_PINNED_LIMIT, OFFCACHE_HOST_LIMIT) are of this.
    """
    ram = total_ram_bytes()
    limit = cgroup_memory_limit()
    return ram if limit is None else min(ram, limit)


# File systems whose "files" are memory: a disk tier there would spend the memory it saves.
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "rootfs"})
_MEMORY_FS = MEMORY_FS
# File systems whose reads cross a network (or a user-space daemon that usually does).
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "afs", "beegfs", "gpfs",
    "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.juicefs", "fuse.goofys",
    "fuse.mountpoint-s3", "fuse.blobfuse2", "fuse.cephfs", "fuse.glusterfs",
})  # fmt: skip
_AUTO_MIN_FREE = 1 << 30  # less free disk than this is no tier worth having


def filesystem_type(path: str, proc: str = "/proc/self") -> str:
    """The type of the file system holding `path` (the longest mount point above it), or ''."""
    real = os.path.realpath(path)
    best, kind = "", ""
    for _, point, fs, _ in mounts(proc):
        if (real + "/").startswith(point.rstrip("/") + "/") and len(point) >= len(best):
            best, kind = point, fs
    return kind


def existing_folder(path: str) -> str:
    """`path`, or the nearest folder above it that exists."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def auto_disk_dir(environ=None, proc: str = "/proc/self") -> tuple[str, str]:
    """OFFCACHE_DISK_DIR=auto: (folder, '') or ('', why no folder is usable).

    The folder is $XDG_CACHE_HOME/offcache, else ~/.cache/offcache; usable where it (or, until
    it exists, the nearest folder above it) is writable, on a real disk (not tmpfs/ramfs) and has
    at least 1GiB free. Nothing is made here: the folder is made (private, 0700) when the disk
    tier is first needed (_engine.make_disk_dir), and the engine uses it only past the host
    limit, in files unlinked at once.
    """
    environ = os.environ if environ is None else environ
    xdg = (environ.get("XDG_CACHE_HOME") or "").strip()
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")  # XDG: relative is ignored
    if not os.path.isabs(base):
        return "", "no home folder and no absolute XDG_CACHE_HOME"
    folder = os.path.join(base, "offcache")
    existing = existing_folder(folder)
    fs = filesystem_type(existing, proc)  # the folder may be a link or a mount of its own
    if fs in _MEMORY_FS:
        return "", f"{folder} is on {fs}, which is memory, not disk"
    if not os.path.isdir(existing):
        return "", f"cannot make {folder}: {existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == folder else f"cannot make {folder}: "
        return "", f"{where}cannot write to {existing}"
    try:
        st = os.statvfs(existing)
    except OSError as exc:
        return "", f"cannot read the free space of {folder}: {exc.strerror or exc}"
    free = st.f_bavail * st.f_frsize
    if free < _AUTO_MIN_FREE:
        return "", f"{folder} has only {_human(free)} free (auto needs at least {_human(_AUTO_MIN_FREE)})"
    return folder, ""
