"""The Zarr store every asset writes to and training reads from."""

from __future__ import annotations

from typing import Any

import dagster as dg
from pydantic import Field

from zarrfeed import defaults
from zarrfeed.datasets import Retention
from zarrfeed.jobs.liveness import PID_TAG, orchestrating_pid, runs_in_process
from zarrfeed.processes import HOST_TAG, host_identity
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.store import ZarrStore


class ZarrStoreResource(dg.ConfigurableResource):
    """A folder, or an object-store URL such as ``s3://bucket/prefix``.

    For S3-compatible servers, ``endpoint_url`` names the server (or the standard
    ``AWS_ENDPOINT_URL`` variable does).  Credentials come from the standard AWS variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), a profile, or
    an instance role, which the client reads itself; or from ``access_key_id`` and
    ``secret_access_key`` given as ``dg.EnvVar(...)``, which the UI shows by variable name
    only.  They never enter the store's URL, its identity, metadata, logs or error messages.
    """

    url: str = defaults.STORE
    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    keep_versions: int = Field(
        10, description="dataset versions kept readable: the last this many (current included)"
    )
    keep_days: float = Field(7.0, description="… and every dataset version younger than this")

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """Tag the run with the host it executes on and the process that orchestrates it, so
        that the ``dead_runs`` sensor can tell a run whose process is gone (every zarrfeed
        step uses this resource)."""
        run, instance = context.run, context.instance
        if run is None or instance is None:
            return
        tags = {HOST_TAG: host_identity()}
        if (pid := orchestrating_pid(runs_in_process(run))) is not None:
            tags[PID_TAG] = str(pid)
        if any(run.tags.get(k) != v for k, v in tags.items()):
            instance.add_run_tags(run.run_id, tags)

    def storage_options(self) -> dict[str, Any] | None:
        options = {
            "endpoint_url": self.endpoint_url,
            "key": self.access_key_id,
            "secret": self.secret_access_key,
        }
        return {k: v for k, v in options.items() if v} or None

    def store(self) -> ZarrStore:
        return ZarrStore(self.url, storage_options=self.storage_options())

    def retention(self) -> Retention:
        """How long each dataset's superseded versions stay readable (time travel, and the
        readers of a run that started on them)."""
        return Retention(last=self.keep_versions, days=self.keep_days)

    def catalog(self, family: str) -> RawCatalog:
        """The raw-item catalog of ``family``, kept beside the data."""
        return RawCatalog(self.store().backend, family)
