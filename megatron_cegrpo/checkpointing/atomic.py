"""Crash-safe file-system primitives of the checkpoint code.

Owns: fsync of files and directories, the atomic replacement of a small text file
(:func:`write_text_atomic`), the atomic swap of two directories (:func:`rename_exchange`,
Linux ``renameat2(RENAME_EXCHANGE)``), crash-safe directory removal (:func:`remove_dir`),
file hashing (:func:`sha256_file`) and file listing (:func:`list_files`).

Knows nothing about the checkpoint format (names, meta.json) nor about
``torch.distributed``; it imports only the standard library, so tools can use it without
torch.  Every function works on one path of the local (or shared) file system.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import uuid
from typing import List

#: Bytes read per step when hashing a file.
HASH_CHUNK = 8 << 20


def fsync_file(path: str) -> None:
    """Flush a written file's data to disk (``os.fsync`` on a read-only descriptor)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (new / renamed / removed names) to disk.

    Best effort: silently does nothing where the directory cannot be opened or the file
    system refuses fsync on directories.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temp file in the same directory + os.replace.

    The temp file is ``.<name>.tmp-<id>`` next to ``path``; readers see either the old or
    the new content, never a partial one.  On failure the temp file is removed and the
    exception re-raised.
    """
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(HASH_CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def list_files(root: str) -> List[str]:
    """Relative paths (with '/') of all regular files under ``root``, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


_libc = None


def rename_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unavailable."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    rc = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return rc == 0


def remove_dir(path: str) -> None:
    """Delete a directory: first renamed to a ``.tmp-`` name (atomic), then rmtree.

    A crash while deleting leaves a ``<name>.tmp-delete-<id>`` directory (for an
    ``iter_`` directory the next commit removes it as a stale ``.tmp-``), never a
    half-deleted ``path``.  Does nothing if ``path`` cannot be renamed (e.g. it is gone).
    """
    parent, base = os.path.split(path)
    doomed = os.path.join(parent, f"{base}.tmp-delete-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, doomed)
    except OSError:
        return
    fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)
