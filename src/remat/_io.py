"""Atomic file writes: a temp file in the same folder, fsync, then rename (never half-written).

An OSError while writing (disk full, read-only file system, no permission, a dangling symlink
in the way) is the output's problem, not remat's: it becomes an :class:`OutputError` (exit 2),
and the temp file is removed whatever stopped the write (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import OutputError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def output_error(path: Path, exc: OSError) -> OutputError:
    """The typed error for an OSError met while writing ``path``."""
    return OutputError(f"cannot write {path}: {exc.strerror or exc}",
                       tip="free some space, or name another --out folder you can write to")


def stage_bytes(folder: Path | str, name: str, data: bytes) -> Path:
    """Write ``data`` to a new temp file beside ``folder/name`` (fsynced, ordinary permissions).

    The caller renames it into place (``os.replace``), alone or with others (receipt folder).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise output_error(folder / name, exc) from None
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are for reading
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise output_error(folder / name, exc) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def replace_into(tmp: Path, path: Path) -> None:
    """Rename the staged ``tmp`` onto ``path`` (OutputError on an OSError); the caller removes ``tmp`` if it fails."""
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise output_error(path, exc) from None


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    path = Path(path)
    tmp = stage_bytes(path.parent, path.name, data)
    try:
        replace_into(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")


CACHE_ENV_VAR = "REMAT_CACHE_DIR"


def default_cache_dir() -> Path:
    """remat's cache folder (plans, measured bandwidths): ``$REMAT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/remat``, else ``~/.cache/remat``."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "remat"
