"""CT-RATE (``ibrahimhamamci/CT-RATE``) on the Hugging Face hub, through ``huggingface_hub``.

* The revision is resolved to a commit once per listing and every download is pinned to it,
  so a partition's provenance names the exact bytes.
* Listing walks only the split's ``*_fixed`` folder with the paginated tree API and is saved
  per commit next to the hub cache: a commit's tree never changes, so the next listing of the
  same commit reads it, and discovery also works offline (``HF_HUB_OFFLINE=1``) from the last
  listing, or from whatever files the cache holds.
* Downloads go through ``hf_hub_download`` (size/ETag checks, a cut transfer resumed with
  Range requests), and the listing through the client's paginated API: their retries are the
  client's own (back-off on network errors, 429 and 5xx while listing; resumes while
  transferring).  What still fails becomes one :class:`HubError` saying what to do, and the
  partition fails as retryable (Dagster's run retries try it again).
* The token comes from ``HF_TOKEN`` (or the argument) and never appears in an error.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx2  # huggingface_hub 2.x transport: its network errors
from huggingface_hub import HfApi, constants, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from zarrfeed.defaults import HUB_REPO
from zarrfeed.errors import ZarrfeedError
from zarrfeed.formats.ct import ct_stem
from zarrfeed.store.backends import LocalBackend
from zarrfeed.store.keys import sanitise_key

log = logging.getLogger(__name__)
# Saved listings of another format are never read: those before 2 kept one of two paths that
# give one key and dropped the other without a trace.
LISTING_FORMAT = 2
TABLES = {  # CT-RATE's own names: "validation" for metadata and reports, "valid" for labels
    "metadata": "dataset/metadata/{long}_metadata.csv",
    "labels": "dataset/multi_abnormality_labels/{split}_predicted_labels.csv",
    "reports": "dataset/radiology_text_reports/{long}_reports.csv",
}
NETWORK_ERRORS = (httpx2.TransportError, ConnectionError, TimeoutError)


class HubError(ZarrfeedError):
    """A hub request failed; the message says what to do (and never contains the token)."""


@dataclass(frozen=True)
class HubVolume:
    key: str
    path: str  # path in the repository
    size: int
    sha256: str | None  # LFS content hash, when the hub gives one
    conflict: tuple[str, ...] = ()  # other paths whose names give the same key


def by_key(volumes: Iterable[HubVolume]) -> dict[str, HubVolume]:
    """Key → volume.  Paths whose names give one key are one entry naming the others, so
    that partition fails naming them all (``assets.raw.resolve``); none is dropped."""
    found: dict[str, HubVolume] = {}
    for v in sorted(volumes, key=lambda v: v.path):
        first = found.setdefault(v.key, v)
        if first is not v:
            found[v.key] = replace(first, conflict=(*first.conflict, v.path))
    return found


class CTRateHub:
    """One split of a CT-RATE-style dataset repository."""

    def __init__(
        self,
        repo_id: str = HUB_REPO,
        revision: str = "main",
        split: str = "train",
        token: str | None = None,
        cache_dir: str | Path | None = None,
        endpoint: str | None = None,
        max_scans: int | None = None,
    ) -> None:
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
        self.repo_id, self.revision, self.split = repo_id, revision, split
        self._token = token or os.environ.get("HF_TOKEN") or None
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE)
        self.endpoint = endpoint or constants.ENDPOINT
        self.max_scans = max_scans
        self.api = HfApi(endpoint=self.endpoint, token=self._token or False)

    def __repr__(self) -> str:  # no token
        return f"CTRateHub({self.repo_id!r}, revision={self.revision!r}, split={self.split!r})"

    @property
    def _listings(self) -> Path:
        return self.cache_dir / "zarrfeed-listings" / self.repo_id.replace("/", "--")

    # errors --------------------------------------------------------------------------------
    def _explain(self, exc: Exception, what: str) -> HubError:
        if isinstance(exc, GatedRepoError) or _status(exc) in (401, 403):
            has = "the token in HF_TOKEN was refused" if self._token else "no HF_TOKEN is set"
            return HubError(
                f"{what}: access to {self.repo_id} denied ({has}). Accept the dataset's terms at "
                f"https://huggingface.co/datasets/{self.repo_id} and export HF_TOKEN with a read "
                "token (https://huggingface.co/settings/tokens)."
            )
        if isinstance(exc, EntryNotFoundError) or _status(exc) == 404:
            return HubError(f"{what}: not found in {self.repo_id} at revision {self.revision}")
        if isinstance(exc, RepositoryNotFoundError | RevisionNotFoundError):
            return HubError(
                f"{what}: repository {self.repo_id} or revision {self.revision} not found"
            )
        return HubError(f"{what}: {type(exc).__name__}: {_redact(str(exc), self._token)}")

    def _call(self, what: str, call):
        """``call()``, its failures explained: network errors and HTTP errors become a
        :class:`HubError` (the client has retried what it retries)."""
        try:
            return call()
        except OfflineModeIsEnabled:
            raise
        except NETWORK_ERRORS as exc:
            raise HubError(
                f"{what}: network failure ({type(exc).__name__}); nothing was committed, retry "
                "later"
            ) from exc
        except HfHubHTTPError as exc:
            raise self._explain(exc, what) from exc

    # revision and listing -----------------------------------------------------------------
    def resolve(self) -> str:
        """The commit the revision points to (from the last listing when offline)."""
        ref = self._listings / "refs" / self.revision
        try:
            sha = self._call(
                f"resolving {self.repo_id}@{self.revision}",
                lambda: self.api.dataset_info(self.repo_id, revision=self.revision).sha,
            )
        except (OfflineModeIsEnabled, HubError) as exc:
            if ref.exists() and (constants.HF_HUB_OFFLINE or "network failure" in str(exc)):
                return ref.read_text().strip()
            raise
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha)
        return sha

    def volumes(self) -> tuple[str, dict[str, HubVolume]]:
        """(commit, key → volume) for the split, capped at ``max_scans`` (sorted keys)."""
        if constants.HF_HUB_OFFLINE:
            sha, found = self._offline_listing()
        else:
            sha = self.resolve()
            found = self._saved_listing(sha)
            if found is None:
                found = self._online_listing(sha)
        keys = sorted(found)[: self.max_scans] if self.max_scans else sorted(found)
        return sha, {k: found[k] for k in keys}

    def _online_listing(self, sha: str) -> dict[str, HubVolume]:
        folder = f"dataset/{self.split}_fixed"

        def walk() -> list:
            return list(
                self.api.list_repo_tree(
                    self.repo_id, folder, recursive=True, repo_type="dataset", revision=sha
                )
            )

        entries = self._call(f"listing {folder}", walk)
        found = by_key(
            HubVolume(
                sanitise_key(ct_stem(Path(e.path))),
                e.path,
                int(e.size),
                getattr(getattr(e, "lfs", None), "sha256", None),
            )
            for e in entries
            if getattr(e, "size", None) is not None and e.path.endswith((".nii.gz", ".nii"))
        )
        # Whole or absent: it is read instead of the hub from now on.
        LocalBackend(self._listings).write_atomic(
            str(self._listing_path(sha)), json.dumps([asdict(v) for v in found.values()]).encode()
        )
        return found

    def _listing_path(self, sha: str) -> Path:
        return self._listings / sha / f"{self.split}.v{LISTING_FORMAT}.json"

    def _saved_listing(self, sha: str) -> dict[str, HubVolume] | None:
        """The listing saved for commit ``sha``, if there is a readable one."""
        path = self._listing_path(sha)
        try:
            saved = json.loads(path.read_text())
            return {v["key"]: HubVolume(**{**v, "conflict": tuple(v["conflict"])}) for v in saved}
        except FileNotFoundError:
            return None
        except (ValueError, TypeError, KeyError) as exc:
            log.warning(f"ignoring the unreadable listing {path} ({exc!r}): listing again")
            return None

    def _offline_listing(self) -> tuple[str, dict[str, HubVolume]]:
        ref = self._listings / "refs" / self.revision
        if ref.exists():
            sha = ref.read_text().strip()
            found = self._saved_listing(sha)
            if found is not None:
                return sha, found
        # No saved listing: whatever volumes the hub cache holds for the revision.
        repo = self.cache_dir / f"datasets--{self.repo_id.replace('/', '--')}"
        sha_file = repo / "refs" / self.revision
        if not sha_file.exists():
            raise HubError(
                f"offline and no cached listing or snapshot of {self.repo_id}@{self.revision} "
                f"under {self.cache_dir}: run once online first"
            )
        sha = sha_file.read_text().strip()
        snap = repo / "snapshots" / sha
        found = by_key(
            HubVolume(sanitise_key(ct_stem(p)), str(p.relative_to(snap)), p.stat().st_size, None)
            for p in (snap / f"dataset/{self.split}_fixed").rglob("*.nii*")
        )
        return sha, found

    # files ---------------------------------------------------------------------------------
    def download(self, path: str, revision: str) -> Path:
        """A file of the repository at ``revision`` (from the cache when it is there)."""

        def get() -> str:
            return hf_hub_download(
                self.repo_id,
                path,
                repo_type="dataset",
                revision=revision,
                cache_dir=self.cache_dir,
                token=self._token or False,
                endpoint=self.endpoint,
            )

        try:
            return Path(self._call(f"downloading {path}", get))
        except LocalEntryNotFoundError as exc:
            raise HubError(
                f"downloading {path}: offline and not in the cache {self.cache_dir}"
            ) from exc

    def table(self, kind: str, revision: str) -> Path | None:
        """The split's metadata, labels or reports CSV (None if the repository has none)."""
        long = "train" if self.split == "train" else "validation"
        path = TABLES[kind].format(long=long, split=self.split)
        try:
            return self.download(path, revision)
        except HubError as exc:
            if "not found" in str(exc):
                return None
            raise

    def forget(self, path: Path) -> None:
        """Remove a downloaded file from the cache (its blob and its snapshot link)."""
        blob = path.resolve()
        for p in {path, blob}:
            if p.exists() or p.is_symlink():
                p.unlink()


def _status(exc: Exception) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text
