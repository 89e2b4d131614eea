"""What a run leaves for a person besides ``metrics.json``: the loss curve as a small PNG
(Pillow only: no plotting library for one line chart) and TensorBoard event files."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

RAW, SMOOTH, AXIS, TEXT = (150, 180, 230), (20, 60, 160), (120, 120, 120), (40, 40, 40)


def loss_curve_png(
    losses: list[float], title: str = "loss", size: tuple[int, int] = (560, 280)
) -> bytes:
    """Per-step losses (thin) and their running mean (thick) against the step, on a log
    scale when they span more than a decade: both axes ticked and named, and a legend."""
    w, h = size
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    values = np.asarray([float(v) for v in losses if np.isfinite(float(v))], dtype=np.float64)
    if len(values) < 2:
        draw.text((10, h // 2), f"{title}: {len(values)} step(s)", fill="black")
    else:
        log = values.min() > 0 and values.max() / values.min() > 10
        y = np.log10(values) if log else values
        lo, hi = float(y.min()), float(y.max())
        span = hi - lo or 1.0
        left, right, top, bottom = 64, w - 12, 24, h - 52

        def points(v: np.ndarray) -> list[tuple[float, float]]:
            xs = left + (right - left) * np.arange(len(v)) / (len(v) - 1)
            ys = bottom - (bottom - top) * (v - lo) / span
            return list(zip(xs.tolist(), ys.tolist(), strict=True))

        draw.rectangle((left, top, right, bottom), outline=AXIS)
        for frac in (0.0, 0.5, 1.0):  # y ticks: lowest, middle, highest loss
            yy = bottom - (bottom - top) * frac
            value = lo + span * frac
            draw.line((left - 4, yy, left, yy), fill=AXIS)
            draw.text((4, yy - 6), f"{10**value if log else value:.3g}", fill=TEXT)
            xx = left + (right - left) * frac  # x ticks: first, middle, last step
            draw.line((xx, bottom, xx, bottom + 4), fill=AXIS)
            label = str(round(1 + (len(values) - 1) * frac))
            draw.text((xx - 3 * len(label), bottom + 6), label, fill=TEXT)
        draw.text(((left + right) // 2 - 12, bottom + 20), "step", fill=TEXT)
        draw.line(points(y), fill=RAW, width=1)
        k = max(1, len(y) // 10)
        smooth = np.convolve(y, np.ones(k) / k, mode="valid")
        if len(smooth) > 1:
            draw.line(points(np.concatenate([y[: k - 1], smooth])), fill=SMOOTH, width=2)
        scale = " (log scale)" if log else ""
        draw.text((left, 6), f"{title} loss{scale}: {values[0]:.4g} -> {values[-1]:.4g}",
                  fill="black")  # fmt: skip
        legend = bottom + 36  # the legend, under the axis
        draw.line((left, legend + 6, left + 24, legend + 6), fill=RAW, width=1)
        draw.text((left + 30, legend), "loss per step", fill=TEXT)
        draw.line((left + 150, legend + 6, left + 174, legend + 6), fill=SMOOTH, width=2)
        draw.text((left + 180, legend), f"running mean of {k} step(s)", fill=TEXT)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class EventLog:
    """A run's TensorBoard event files (``tensorboard --logdir <run folder>``): per step the
    loss, data and step time and samples/s; the evaluation metrics and per-class values
    (a classifier's per-finding AUROC) at step 0, before training, and at the last step.

    Every writer rewrites the run's whole history and hides what earlier attempts in the
    folder wrote (``purge_step=0``), so a resumed run shows one curve, not two overlapping.
    """

    def __init__(self, run_dir: Path, world: int = 1) -> None:
        from torch.utils.tensorboard import SummaryWriter  # loads tensorboard: only when used

        run_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(run_dir), purge_step=0)
        self.world, self.written = world, 0

    def steps(self, history: dict[str, list[Any]]) -> None:
        """Write the steps of ``history`` not written yet (its lists hold one value a step)."""
        for i in range(self.written, len(history["loss"])):
            data, compute = float(history["data_time"][i]), float(history["step_time"][i])
            samples = float(history["samples"][i]) * self.world
            for tag, value in (
                ("train/loss", float(history["loss"][i])),
                ("train/data_time_ms", 1000 * data),
                ("train/step_time_ms", 1000 * compute),
                ("train/samples_per_s", samples / (data + compute) if data + compute else 0.0),
            ):
                self.writer.add_scalar(tag, value, i + 1)
        self.written = len(history["loss"])

    def evaluation(
        self, step: int, metrics: dict[str, Any], per_class: dict[str, dict[str, Any]]
    ) -> None:
        """The evaluation scalars at ``step``; undefined values (None) are left out, and so
        are per-class counts (integers), which are not curves."""
        for name, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(f"eval/{name}", float(value), step)
        for metric, table in per_class.items():
            for name, value in table.items():
                if isinstance(value, float):
                    self.writer.add_scalar(f"eval_{metric}/{name}", value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
