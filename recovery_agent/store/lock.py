"""The store's lock file: one agent per store (:class:`StoreLock`)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import StoreError


class StoreLock:
    """An exclusive lock beside the store file (``<store>.lock``): one agent
    per store. The kernel drops it when the holder dies, even by SIGKILL."""

    def __init__(self, store_path: str | Path) -> None:
        # beside the file itself: two paths to one store (a symlink, a symlinked
        # directory) must meet at one lock
        self.path = Path(f"{os.path.realpath(store_path)}.lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise StoreError naming the holder's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreError(f"another recovery-agent (pid {holder}) already uses the store "
                             f"{str(self.path)[:-5]}; stop it first") from None
        self.fd = fd
        try:   # the holder's pid, for the message above; a full disk may refuse it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass

    def held_elsewhere(self) -> bool:
        """True when some live process holds the lock (this one does not take it)."""
        if not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def lost(self) -> str:
        """Why this process no longer holds the lock ("" while it does): the lock
        file was removed or replaced, so another process may have locked a new
        one."""
        if self.fd is None:
            return "the store lock is not held"
        try:
            here, now = os.fstat(self.fd), os.stat(self.path)
        except OSError as exc:
            return f"the store lock {self.path} is gone ({exc.strerror})"
        if (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino):
            return f"the store lock {self.path} was replaced"
        return ""

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
