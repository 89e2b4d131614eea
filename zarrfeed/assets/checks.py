"""What each blocking check verifies (shown in the UI next to its result)."""

CHECK_DOCS = {
    "readable": "The raw item opens and its header gives a plausible shape and spacing.",
    "hu_range": "HU volume is int16, non-empty and inside the preset's clip range.",
    "hu_plausible": "Air sits near -1000 HU and soft tissue is present: a volume off by "
    "1024 HU (a rescale applied twice or not at all) can never pass.",
    "matches_source": "An independent trilinear recomputation from the source at 2,048 random "
    "voxels agrees within 1 HU, and the shape follows from the spacing.",
    "window_range": "Every window is float16, finite and inside [0, 1].",
    "min_points": "Every window has at least min_points occupied cells.",
    "in_bounds": "Every index lies inside the array it indexes.",
    "non_empty": "At least one patch passed the filter.",
    "counts_valid": "Spike counts per bin never exceed the frames the bin sums.",
    "frames_aligned": "Blurred and sharp frames have one entry per sample and the camera's "
    "frame size.",
    "complete": "Every sample has its spike stream, blurred and sharp frame.",
    "uniform_shape": "Every image of the set has one shape and dtype.",
}
