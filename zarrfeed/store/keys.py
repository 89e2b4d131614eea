"""Partition keys and asset paths that cannot escape the store root.

Keys come from file names and hub paths.  :func:`sanitise_key` maps any name onto
``[A-Za-z0-9._-]``; :func:`check_key` refuses anything that is not already canonical, so a
hostile key (``../x``, ``/etc``, ``a/b``) fails loudly instead of being rewritten silently.
Names starting with ``.`` or ``_`` are reserved for zarrfeed's own files (staging, markers).
"""

from __future__ import annotations

import re

from zarrfeed.errors import InvalidKeyError

MAX_KEY_LENGTH = 200
_KEY = re.compile(r"[A-Za-z0-9-][A-Za-z0-9._-]*")
_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def sanitise_key(name: str) -> str:
    """A canonical key for ``name``: other characters become ``_``, leading ``._`` are dropped.

    ``"train_1_a_1.nii.gz"`` stays as it is; ``"scan 01/../x"`` becomes ``"scan_01_.._x"``.
    """
    key = _BAD.sub("_", name).lstrip("._")[:MAX_KEY_LENGTH]
    if not key:
        raise InvalidKeyError(f"no usable characters in {name!r} for a partition key")
    return key


def check_key(key: str) -> str:
    """Return ``key`` if it is canonical, else raise :class:`InvalidKeyError`."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH or not _KEY.fullmatch(key):
        raise InvalidKeyError(
            f"invalid partition key {key!r}: use up to {MAX_KEY_LENGTH} characters of "
            "[A-Za-z0-9._-], not starting with '.' or '_' (see sanitise_key)"
        )
    return key


def check_asset(asset: str) -> str:
    """An asset path such as ``ct/windows``: '/'-separated segments that are valid keys."""
    if not isinstance(asset, str) or not asset:
        raise InvalidKeyError(f"invalid asset path {asset!r}")
    for segment in asset.split("/"):
        try:
            check_key(segment)
        except InvalidKeyError:
            raise InvalidKeyError(f"invalid asset path {asset!r} (segment {segment!r})") from None
    return asset
