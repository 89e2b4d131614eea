"""Storage failures as errors a person can act on: a full disk, a denied permission, a
read-only file system or refused credentials say so, and no credential is ever shown."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from typing import Any

# Options and variables that hold secrets: their values are blanked out of every error text.
_SECRET_OPTIONS = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key",
                   "aws_session_token")  # fmt: skip
_SECRET_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

_NO_SPACE = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
_NO_PERMISSION = (errno.EACCES, errno.EPERM)
# What S3-compatible servers answer when they refuse a request's credentials; s3fs turns a
# 403 into a PermissionError.
_REFUSED = re.compile(
    r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|InvalidToken|"
    r"InvalidClientTokenId|\b403\b|Forbidden"
)


def refused_credentials(exc: BaseException, text: str) -> bool:
    """Whether an object store's error says it refused the credentials (not a lost
    connection, a server error or a missing bucket)."""
    return isinstance(exc, PermissionError) or bool(_REFUSED.search(text))


def nearest_existing(path: str) -> str:
    """``path``, or its nearest parent that exists."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def disk_problem(exc: BaseException, path: str) -> str | None:
    """What a person must fix when a local write failed for want of space, permission or a
    writable file system — with the free space, or the mode and owner of the nearest
    existing part of ``path`` — or None for any other failure."""
    code = getattr(exc, "errno", None)
    if not isinstance(exc, OSError) or code is None:
        return None
    name = errno.errorcode.get(code, str(code))
    here = nearest_existing(path)
    if code in _NO_SPACE:
        try:
            usage = shutil.disk_usage(here)
            room = f"{usage.free / 1e9:.2f} GB free of {usage.total / 1e9:.2f} GB"
        except OSError:
            room = "its free space unknown"
        return (
            f"{_NO_SPACE[code]} ({name}); the file system of {here} has {room}: free space "
            "there (or raise the quota) or put the store on another disk, then run it again"
        )
    if code in _NO_PERMISSION:
        return (
            f"permission denied ({name}); {describe_access(here)}: give this user write "
            "access there or put the store elsewhere, then run it again"
        )
    if code == errno.EROFS:
        return (
            f"read-only file system ({name}) at {here}: remount it read-write or put the "
            "store elsewhere, then run it again"
        )
    return None


def describe_access(path: str) -> str:
    """``path``'s mode and owner, and who this process runs as."""
    import grp
    import pwd
    import stat

    def user(uid: int) -> str:
        with contextlib.suppress(KeyError):
            return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
        return f"uid {uid}"

    def group(gid: int) -> str:
        with contextlib.suppress(KeyError):
            return grp.getgrgid(gid).gr_name
        return str(gid)

    try:
        st = os.stat(path)
    except OSError as exc:
        return f"{path} cannot be examined ({exc.strerror})"
    mode = f"{stat.filemode(st.st_mode)} ({st.st_mode & 0o7777:04o})"
    return (
        f"{path} is mode {mode}, owned by {user(st.st_uid)}, group {group(st.st_gid)}; "
        f"this process runs as {user(os.geteuid())}"
    )


USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # to the last "@", as urllib splits it


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """``text`` with every credential value known here (options, ``client_kwargs``, the
    standard AWS variables, and the ``user:password@`` of any URL, such as an endpoint's)
    replaced by ``***``."""
    text = USERINFO.sub("***@", text)
    options = options or {}
    nested = options.get("client_kwargs") or {}
    values = [options.get(k) for k in _SECRET_OPTIONS] + [nested.get(k) for k in _SECRET_OPTIONS]
    values += [os.environ.get(v) for v in _SECRET_VARIABLES]
    for value in sorted({v for v in values if isinstance(v, str) and len(v) >= 4}, key=len)[::-1]:
        text = text.replace(value, "***")
    return text
