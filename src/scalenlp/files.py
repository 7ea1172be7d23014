"""Files and folders replaced whole: written under a temporary name beside the target, then renamed over it, so that
a reader (a metrics scrape, a restart, llama.cpp) finds the old version or the new one, never half of one, and a
write that fails leaves the old one as it was and no temporary behind."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing_file(path: str | Path, *, private: bool = False, durable: bool = True,
                   shared: bool = False) -> Iterator[Path]:
    """A new empty file beside ``path`` for the block to write (by name, as a library that opens its own file
    needs), renamed over ``path`` when the block ends; removed instead if the block, or the rename, fails.

    - ``private``: readable and writable by this user only (0600), from its creation on.
    - ``durable``: its data reaches the disk before the rename, so that after a power loss ``path`` holds the old
      file or the whole new one, not an empty one. Off for files rewritten every second that nobody needs after
      the machine stops (heartbeats, metric snapshots).
    - ``shared``: other processes may write the same file at once (a cache): each writes its own temporary,
      named with its pid, and the last rename wins. Otherwise the temporary has one fixed name, so that one a
      killed writer left is replaced by the next write instead of piling up.

    The temporary is created afresh, never opened through a link: whatever was left under its name (a crashed
    write, a link planted by someone who can write in the folder) is removed first."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp" if shared else f"{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if private else 0o666))
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file(path: str | Path, data: str | bytes, **options) -> None:
    """Replace ``path`` by a file holding ``data`` (text is written as UTF-8); ``options`` as ``replacing_file``'s."""
    with replacing_file(path, **options) as tmp:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def replace_folder(tmp: str | Path, out: str | Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``. An ``out`` already there is renamed ``<out>.old`` first and
    removed once ``tmp`` has taken its place: a crash between the two renames leaves it whole under that name,
    where removing it before the rename could leave half of it."""
    out = Path(out)
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old)
