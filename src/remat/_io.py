"""Atomic file writes: a temp file in the same folder, fsync, then rename (never half-written)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def stage_bytes(folder: Path | str, name: str, data: bytes) -> Path:
    """Write ``data`` to a new temp file beside ``folder/name`` (fsynced, ordinary permissions).

    The caller renames it into place (``os.replace``), alone or with others (receipt folder).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are for reading
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def atomic_write_bytes(path: Path | str, data: bytes) -> Path:
    path = Path(path)
    tmp = stage_bytes(path.parent, path.name, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path | str, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n")
