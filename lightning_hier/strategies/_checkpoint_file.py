"""Checkpoint files on disk: atomic writes, stale temporary files, and load errors that say what is wrong.

- :func:`atomic_save` writes to a temporary file in the target's directory and renames it over the
  target, so a crash mid-write never damages the previous checkpoint.
- A process killed during that write leaves its temporary file behind. Its name records the host
  and process id of the writer (``.<target>.lhtmp-<host>-<pid>-<random>.tmp``), and the next save
  into the same directory removes every such file whose writer, on this host, no longer runs
  (:func:`remove_stale_temporaries`). Files of live writers, of other hosts (on a shared file
  system) and of anything else are left alone.
- :func:`read_checkpoint` turns what ``torch.load`` raises for an empty, truncated or foreign file
  into a :class:`~lightning_hier.strategies._checkpoint.CheckpointError` that names the file and
  the problem.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_hier._pids import pid_exists
from lightning_hier.strategies._checkpoint import CheckpointError

_TEMP_MARK = "lhtmp"
_TEMP_NAME = re.compile(rf"^\..+\.{_TEMP_MARK}-(?P<host>[A-Za-z0-9_]*)-(?P<pid>\d+)-[A-Za-z0-9_]+\.tmp$")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_PICKLE_PROTO = b"\x80"  # torch.save's legacy format starts with a pickle protocol opcode


def atomic_save(checkpoint: Mapping[str, Any], filepath: str | Path) -> None:
    """Write ``checkpoint`` so that an existing file at ``filepath`` is replaced only by a complete one.

    A crash mid-write leaves the previous checkpoint intact (write to a temporary file in the same
    directory, fsync, then an atomic rename); temporary files of earlier writers that died are
    removed first.
    """
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    prefix = f".{path.name}.{_TEMP_MARK}-{_host()}-{os.getpid()}-"
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _plain_file_mode())  # mkstemp makes 0600; Lightning's own writes follow the umask
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(checkpoint), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Remove the temporary files :func:`atomic_save` left in ``directory`` when its writer was killed.

    Only files named by :func:`atomic_save` whose writer ran on this host and has exited are
    removed: another process may be writing a checkpoint into the same directory right now.

    Returns:
        The files removed.
    """
    removed = []
    host, me = _host(), os.getpid()
    for entry in Path(directory).iterdir():
        match = _TEMP_NAME.match(entry.name)
        if match is None or match["host"] != host:
            continue
        pid = int(match["pid"])
        if pid != me and not pid_exists(pid):
            try:
                entry.unlink()
            except OSError:  # removed by another run first, or not ours to remove: never fail a save for it
                continue
            removed.append(entry)
    return removed


def read_checkpoint(path: str | Path, load: Callable[[], Any]) -> dict[str, Any]:
    """``load()`` (``torch.load`` of ``path``), with errors that name the file and what is wrong with it.

    Raises:
        CheckpointError: The file is empty, truncated or damaged, not a torch checkpoint, or not a
            Lightning checkpoint (a dictionary). File-system errors (missing file, permissions)
            and torch's own ``weights_only`` refusals pass through unchanged: they say so already.
    """
    try:
        checkpoint = load()
    except OSError:
        raise
    except Exception as exc:
        if "weights only load failed" in str(exc).lower():
            raise
        raise CheckpointError(f"Cannot load checkpoint {path}: {_diagnose(path)} ({_summary(exc)}).") from exc
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"Cannot load checkpoint {path}: it is a torch file holding a {type(checkpoint).__name__}, "
            "not a Lightning checkpoint (a dictionary written by Trainer.save_checkpoint)."
        )
    return checkpoint


def _diagnose(path: str | Path) -> str:
    """What is wrong with a file ``torch.load`` could not read, from its size and first bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            size = os.fstat(f.fileno()).st_size
    except OSError:  # a remote path (fsspec): say no more than torch did
        return "the file could not be read as a torch checkpoint"
    if size == 0:
        return "the file is empty (0 bytes), as a save interrupted outside an atomic write leaves it"
    if head == _ZIP_MAGIC:
        return f"the file is a truncated or damaged torch checkpoint ({size} bytes)"
    if head.startswith(_PICKLE_PROTO):
        return f"the file is a damaged torch checkpoint in the legacy format ({size} bytes)"
    return f"the file is not a torch checkpoint ({size} bytes, starting with {head!r})"


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"torch.load raised {type(exc).__name__}: {text[0][:300]}" if text else f"torch.load raised {exc!r}"


def _host() -> str:
    # the temporary file's name must match _TEMP_NAME: letters, digits and underscores only
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _plain_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the process umask (0644 usually)."""
    umask = os.umask(0)  # the only portable way to read it: set and restore at once
    os.umask(umask)
    return 0o666 & ~umask
