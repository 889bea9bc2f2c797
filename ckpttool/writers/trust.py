"""What ckpttool trusts where it writes: never a link.

A file in a staging directory, a journal, a lock file: each is written or kept only when it is what ckpttool
makes, a regular file of this user with one link (a directory of this user), checked without following a link
(:func:`untrusted`). New output files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (:func:`create_file`):
a symbolic link named like an output file would make the write land in the file it points to, and a hard link
would publish (or let someone change) a file that lives elsewhere too.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path

from ckpttool.errors import DestinationError

__all__ = ["Lock", "create_file", "read_journal", "untrusted"]


def untrusted(path: Path, *, directory: bool = False) -> str | None:
    """Why ckpttool must not trust ``path`` as one of its own files (``directory``: its own directory), in words,
    or None when it may: it is a regular file with exactly one link (a directory), owned by this user.

    A symbolic link or a hard link would make a write land in (or publish) a file elsewhere; another user's
    entry is not ckpttool's to take over. Never follows a link.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        return "gone"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link to '{os.readlink(path)}'"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
    if not directory and st.st_nlink != 1:
        return f"a file with {st.st_nlink} hard links (another name shares its bytes)"
    if st.st_uid != os.geteuid():
        return f"owned by another user (uid {st.st_uid})"
    return None


def read_journal(path: Path) -> dict | None:
    """The JSON object of the journal file at ``path``, or None when it is not one (unreadable, not JSON, not a
    regular file). Never follows a link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read()) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def create_file(path: Path) -> int:
    """Open a new output file for writing, replacing the name ``path`` if it exists: an earlier file (or a link) of
    that name is unlinked, never written through, and the file is created anew (``O_EXCL | O_NOFOLLOW``).
    Returns its descriptor; raises ``OSError``."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)


class Lock:
    """An exclusive ``flock`` on a lock file beside the destination, removed on release.

    The file is created new (``O_CREAT | O_EXCL | O_NOFOLLOW``). One that is there already (left by a run that
    was killed, or held by a running one) is opened without following a link and locked only when it is a
    regular file with one link: a symbolic or hard link named like the lock is refused, never truncated nor
    written. Our process id is written only into a file of this user, for the message of a second run.
    """

    def __init__(self, path: Path, dest: Path) -> None:
        self.path = path
        self.dest = dest
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise DestinationError(f"cannot lock '{dest}' ('{path.name}'): {e.strerror or e}") from None
                raise DestinationError(
                    f"destination '{dest}' is being written by another ckpttool run (process {holder or '?'}, lock "
                    f"'{path}'); wait for it to finish or stop it, then run again"
                ) from None
            try:  # the previous holder may have removed the file between our open and our lock
                if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        if os.fstat(fd).st_uid == os.geteuid():
            try:  # who holds the lock, for the message of a second run; a full disk only loses that
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass
        self._fd: int | None = fd

    def _open(self) -> int:
        """A new lock file, or the one there when it is a plain lock file (see the class)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                return os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pass
            try:
                fd = os.open(self.path, flags | os.O_NONBLOCK)
            except FileNotFoundError:  # removed by its holder between the two opens: create it again
                return self._open()
        except OSError as e:
            if not os.path.islink(self.path):
                raise DestinationError(f"cannot lock '{self.dest}' ('{self.path.name}'): {e.strerror or e}") from None
            raise DestinationError(
                f"cannot lock '{self.dest}': '{self.path}' is a symbolic link to '{os.readlink(self.path)}', not a "
                "lock file of ckpttool; nothing was written through it. Remove it if no ckpttool run is writing there"
            ) from None
        st = os.fstat(fd)
        problem = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"a file with {st.st_nlink} hard links" if st.st_nlink != 1 else None)
        if problem is not None:
            os.close(fd)
            raise DestinationError(f"cannot lock '{self.dest}': '{self.path}' is {problem}, not a lock file of "
                                   "ckpttool; nothing was written to it. Remove it if no ckpttool run is writing there")
        return fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (once; later calls do nothing)."""
        if self._fd is not None:
            try:
                self.path.unlink(missing_ok=True)
            finally:
                os.close(self._fd)
                self._fd = None
