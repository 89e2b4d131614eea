"""The CT-RATE dataset repository on the Hugging Face hub."""

from __future__ import annotations

from typing import TYPE_CHECKING

import dagster as dg

from zarrfeed.defaults import HUB_REPO

if TYPE_CHECKING:
    from zarrfeed.sources.hub import CTRateHub


class HuggingFaceResource(dg.ConfigurableResource):
    """A CT-RATE-style repository on the Hugging Face hub; its volumes become CT partitions.

    The token is read from ``HF_TOKEN`` when a request is made; it is not a field, so it
    never shows in the launchpad, run config or metadata.  ``HF_ENDPOINT`` (read by
    huggingface_hub) or ``endpoint`` points at another hub.
    """

    repo_id: str = HUB_REPO
    revision: str = "main"
    split: str = "valid"  # the *_fixed folder of this split
    cache_dir: str | None = None  # default: the huggingface_hub cache (HF_HUB_CACHE)
    endpoint: str | None = None
    max_scans: int | None = None  # a cap for trial runs
    delete_after_commit: bool = False  # remove each download once its HU volume is committed

    def hub(self) -> CTRateHub:
        # The client (huggingface_hub, httpx: ~0.2 s) loads when a hub is used, not with
        # every code location that declares this resource.
        from zarrfeed.sources.hub import CTRateHub

        return CTRateHub(
            self.repo_id,
            self.revision,
            self.split,
            cache_dir=self.cache_dir,
            endpoint=self.endpoint,
            max_scans=self.max_scans,
        )
