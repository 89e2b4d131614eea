"""Dagster resources: configuration plus the Dagster-free objects they hand out."""

from zarrfeed.resources.build import BuildOptions
from zarrfeed.resources.hub import HuggingFaceResource
from zarrfeed.resources.models import ModelsResource
from zarrfeed.resources.raw import RawFolderResource
from zarrfeed.resources.store import ZarrStoreResource

__all__ = [
    "BuildOptions",
    "HuggingFaceResource",
    "ModelsResource",
    "RawFolderResource",
    "ZarrStoreResource",
]
