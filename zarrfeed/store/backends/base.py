"""The interface every backend serves: the few operations the store needs from storage.

Paths passed in and returned are full backend paths (``/abs/root/...`` or ``bucket/prefix/...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from zarrfeed.errors import StoreError
from zarrfeed.store.backends.errors import disk_problem, redact, refused_credentials

if TYPE_CHECKING:
    import zarr


class Backend:
    """Storage for one store root.  ``url`` names it for people; ``identity`` is what makes
    its bytes unique on this machine (the resolved path, or the URL plus the endpoint)."""

    root: str
    url: str
    identity: str
    endpoint: str | None = None
    storage_options: dict[str, Any] = {}  # noqa: RUF012  (read-only class default)

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def location(self, path: str) -> str:
        """``path`` as a person would name it (a URL on an object store)."""
        return path

    def failure(self, operation: str, path: str | Sequence[str], exc: BaseException) -> StoreError:
        """The error for a failed ``operation`` on ``path``, safe to log: it names the
        object and the server, never a credential.  A full disk, a denied permission or a
        read-only file system says so, with the free space or the mode and owner; the
        credentials are named only when the server refused them."""
        where = self.location(path) if isinstance(path, str) else f"{len(path)} objects"
        local = self.local_path(path, exc)
        problem = disk_problem(exc, local) if local else None
        if problem:
            return StoreError(f"could not {operation} {where}: {problem}")
        server = f" at {self.endpoint}" if self.endpoint else ""
        text = redact(f"{type(exc).__name__}: {exc}", self.storage_options)
        retried = ", retries included" if self.retried else ""
        if self.retried and refused_credentials(exc, text):
            advice = (
                f"the store {self.url}{server} refused these credentials: check that they "
                f"allow {operation} there"
            )
        else:
            advice = f"check that the store {self.url}{server} is reachable and allows {operation}"
        return StoreError(
            f"could not {operation} {where} ({text}){retried}: {advice}, then run it again"
        )

    retried = False  # whether the client retried a failure before it reached failure()

    def local_path(self, path: str | Sequence[str], exc: BaseException) -> str | None:
        """The file on this machine's disks that ``exc`` failed on, if there is one."""
        return None

    def read(self, path: str) -> bytes:
        """The whole object; ``FileNotFoundError`` when it does not exist."""
        raise NotImplementedError

    def read_many(self, paths: Sequence[str], threads: int = 8) -> list[bytes | None]:
        """Many objects at once (None where one is missing), in the order given."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes, parents: bool = True) -> None:
        """Publish ``data`` at ``path``: readers see the old object or the new one, whole.
        Without ``parents``, a folder removed meanwhile is not made again: the write fails
        with ``FileNotFoundError`` (object stores have no folders to make)."""
        raise NotImplementedError

    def put_many(self, folder: str, objects: dict[str, bytes]) -> None:
        """Write objects (key relative to ``folder`` → bytes) into a folder nobody reads yet."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def list_dir(self, path: str) -> list[str]:
        """Names of the entries directly under ``path`` (empty when it does not exist)."""
        raise NotImplementedError

    def list_stamps(self, path: str) -> dict[str, tuple[int, str]]:
        """Name → (size, change stamp) of the objects directly under ``path``; the stamp
        changes whenever the object is rewritten (mtime locally, ETag on object stores)."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Remove one object; a missing one is not an error."""
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Remove everything under ``path``; a missing tree is not an error."""
        raise NotImplementedError

    def tree_bytes(self, path: str) -> int:
        """Bytes stored under ``path``."""
        raise NotImplementedError

    def sizes(self, path: str) -> dict[str, int]:
        """Bytes of every object under ``path``, by path (empty where there is none)."""
        raise NotImplementedError

    def persist(self, path: str) -> None:
        """Make everything under ``path`` survive a power loss before a commit names it.

        Nothing to do where a write is durable once acknowledged (S3, GCS)."""

    def zarr_store(self, path: str, read_only: bool) -> zarr.abc.store.Store:
        raise NotImplementedError
