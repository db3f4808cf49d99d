"""Open what a job's user names, with that user's rights, while running as root.

The agent reads paths that users choose: ``--output``/``--error`` files and
``ckpt=`` globs. Opened plainly as root, ``--output=/root/.ssh/id_rsa``, or an
output directory swapped for a link to ``/etc`` once the job has started,
would hand root's files to the user through the API. So these paths are
resolved here the way the kernel would resolve them for the user, with the
checks made on what was actually opened:

* Only absolute paths. The walk starts at ``/`` and opens one component at a
  time relative to the directory before it (``openat``, ``O_PATH|O_NOFOLLOW``):
  no name is looked up twice, so a swap after a check changes nothing.
* A symbolic link is followed only when root owns it. Users cannot make such
  links, and sites keep working whose ``/home`` is a link to ``/gpfs/home``.
  At most 40 links per path, as the kernel allows.
* ``..`` goes to the parent of the directory reached so far, as the kernel does
  (Slurm hands out ``WORKDIR/../logs/x.out`` for ``--output=../logs/x.out``);
  the parent is checked like any other directory.
* A name is looked up in a directory only when the user may search it (the mode
  bits for owner, group or other against the user's uid and groups); so a
  refusal never tells the user what lies in a directory they cannot search.
* The file opened must be a regular file (never a FIFO or a device: the type is
  read from an ``O_PATH`` descriptor before anything is opened for reading),
  owned by the job's user (a hard link to a root-owned file is refused) and
  readable by them. The pseudo file systems ``/proc``, ``/sys`` and ``/dev`` are
  refused whatever the rights.
* A directory is listed only when the user may read and search it; entries are
  looked at with ``fstatat(AT_SYMLINK_NOFOLLOW)``, links among them not followed.

POSIX ACLs are not consulted, only mode bits: an ACL that grants more than the
mode bits is not honoured (the safe side), and since files must be the user's
own, an ACL can only matter on the directories above them.

Refusals raise :class:`NotFollowed` (an ``OSError``) naming the component and
the reason; a missing component raises ``FileNotFoundError`` as ``open`` would.
"""
from __future__ import annotations

import errno
import fnmatch
import functools
import glob as _glob
import os
import pwd
import stat
import time
from dataclasses import dataclass, field
from collections import OrderedDict
from typing import Callable, Iterator, NamedTuple

__all__ = ["AGENT", "Dir", "DirCache", "Match", "NotFollowed", "Rights", "glob", "kind", "open_for",
           "open_in"]

MAX_LINKS = 40           # symbolic links followed in one path (the kernel's limit)
PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
RIGHTS_TTL = 600.0       # group memberships are looked up again after this
DIR_RECHECK = 30.0       # a directory a DirCache keeps is walked again after this
DIR_MAX = 512            # directories a DirCache keeps open
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


class NotFollowed(OSError):
    """A path the agent will not read for a user: the message names the
    component and why (a link, a permission, an owner, a type, a root)."""


@dataclass(frozen=True)
class Rights:
    """Whose rights a path is resolved with: a uid, its primary gid and every
    group it belongs to. ``uid`` None: the user is not known, nothing is opened.
    ``any_owner``: files need not belong to ``uid`` (the agent's own view)."""

    uid: int | None
    gid: int | None = None
    groups: frozenset[int] = field(default_factory=frozenset)
    any_owner: bool = False

    def __str__(self) -> str:
        return "the agent" if self.any_owner else f"uid {self.uid}"

    @classmethod
    def of(cls, uid: int, gid: int | None = None) -> "Rights":
        """The rights of ``uid`` (with ``gid`` as its group, else its passwd
        group) and its supplementary groups, looked up once per RIGHTS_TTL."""
        key = (uid, gid)
        now = time.monotonic()
        hit = _CACHE.get(key)
        if hit is not None and now - hit[0] < RIGHTS_TTL:
            return hit[1]
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:      # a uid the agent host does not know: no other groups
            entry = None
        if gid is None and entry is not None:
            gid = entry.pw_gid
        groups = {gid} if gid is not None else set()
        if entry is not None:
            try:
                groups.update(os.getgrouplist(entry.pw_name, entry.pw_gid if gid is None
                                              else gid))
            except OSError:
                pass
        rights = cls(uid, gid, frozenset(groups))
        if len(_CACHE) > 10_000:
            _CACHE.clear()
        _CACHE[key] = (now, rights)
        return rights

    @classmethod
    def of_job(cls, job) -> "Rights":
        """The rights of a job's user (a :class:`~recovery_agent.scheduler.base.Job`):
        its uid and gid as Slurm reports them, else its user name looked up; an
        unknown user gets no rights at all, never root's."""
        uid = getattr(job, "user_id", None)
        if uid is None and getattr(job, "user", ""):
            try:
                uid = pwd.getpwnam(job.user).pw_uid
            except KeyError:
                uid = None
        if uid is None:
            return cls(None)
        return cls.of(uid, getattr(job, "group_id", None))

    def allows(self, st: os.stat_result, bit: int) -> bool:
        """Whether the mode bits of ``st`` grant ``bit`` (4 read, 1 search) to
        these rights, as the kernel decides without ACLs: the owner class if the
        uid owns it, else the group class if a group does, else other."""
        if self.uid == 0:
            return True
        if st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid in self.groups:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)

    def owns(self, st: os.stat_result) -> bool:
        return self.any_owner or st.st_uid == self.uid


