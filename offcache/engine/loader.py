"""Loads the compiled engine, offcache._C, refusing one built against another torch.

Nothing else in offcache imports offcache._C: the engine package is the seam.
"""

from __future__ import annotations

import os

import torch

# What setup.py records next to the engine it builds (offcache/_C_build.json): the torch it was
# compiled against, so a mismatch is refused before the library is even loaded.
BUILD_RECORD = "_C_build.json"


def _recorded_build(folder) -> dict | None:
    """The build record next to the compiled engine, if it describes the engine there now."""
    import json
    from pathlib import Path

    folder = Path(folder)
    try:
        record = json.loads((folder / BUILD_RECORD).read_text())
        engine = folder / record["engine"]
        if engine.stat().st_size != record["engine_bytes"]:
            return None  # an engine copied in since: the record is stale, loading will tell
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def torch_mismatch(built: str, running: str, built_cuda: str | None = None) -> str:
    """Why an engine built against torch `built` must not run under torch `running`, and the fix.

    PyTorch promises no C++ ABI across releases, patch releases included (inline functions and
    symbols of c10/ATen change between them), so any difference is refused.
    """
    msg = (
        f"offcache's compiled engine was built against torch {built}, but torch {running} is running; "
        "a C++ extension must run with the torch it was compiled against. "
    )
    if built_cuda and torch.version.cuda is None:
        msg += f"This build needs a CUDA build of torch (CUDA {built_cuda}); torch {running} is CPU-only. "
    return msg + (
        f"Fix: install torch=={built}, or rebuild offcache against this torch: "
        "`pip install --no-build-isolation --no-deps --force-reinstall .` from a checkout "
        "(or `bash scripts/setup.sh` there)."
    )


# What the engine's messages must read: c10::str of an integer and of a float, as in every error that holds a number.
FORMAT_VALUE = 2147483648
FORMAT_WANT = "[2147483648, 0.5]"
FORMAT_CHILD_TIMEOUT_S = 30


def _format_in_child(engine) -> tuple[str | None, str]:
    """(what engine._format_check(FORMAT_VALUE) returns, '') in a forked child, so that a crash is seen, not
    suffered: (None, why) when the child died of a signal; ('', why) when it gave no answer in time."""
    import faulthandler
    import select
    import signal
    import warnings

    if not hasattr(os, "fork"):
        return engine._format_check(FORMAT_VALUE), ""
    read, write = os.pipe()
    with warnings.catch_warnings():  # Python warns of fork() in a process with threads; the child calls no lock
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: format, answer, and leave without any exit handler
        try:
            faulthandler.disable()  # a crash here is the answer, reported by the parent: no traceback dump
            os.close(read)
            os.write(write, engine._format_check(FORMAT_VALUE).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        answered, _, _ = select.select([read], [], [], FORMAT_CHILD_TIMEOUT_S)
        got = b""
        if answered:
            while chunk := os.read(read, 4096):
                got += chunk
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read)
    _, status = os.waitpid(pid, 0)
    if not answered:
        return "", f"no answer in {FORMAT_CHILD_TIMEOUT_S} s"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown"
        return None, f"signal {number}, {name}"
    return got.decode(errors="replace"), ""


def loaded_libstdcxx() -> list[str]:
    """The libstdc++ this process has loaded, as 'path:size:mtime' (from /proc/self/maps; [] where unknown):
    what a number-formatting check that passed holds for."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libstdc++" in line and "/" in line})
        return [f"{os.path.realpath(p)}:{os.stat(p).st_size}:{os.stat(p).st_mtime_ns}" for p in paths]
    except OSError:
        return []


def check_number_formatting(engine, where: str, checked_with: list[str] | None = None) -> None:
    """Has the engine `engine` (loaded from `where`) format a number as its messages do, and raises an
    ImportError naming the cause and the fix when it gets it wrong or crashes.

    A compiler that links pieces of libstdc++ into every shared object (Red Hat's devtoolset / gcc-toolset,
    the manylinux images' compilers) gives the engine a std::locale of its own, which disagrees with the
    libstdc++ torch loads: every message holding a number came out empty or crashed the process (an H200,
    2026-12-04). setup.py checks this on the build host; a wheel built elsewhere meets this machine's
    libstdc++ only here. A child that gives no answer in time (a fork beside threads) leaves it unchecked.
    `checked_with`: the libstdc++ the build's own check passed beside (setup.py records it with the engine);
    the same one loaded here needs no second check, so an engine built on this machine forks no child.
    """
    if checked_with and checked_with == loaded_libstdcxx():
        return
    got, crash = _format_in_child(engine)
    if got == FORMAT_WANT or (got == "" and crash):
        return
    what = (
        f"crashed ({crash}) formatting {FORMAT_VALUE} and 0.5"
        if got is None
        else f"formats {FORMAT_VALUE} and 0.5 as {got!r}, not {FORMAT_WANT!r}"
    )
    raise ImportError(
        f"offcache's compiled engine ({where}) {what}: it was linked with pieces of libstdc++ (a Red Hat "
        "devtoolset / gcc-toolset or manylinux compiler links libstdc++_nonshared.a into every shared object) "
        "that disagree with the libstdc++ loaded here, so every engine message holding a number would be wrong "
        "or crash the process. Fix: rebuild it on this machine with the system compiler, from a checkout: "
        "`CXX=g++ CC=gcc pip install --no-build-isolation --no-deps --force-reinstall .` (setup.py picks the "
        "system g++ by itself when CXX or LDSHARED names such a compiler)."
    )


def _load_engine():
    """offcache._C, refused with an ImportError when it was built against another torch."""
    from pathlib import Path

    here = Path(__file__).parent.parent  # offcache/, where the build puts _C
    running = str(torch.__version__)
    record = _recorded_build(here)
    if record is not None and record.get("torch") != running:  # checked before the library loads
        raise ImportError(torch_mismatch(record.get("torch"), running, record.get("cuda")))
    try:
        import offcache._C as _C
    except ImportError as exc:  # no silent fallback: the engine is the product
        built = list(here.glob("_C*.so"))
        where = f"{exc}" if built else f"{here} holds no compiled engine"
        if built and torch.version.cuda is None and "cuda" in str(exc).lower():
            where += f"; this engine was built with CUDA and needs a CUDA build of torch (torch {running} is CPU-only)"
        raise ImportError(
            f"offcache's compiled engine (offcache._C) is missing or does not load under torch {running}: "
            f"{where}. Build it against the torch you run with: `bash scripts/setup.sh`, or "
            "`pip install --no-build-isolation -e .` from a checkout."
        ) from exc
    if _C.torch_version != running:  # an engine with no record (copied in, older build)
        raise ImportError(torch_mismatch(_C.torch_version, running, _C.cuda_version))
    loaded = Path(getattr(_C, "__file__", None) or here)
    # The record vouches for the engine file it names (its size checked), not for a module loaded from elsewhere.
    vouched = record is not None and loaded.parent.resolve() == here.resolve() and loaded.name == record["engine"]
    check_number_formatting(_C, str(loaded), record.get("format_checked_with") if vouched else None)
    return _C


_C = _load_engine()
