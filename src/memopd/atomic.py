"""Files and directories written whole or not at all: the content goes to a temporary sibling `<name>.tmp`, which
is renamed onto the target only once it is complete. A reader never sees a half-written file, and a crash or an
error leaves the old file (or none), never a partial one. The rename (os.replace) is atomic on one file system, and
a sibling is always on the target's.

Only the standard library is imported: every module of the package may write through this one.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _remove(path: Path) -> None:
    """Remove a file or a directory tree at `path`, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield the temporary sibling of `path` to write (a file, or a directory the block creates); when the block
    ends without an exception, move it onto `path`. A directory replaces the one at `path` (removed first, so a
    crash between the two steps leaves neither). On an exception, in the block or in the move, the temporary is
    removed and the exception raised again; a file at `path` keeps what it held."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` as the file `path` (Path.write_text's encoding), written whole or not at all."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