AGENT = Rights(0, 0, frozenset({0}), any_owner=True)
_CACHE: dict[tuple[int, int | None], tuple[float, Rights]] = {}


def kind(mode: int) -> str:
    """What a file of mode ``mode`` is, in words ("a FIFO")."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _join(where: str, name: str) -> str:
    return where.rstrip("/") + "/" + name


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return path in roots or path.startswith(_prefixes(roots))


@functools.lru_cache(maxsize=64)
def _prefixes(roots: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(root.rstrip("/") + "/" for root in roots)


class Dir:
    """A directory reached with some rights: an ``O_PATH`` descriptor and the
    path it was reached by (after root's links). Close it, or use ``with``."""

    def __init__(self, fd: int, where: str, rights: Rights, asked: str = "") -> None:
        self.fd, self.where, self.rights = fd, where, rights
        self.asked = asked or where     # the path as the user wrote it, for messages
        self.links = 0
        self._st = os.fstat(fd)

    @classmethod
    def root(cls, rights: Rights, asked: str = "") -> "Dir":
        if rights.uid is None:
            raise NotFollowed(f"{asked or '/'}: the job's user is not known (no uid); "
                              "its files are not read")
        return cls(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), "/", rights,
                   asked)

    @classmethod
    def open(cls, path: str, rights: Rights) -> "Dir":
        """The directory ``path`` names, walked from ``/``."""
        if not os.path.isabs(path):
            raise NotFollowed(f"{path}: not an absolute path")
        here = cls.root(rights, path)
        try:
            here.enter(path)
        except BaseException:
            here.close()
            raise
        return here

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- walking -----------------------------------------------------------
    def _move(self, fd: int, where: str) -> None:
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        os.close(self.fd)
        self.fd, self.where, self._st = fd, where, st

    def refuse(self, where: str, why: str, asked: str | None = None) -> NotFollowed:
        """The refusal of ``where`` (reached on the way to ``asked``) for ``why``."""
        asked = asked or self.asked
        if where == asked:
            return NotFollowed(f"{where} {why}")
        return NotFollowed(f"{asked}: {where} {why}")

    def _searchable(self) -> None:
        if not self.rights.allows(self._st, 1):
            raise self.refuse(self.where, f"is not searchable by {self.rights}")

    def lstat(self, name: str) -> os.stat_result:
        """The lstat of ``name`` here, if these rights may search this directory."""
        self._searchable()
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def _peek(self, name: str) -> tuple[int, os.stat_result]:
        """``name`` in this directory, opened O_PATH without following it."""
        self._searchable()
        fd = os.open(name, _PATH_FLAGS, dir_fd=self.fd)
        try:
            return fd, os.fstat(fd)
        except OSError:
            os.close(fd)
            raise

    def _link(self, fd: int, st: os.stat_result, name: str) -> str:
        """The target of the link ``fd`` (closed here), if it may be followed."""
        try:
            here = _join(self.where, name)
            if st.st_uid != 0:
                raise self.refuse(here, f"is a symbolic link owned by uid {st.st_uid}; "
                                        "only links root owns are followed")
            self.links += 1
            if self.links > MAX_LINKS:
                raise NotFollowed(f"{self.asked}: more than {MAX_LINKS} symbolic links")
            target = os.readlink("", dir_fd=fd)    # readlinkat on the link itself
        finally:
            os.close(fd)
        if target.startswith("/"):
            self._move(os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), "/")
        return target

    def enter(self, path: str) -> None:
        """Walk down ``path`` (relative to here, or absolute), every component a
        directory; root's links followed, ``..`` to the real parent."""
        for name in path.split("/"):
            if name in ("", "."):
                continue
            if name == "..":
                self._searchable()
                self._move(os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC,
                                   dir_fd=self.fd), os.path.dirname(self.where) or "/")
                continue
            fd, st = self._peek(name)
            if stat.S_ISLNK(st.st_mode):
                self.enter(self._link(fd, st, name))
            elif stat.S_ISDIR(st.st_mode):
                self._move(fd, _join(self.where, name))
            else:
                os.close(fd)
                raise NotADirectoryError(errno.ENOTDIR, f"{_join(self.where, name)} is "
                                         f"{kind(st.st_mode)}, not a directory", self.asked)

    def child(self, name: str) -> "Dir":
        """The subdirectory ``name`` (a listed entry: links are not followed)."""
        fd, st = self._peek(name)
        if not stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", name)
        sub = Dir(fd, _join(self.where, name), self.rights, _join(self.asked, name))
        return sub

    # -- files -------------------------------------------------------------
    def final(self, name: str) -> tuple[str, os.stat_result]:
        """Resolve the last component ``name`` (root's links followed): leaves
        this Dir at its directory; returns the name there and its lstat."""
        if name in ("", ".", ".."):
            raise NotFollowed(f"{self.asked}: names a directory, not a file")
        fd, st = self._peek(name)
        if not stat.S_ISLNK(st.st_mode):
            os.close(fd)
            return name, st
        target = self._link(fd, st, name).rstrip("/")
        head, _, tail = target.rpartition("/")
        if head or target.startswith("/"):
            self.enter(head or "/")
        return self.final(tail)

    def check_file(self, name: str, st: os.stat_result, asked: str | None = None) -> None:
        """Refuse ``st`` unless it is a regular file these rights own and may read."""
        path = _join(self.where, name)
        if not stat.S_ISREG(st.st_mode):
            raise self.refuse(path, f"is {kind(st.st_mode)}, not a regular file", asked)
        if not self.rights.owns(st):
            raise self.refuse(path, f"is owned by uid {st.st_uid}, not by the job's user "
                                    f"({self.rights})", asked)
        if not self.rights.allows(st, 4):
            raise self.refuse(path, f"is not readable by {self.rights}", asked)

    def open_file(self, name: str, looked: os.stat_result, asked: str | None = None) -> int:
        """Open the regular file ``name`` here for reading. ``looked`` is its
        lstat, checked first so that a FIFO or a device is never opened, even
        briefly; every check is made again on the descriptor opened, which must
        be the inode looked at."""
        asked = asked or self.asked
        self._searchable()
        self.check_file(name, looked, asked)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotFollowed(f"{asked}: became a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (looked.st_dev, looked.st_ino):
                raise NotFollowed(f"{asked}: replaced while being opened")
            self.check_file(name, st, asked)
        except BaseException:
            os.close(fd)
            raise
        return fd

    # -- listing -----------------------------------------------------------
    def entries(self, take: Callable[[], bool] | None = None
                ) -> Iterator[tuple[str, os.stat_result]]:
        """(name, lstat) of each entry, when these rights may read and search
        this directory; ``take`` is asked before each entry (False stops)."""
        if not (self.rights.allows(self._st, 4) and self.rights.allows(self._st, 1)):
            raise self.refuse(self.where, f"is not readable by {self.rights}")
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (self._st.st_dev, self._st.st_ino):
                raise NotFollowed(f"{self.asked}: replaced while being listed")
            with os.scandir(fd) as found:
                for entry in found:
                    if take is not None and not take():
                        return
                    try:
                        yield entry.name, entry.stat(follow_symlinks=False)
                    except OSError:
                        continue      # gone since the listing
        finally:
            os.close(fd)


class DirCache:
    """Directories walked with some rights and kept open (``O_PATH``), least
    recently used closed past ``limit``: for files looked at again and again.

    A look at a file is then one ``fstatat`` in its kept directory, never a
    lookup by path as root through directories the user may have swapped for
    links (which, through what the agent then says, would tell the user what
    exists where only root can look). An entry is walked again after
    DIR_RECHECK seconds, one step from its parent's entry (ancestors are kept
    too, so a miss costs one step), so a directory swapped after the job started
    is refused within that time, and one moved away is followed no longer.
    """

    def __init__(self, limit: int = DIR_MAX) -> None:
        self.limit = limit
        self._dirs: OrderedDict[tuple[str, Rights], tuple[float, Dir]] = OrderedDict()

    def get(self, folder: str, rights: Rights, depth: int = 0) -> Dir:
        """The directory ``folder`` as ``rights`` reach it (NotFollowed, or
        FileNotFoundError, as the walk meets them)."""
        key = (folder, rights)
        now = time.monotonic()
        hit = self._dirs.get(key)
        if hit is not None and now - hit[0] < DIR_RECHECK:
            self._dirs.move_to_end(key)
            return hit[1]
        self._drop(key)
        parent, name = os.path.split(folder)
        if name and parent != folder and depth < 64:
            base = self.get(parent, rights, depth + 1)
            found = Dir(os.dup(base.fd), base.where, rights, folder)
            try:
                found.enter(name)
            except BaseException:
                found.close()
                raise
        else:
            found = Dir.open(folder, rights)
        self._dirs[key] = (now, found)
        while len(self._dirs) > self.limit:
            self._drop(next(iter(self._dirs)))
        return found

    def _drop(self, key) -> None:
        old = self._dirs.pop(key, None)
        if old is not None:
            old[1].close()

    def close(self) -> None:
        for key in list(self._dirs):
            self._drop(key)


def open_for(path: str, rights: Rights, roots: tuple[str, ...] = ()) -> int:
    """A read-only descriptor of the regular file ``path``, resolved with
    ``rights`` (see the module docstring). ``roots``: when given, the file's
    resolved path must lie under one of them."""
    folder, name = os.path.split(path)
    if not os.path.isabs(path):
        raise NotFollowed(f"{path}: not an absolute path")
    with Dir.open(folder, rights) as here:
        here.asked = path
        name, looked = here.final(name)
        return _open_checked(here, name, looked, roots, path)


def open_in(here: Dir, name: str, roots: tuple[str, ...] = (), asked: str = "",
            looked: os.stat_result | None = None) -> int:
    """As :func:`open_for`, for the file ``name`` in the directory ``here``
    (already walked); a link there is refused, not followed. ``looked``: the
    ``here.lstat(name)`` just made, if the caller has it."""
    asked = asked or _join(here.asked, name)
    looked = looked or here.lstat(name)
    if stat.S_ISLNK(looked.st_mode):
        raise NotFollowed(f"{asked} is a symbolic link; not followed")
    return _open_checked(here, name, looked, roots, asked)


def _open_checked(here: Dir, name: str, looked: os.stat_result, roots: tuple[str, ...],
                  asked: str) -> int:
    where = _join(here.where, name)
    if _under(where, PSEUDO_ROOTS):
        raise here.refuse(where, "is on a pseudo file system (/proc, /sys, /dev)", asked)
    if roots and not _under(where, roots):
        raise here.refuse(where, f"is outside the allowed log roots (agent.log_roots: "
                                 f"{', '.join(roots)})", asked)
    return here.open_file(name, looked, asked)


class Match(NamedTuple):
    """A glob match: its path, the directory holding it (open while the match
    is looked at) and its lstat."""

    path: str
    parent: Dir
    name: str
    st: os.stat_result


def glob(pattern: str, rights: Rights, take: Callable[[], bool] | None = None,
         hidden: bool = False) -> Iterator[Match]:
    """Matches of an absolute glob ``pattern`` (``*``, ``?``, ``[...]``; ``**`` is
    one level) resolved with ``rights``: literal components walked as by
    :func:`open_for`, a magic one matched against a listing of its directory
    (only one these rights may read and search). Entries that are links are
    never followed, nor entered. Names starting with a dot match only a pattern
    that does (or any, with ``hidden``). Unreadable or missing parts match
    nothing; ``take`` is asked before each directory entry read (False stops)."""
    if not os.path.isabs(pattern):
        raise NotFollowed(f"{pattern}: not an absolute path")
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not parts:
        return
    first = next((i for i, p in enumerate(parts) if _glob.has_magic(p)), len(parts) - 1)
    try:
        base = Dir.open("/" + "/".join(parts[:first]), rights)
    except OSError:
        return
    with base:
        yield from _glob_in(base, parts[first:], take, hidden)


def _glob_in(here: Dir, parts: list[str], take, hidden: bool) -> Iterator[Match]:
    if _under(here.where, PSEUDO_ROOTS):
        return
    head, rest = parts[0], parts[1:]
    magic = _glob.has_magic(head)
    seen: dict[str, os.stat_result] = {}
    if magic:
        want = head.replace("**", "*")
        try:
            seen = {name: st for name, st in here.entries(take)
                    if (hidden or not name.startswith(".") or head.startswith("."))
                    and fnmatch.fnmatchcase(name, want)}
        except OSError:
            return
    for name in sorted(seen) if magic else [head]:
        try:
            if not rest:
                shown = _join(here.asked, name)
                if magic:
                    st = seen[name]
                else:               # a literal last part: root's links are followed
                    name, st = here.final(name)
                yield Match(shown, here, name, st)
                continue
            if magic:
                if not stat.S_ISDIR(seen[name].st_mode):
                    continue
                sub = here.child(name)
            else:
                sub = _literal(here, name)
        except OSError:
            continue
        with sub:
            yield from _glob_in(sub, rest, take, hidden)


def _literal(here: Dir, name: str) -> Dir:
    """A literal directory component below a glob's match (root's links followed)."""
    sub = Dir(os.dup(here.fd), here.where, here.rights, _join(here.asked, name))
    try:
        sub.enter(name)
    except BaseException:
        sub.close()
        raise
    return sub
