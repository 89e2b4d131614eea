"""Spike-camera streams: both ``.dat`` layouts, voxel bins, texture-from-playback, simulation.

A spike stream is a (T, H, W) uint8 array of 0/1 events.  Two on-disk layouts exist:

* ``packed`` — the camera format SpikeCV reads: H·W/8 bytes a frame, bit b of byte k is pixel
  8k + b (least-significant bit first), frames stored upside down;
* ``bytes`` — one byte per pixel, frames in order (GoPro spike data: 10 × 396 × 640 uint8).
"""

from __future__ import annotations

import numpy as np


def packed_frame_bytes(height: int, width: int) -> int:
    if (height * width) % 8:
        raise ValueError(f"packed spike frames need H·W divisible by 8, got {height}×{width}")
    return height * width // 8


def decode_packed(buf: np.ndarray, height: int, width: int, flip: bool = True) -> np.ndarray:
    """Bit-packed camera bytes → (T, H, W) uint8 spikes.  ``buf`` must hold whole frames."""
    per_frame = packed_frame_bytes(height, width)
    buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
    if buf.size % per_frame:
        raise ValueError(f"{buf.size} bytes is not a whole number of {per_frame}-byte frames")
    frames = buf.size // per_frame
    bits = np.unpackbits(buf.reshape(frames, per_frame), axis=1, bitorder="little")
    spikes = bits.reshape(frames, height, width)
    return np.ascontiguousarray(spikes[:, ::-1]) if flip else spikes


def encode_packed(spikes: np.ndarray, flip: bool = True) -> np.ndarray:
    """(T, H, W) 0/1 spikes → camera bytes (the inverse of :func:`decode_packed`)."""
    t, h, w = spikes.shape
    packed_frame_bytes(h, w)
    src = spikes[:, ::-1] if flip else spikes
    return np.packbits(
        np.ascontiguousarray(src, dtype=np.uint8).reshape(t, -1) != 0, axis=1, bitorder="little"
    ).reshape(-1)


def decode_bytes(buf: np.ndarray, frames: int, height: int, width: int) -> np.ndarray:
    """One-byte-per-pixel layout → (frames, H, W) uint8.  Size must match exactly."""
    buf = np.asarray(buf, dtype=np.uint8).reshape(-1)
    expected = frames * height * width
    if buf.size != expected:
        raise ValueError(
            f"Cannot reshape spike data: {buf.size} bytes, expected {expected} "
            f"({frames}×{height}×{width} uint8)"
        )
    return buf.reshape(frames, height, width)


def bin_edges(frames: int, bins: int) -> np.ndarray:
    """Start indices of ``bins`` contiguous, nearly equal bins over ``frames`` (array_split)."""
    if not 0 < bins <= frames:
        raise ValueError(f"need 0 < bins <= frames, got bins={bins}, frames={frames}")
    sizes = np.full(bins, frames // bins)
    sizes[: frames % bins] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def voxel_bins(spikes: np.ndarray, bins: int) -> np.ndarray:
    """(T, H, W) spikes → (bins, H, W) spike counts per bin (e.g. 10 frames → 5 bins).

    Adds frame by frame in uint8 (uint16 when a bin could overflow): no widening to int64,
    which is what makes the naive ``sum`` 10× slower.
    """
    t = spikes.shape[0]
    edges = bin_edges(t, bins)
    widest = int(np.max(np.diff(edges)))
    dtype = np.uint8 if widest <= 255 else np.uint16
    out = np.empty((bins, *spikes.shape[1:]), dtype=dtype)
    for b in range(bins):
        lo, hi = edges[b], edges[b + 1]
        np.copyto(out[b], spikes[lo])
        for f in range(lo + 1, hi):
            out[b] += spikes[f]
    return out


def simulate_spikes(
    frames: np.ndarray,
    threshold: float = 2.0,
    seed: int = 0,
    repeat: int = 1,
) -> np.ndarray:
    """Integrate-and-fire (SpikeCV ``convert_video``): intensities in [0, 1] → 0/1 spikes.

    ``acc₀ ~ U(0, θ)``; each step ``acc += I``, fire where ``acc ≥ θ``, then ``acc −= θ``.
    Each input frame is integrated ``repeat`` times, giving T·repeat spike frames.  Long-run
    firing rate is I/θ per step, the property the reconstruction methods rely on.
    """
    frames = np.asarray(frames, dtype=np.float32)
    if frames.min() < 0 or frames.max() > 1:
        raise ValueError("frames must hold intensities in [0, 1]")
    rng = np.random.default_rng(seed)
    acc = rng.uniform(0, threshold, size=frames.shape[1:]).astype(np.float32)
    out = np.empty((frames.shape[0] * repeat, *frames.shape[1:]), dtype=np.uint8)
    th = np.float32(threshold)
    for i, frame in enumerate(np.repeat(frames, repeat, axis=0)):
        acc += frame
        fire = acc >= th
        out[i] = fire
        acc -= fire * th
    return out


def to_gray(rgb: np.ndarray) -> np.ndarray:
    """Spike-camera grayscale of an RGB image: 0.3 R + 0.59 G + 0.11 B (float32)."""
    w = np.array([0.3, 0.59, 0.11], dtype=np.float32)
    return np.asarray(rgb, dtype=np.float32) @ w
