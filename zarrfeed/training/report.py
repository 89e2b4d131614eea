"""A loss curve as a small PNG (Pillow only: no plotting library for one line chart)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw


def loss_curve_png(
    losses: list[float], title: str = "loss", size: tuple[int, int] = (480, 240)
) -> bytes:
    """Per-step losses (thin) and their running mean (thick) on a log scale when they span
    more than a decade, with the first and last values written on it."""
    w, h = size
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    values = np.asarray([v for v in losses if np.isfinite(v)], dtype=np.float64)
    if len(values) < 2:
        draw.text((10, h // 2), f"{title}: {len(values)} step(s)", fill="black")
    else:
        log = values.min() > 0 and values.max() / values.min() > 10
        y = np.log10(values) if log else values
        lo, hi = float(y.min()), float(y.max())
        span = hi - lo or 1.0
        left, right, top, bottom = 40, w - 10, 22, h - 20

        def points(v: np.ndarray) -> list[tuple[float, float]]:
            xs = left + (right - left) * np.arange(len(v)) / (len(v) - 1)
            ys = bottom - (bottom - top) * (v - lo) / span
            return list(zip(xs.tolist(), ys.tolist(), strict=True))

        draw.rectangle((left, top, right, bottom), outline=(200, 200, 200))
        draw.line(points(y), fill=(150, 180, 230), width=1)
        k = max(1, len(y) // 10)
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        if len(smooth) > 1:
            draw.line(points(np.concatenate([y[: k - 1], smooth])), fill=(20, 60, 160), width=2)
        scale = " (log)" if log else ""
        draw.text((left, 4), f"{title}{scale}: {values[0]:.4g} -> {values[-1]:.4g}", fill="black")
        draw.text((left, bottom + 4), f"step 1 … {len(values)}", fill=(90, 90, 90))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
