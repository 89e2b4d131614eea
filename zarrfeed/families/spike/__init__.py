"""The spike-camera family: its declaration (:mod:`.family`), discovery (:mod:`.discover`),
training Dataset (:mod:`.datasets`, which imports torch), model (:mod:`.models`) and training
task (:mod:`.tasks`)."""

from zarrfeed.families.spike.family import SPIKE, SPIKE_FRAMES, SPIKE_VOXELS, SpikeSettings

__all__ = ["SPIKE", "SPIKE_FRAMES", "SPIKE_VOXELS", "SpikeSettings"]
