"""Cache folders private to the account that made them.

Caches live in world-writable places (``/dev/shm``, a shared ``/tmp``) under names any
account can work out from the store, so a cache folder found there proves nothing: another
account may have made it, filled it with values of its choosing, or left a symbolic link to a
folder of yours.  Every cache therefore lives under a *root* of its owner,
``<base>/zarrfeed-<uid>``, made with ``os.mkdir`` (never through a link) at mode ``0700``, and
the root and each folder inside are checked with ``lstat`` each time a cache is opened: a
directory, not a link, owned by this account, mode exactly ``0700``.  Anything else is refused
with a :class:`~zarrfeed.errors.ConfigError` that names the folder, its owner and mode, and
the fix.  Files are made ``0600``, whatever the umask.

Sharing caches between accounts is explicit: ``ZARRFEED_CACHE_GROUP`` names a group (or a
gid) this account belongs to.  The root is then ``<base>/zarrfeed-g<gid>``, owned by that
group, folders ``2770`` (setgid: what is made inside keeps the group) and files ``0660``; a
folder passes when its group is that group and its owner this account, root, or a member.

The checks cost a few ``lstat`` calls per open of a cache, none per sample.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from zarrfeed.errors import ConfigError

GROUP_VAR = "ZARRFEED_CACHE_GROUP"
SETTLE_S = 1.0  # a folder of ours whose creator is still setting its mode, at most this long


@dataclass(frozen=True)
class Access:
    """Who may use the caches: this account alone (``gid`` None) or a group's members."""

    uid: int
    gid: int | None = None

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    @property
    def root_name(self) -> str:
        return f"zarrfeed-{self.uid}" if self.gid is None else f"zarrfeed-g{self.gid}"

    def open(self, path: str | os.PathLike, flags: int) -> int:
        """``os.open`` of a cache file, never through a link, made at :attr:`file_mode`
        (usable as the ``opener`` of :func:`open`)."""
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, self.file_mode)
        if self.gid is not None and flags & os.O_CREAT:  # the umask may have taken g+rw
            st = os.fstat(fd)
            if st.st_uid == self.uid and stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)
        return fd

    def mkdir(self, path: str | os.PathLike) -> None:
        """Make one folder at :attr:`dir_mode` (FileExistsError if something is there)."""
        os.mkdir(path, 0o700)  # private until its group and mode are set
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
            if stat.S_IMODE(os.fstat(fd).st_mode) != self.dir_mode:
                os.fchmod(fd, self.dir_mode)
        finally:
            os.close(fd)

    def ensure(self, path: str | os.PathLike) -> Path:
        """``path`` as a checked cache folder, made if missing (see :func:`check`)."""
        path = Path(path)
        try:
            os.lstat(path)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # made meanwhile: checked below
                self.mkdir(path)
        return self.check(path)

    def check(self, path: str | os.PathLike) -> Path:
        """``path`` if it is a directory (not a link) that this access owns at its mode;
        else a :class:`ConfigError` naming it, its owner and mode, and the fix."""
        path = Path(path)
        deadline = time.monotonic() + SETTLE_S
        while True:
            st = os.lstat(path)
            problem = self._problem(path, st)
            if problem is None:
                return path
            settling = stat.S_ISDIR(st.st_mode) and self._trusted(st.st_uid)
            if not settling or time.monotonic() > deadline:  # else: its maker is on it
                raise ConfigError(problem)
            time.sleep(0.01)

    def _problem(self, path: Path, st: os.stat_result) -> str | None:
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            found = f"a symbolic link (to {os.readlink(path)}) owned by {_user(st.st_uid)}"
        elif not stat.S_ISDIR(st.st_mode):
            found = f"not a directory (owned by {_user(st.st_uid)}, mode {mode:04o})"
        elif not self._trusted(st.st_uid) or mode != self.dir_mode:
            found = f"owned by {_user(st.st_uid)} with mode {mode:04o}"
        elif self.gid is not None and st.st_gid != self.gid:
            found = f"of group {_group(st.st_gid)}, not {_group(self.gid)}"
        else:
            return None
        if self.gid is None:
            wanted = f"a directory owned by {_user(self.uid)} with mode {self.dir_mode:04o}"
            share = f"; to share caches with a group, set {GROUP_VAR}"
        else:
            wanted = (
                f"a directory of group {_group(self.gid)} ({GROUP_VAR}) owned by a member, "
                f"mode {self.dir_mode:04o}"
            )
            share = ""
        return (
            f"cache folder {path} is {found}; expected {wanted}.  Another account may have "
            f"made it: its contents are not used.  Remove it (rm -rf {path}) if nothing "
            f"of yours is in it{share}"
        )

    def _trusted(self, uid: int) -> bool:
        if uid == self.uid:
            return True
        return self.gid is not None and (uid == 0 or _member(uid, self.gid))


def access() -> Access:
    """The access the environment sets: this account alone, or ``ZARRFEED_CACHE_GROUP``."""
    return _access(os.geteuid(), os.environ.get(GROUP_VAR, "").strip())


@functools.lru_cache(maxsize=8)
def _access(uid: int, group: str) -> Access:
    if not group:
        return Access(uid)
    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"{GROUP_VAR}={group}: no such group on this machine") from None
    if uid != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(
            f"{GROUP_VAR}={group}: {_user(uid)} is not a member of group {_group(gid)}; "
            f"add the account to it (and log in again) or unset {GROUP_VAR}"
        )
    return Access(uid, gid)


def check_base(base: str | os.PathLike) -> Path:
    """The folder that holds roots, made if missing; refused when other accounts could
    rename or remove what is in it (writable by all without the sticky bit)."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    st = os.stat(base)
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"cache base {base} (owned by {_user(st.st_uid)}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}) is writable by every account without the sticky "
            f"bit, so they could replace the caches in it: chmod +t {base}, or move the "
            "caches (ZARRFEED_CACHE_ROOT, ZARRFEED_DISK_CACHE)"
        )
    return base


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def _member(uid: int, gid: int) -> bool:
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
