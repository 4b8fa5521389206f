"""Advisory file locks (``flock``) for run folders and prepared-data caches.

The kernel drops an ``flock`` when its holder dies, SIGKILL included, so a crashed holder never
leaves a lock that blocks anyone: its lock file may stay on disk, but it is not held and the next
process takes it at once. An exclusive holder removes its lock file when it releases it; a process
that took a lock on a file that was meanwhile removed (or replaced) notices it by the inode and
takes the lock again on the file now at the path (or, with ``create=False``, finds none), so at
most one process holds the lock at a path.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path


class LockHeld(Exception):
    """A non-blocking ``acquire`` found the lock held; ``pid`` is the holder's, when it wrote one."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(f"{path} is locked by pid {pid}")
        self.path, self.pid = path, pid


def _holder(path: Path) -> int | None:
    try:
        return int((path.read_text().split() or ["x"])[0])  # the first line; more may follow
    except (OSError, ValueError):
        return None


class FileLock:
    """``flock`` on ``path``: exclusive (one writer) or shared (readers), blocking or not.

    ``on_wait(pid)`` is called once before a blocking acquire starts to wait for another holder.
    ``create=False``: a missing lock file is a ``FileNotFoundError`` (a reader that must not write).
    """

    def __init__(self, path: str | Path, shared: bool = False, create: bool = True) -> None:
        self.path = Path(path)
        self.shared = shared
        self.create = create
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, blocking: bool = False, on_wait=None) -> FileLock:  # noqa: ANN001
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        while True:
            fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if self.create else 0), 0o644)
            try:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                    if not blocking:
                        raise LockHeld(self.path, _holder(self.path)) from None
                    if on_wait is not None:
                        on_wait(_holder(self.path))
                        on_wait = None
                    fcntl.flock(fd, mode)
                try:
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
            except BaseException:
                os.close(fd)
                raise
            if same:
                break
            os.close(fd)  # the holder we waited for removed the file: lock the one there now
        if not self.shared:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if not self.shared:
                try:
                    self.path.unlink()  # still held: nobody else can hold this inode now
                except FileNotFoundError:
                    pass
        finally:
            os.close(fd)

    def __enter__(self) -> FileLock:
        return self if self.held else self.acquire(blocking=True)

    def __exit__(self, *exc: object) -> None:
        self.release()
