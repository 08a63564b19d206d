"""Optional packages: each feature that needs one names the extra that installs it."""

from __future__ import annotations

import importlib


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""


def missing(package: str, extra: str, what: str) -> MissingExtraError:
    """The one-line error for `what`, which needs `package`, installed by offcache[`extra`]."""
    return MissingExtraError(f"{what} needs {package}, which is not installed: pip install 'offcache[{extra}]'")


def require(module: str, extra: str, what: str):
    """Import `module`, or raise the one-line MissingExtraError naming `extra`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise  # something else inside the package is missing: not ours to rename
        raise missing(top, extra, what) from None


def as_missing(exc: ModuleNotFoundError, packages: str | tuple[str, ...], extra: str, what: str) -> ImportError:
    """The one-line MissingExtraError for a module that failed to import because one of `packages`
    (those the extra installs) is absent; `exc` itself when something else is missing (not ours to
    rename). For a module's own top-level imports:
    ``except ModuleNotFoundError as e: raise as_missing(e, ...) from None``."""
    top = (exc.name or "").split(".")[0]
    if top not in ((packages,) if isinstance(packages, str) else packages):
        return exc
    return missing(top, extra, what)
