"""The image family: its declaration (:mod:`.family`), discovery (:mod:`.discover`), training
Dataset (:mod:`.datasets`, which imports torch), model (:mod:`.models`) and training task
(:mod:`.tasks`)."""

from zarrfeed.families.images.family import (
    IMAGE_PATCHES,
    IMAGE_STORE,
    IMAGES,
    PATCH_TABLE,
    ImageSettings,
    read_set,
)

__all__ = ["IMAGES", "IMAGE_PATCHES", "IMAGE_STORE", "PATCH_TABLE", "ImageSettings", "read_set"]
