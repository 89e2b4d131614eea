"""Whole-array statistics that checks run on every partition, fast for float16.

numpy reduces float16 through a per-element conversion (about 10× slower than float32);
torch's CPU kernels reduce float16 directly and use several threads.
"""

from __future__ import annotations

import numpy as np
import torch


def finite_range(x: np.ndarray) -> tuple[float, float, bool]:
    """(min, max, all finite) of an array; (nan, nan, True) when it is empty."""
    if x.size == 0:
        return float("nan"), float("nan"), True
    t = torch.from_numpy(np.ascontiguousarray(x))
    finite = bool(torch.isfinite(t).all()) if t.is_floating_point() else True
    lo, hi = torch.aminmax(t)
    return float(lo), float(hi), finite
