"""Atomic file writes: a temp file in the same folder, fsync, then rename (never half-written).

An OSError while writing (disk full, read-only file system, no permission, a dangling symlink
in the way) is the output's problem, not remat's: it becomes an :class:`OutputError` (exit 2),
and the temp file is removed whatever stopped the write (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

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
# NOTE [native solver output]
# HiGHS (inside scipy.optimize.milp) prints some diagnostics with C printf whatever its options
# say (``disp`` is off by default): e.g. "HighsMipSolverData::transformNewIntegerFeasibleSolution
# tmpSolver.run();" when a solution it found violates a row after un-presolving. That text goes
# to fd 1 through C stdio's buffer, so it surfaced later, in the middle of `remat receipt`'s
# output. Planning is library code and must not print, so :func:`native_output_filtered` points
# fd 1 at a temporary file while the solver runs, flushes C stdio (``fflush(NULL)``) before
# pointing it back, and then writes back every line but the solver's own (``drop`` prefixes):
# another thread's output in that window arrives late but whole.
_LIBC: Any = None


def _flush_c_stdio() -> None:
    """``fflush(NULL)``: C stdio's buffered output (a printf into a pipe or file waits there) goes to its fd now."""
    global _LIBC
    try:
        if _LIBC is None:
            import ctypes
            _LIBC = ctypes.CDLL(None)
        _LIBC.fflush(None)
    except (OSError, AttributeError):   # no C library to flush (a non-glibc build): nothing buffered to lose
        pass


HIGHS_PREFIXES = ("Highs", "HighsMipSolverData")


@contextlib.contextmanager
def native_output_filtered(drop: tuple[str, ...] = HIGHS_PREFIXES, fd: int = 1) -> Iterator[None]:
    """Hold what native code writes to ``fd`` while the block runs, then pass on every line not starting
    with ``drop`` (NOTE [native solver output]). Python's own ``sys.stdout`` is flushed first."""
    try:
        sys.stdout.flush()
    except (AttributeError, OSError, ValueError):
        pass
    _flush_c_stdio()
    try:
        saved = os.dup(fd)
    except OSError:   # no such fd (a daemon without stdout): nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), fd)
        try:
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved, fd)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not line.decode("utf-8", "replace").startswith(drop))
            while kept:
                kept = kept[os.write(fd, kept):]
