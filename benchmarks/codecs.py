"""Codec candidates on zarrfeed's own data, the measurement behind ``zarrfeed/store/codecs.py``.

For each array kind (int16 HU, float16 and uint8 lung windows of a phantom with CT noise,
spike counts from the simulator) and each candidate codec: compression ratio and single-thread
decode GB/s on training-sized chunks.  Prints ``BENCH codecs.<kind>.<codec>.{ratio,decode}``
and, per kind, how the chosen codec compares with zarr's default (zstd level 0).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numcodecs
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _bench import bench, best_of

from zarrfeed.samples import ct_phantom
from zarrfeed.store.codecs import compressors_for
from zarrfeed.transforms import ct, spike

numcodecs.blosc.set_nthreads(1)

CANDIDATES = {
    "zstd0": lambda ts: numcodecs.Zstd(level=0),  # zarr-python 3's default
    "lz4-shuffle": lambda ts: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE, typesize=ts),
    "lz4-bitshuffle": lambda ts: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.BITSHUFFLE, typesize=ts),
    "lz4-noshuffle": lambda ts: numcodecs.Blosc("lz4", 5, numcodecs.Blosc.NOSHUFFLE, typesize=ts),
    "zstd3-shuffle": lambda ts: numcodecs.Blosc("zstd", 3, numcodecs.Blosc.SHUFFLE, typesize=ts),
}


def chunks(arr: np.ndarray, edge: int) -> list[np.ndarray]:
    """Non-overlapping edge³ (or whole-frame) chunks, as training would read them."""
    if arr.ndim == 3 and edge:
        z, y, x = (n // edge for n in arr.shape)
        return [np.ascontiguousarray(arr[i * edge:(i + 1) * edge, j * edge:(j + 1) * edge,
                                         k * edge:(k + 1) * edge])
                for i in range(z) for j in range(y) for k in range(x)]  # fmt: skip
    return [np.ascontiguousarray(a) for a in arr]


def measure(kind: str, parts: list[np.ndarray], chosen: str) -> None:
    raw = sum(p.nbytes for p in parts)
    results = {}
    for name, make in CANDIDATES.items():
        codec = make(parts[0].dtype.itemsize)
        encoded = [codec.encode(p) for p in parts]
        seconds = best_of(lambda codec=codec, encoded=encoded: [codec.decode(e) for e in encoded])
        results[name] = (raw / sum(len(e) for e in encoded), raw / seconds / 1e9)
        bench(f"codecs.{kind}.{name}.ratio", results[name][0], "x")
        bench(f"codecs.{kind}.{name}.decode", results[name][1], "GB/s", "1 thread")
    r, d = results[chosen]
    r0, d0 = results["zstd0"]
    text = f"{chosen}: ratio {r:.2f} vs zstd0 {r0:.2f}, decode {d:.2f} vs {d0:.2f} GB/s"
    bench(f"codecs.{kind}.chosen_decode_vs_default", d / d0, "x", text)


def chosen_name(dtype, content: str) -> str:
    cfg = compressors_for(dtype, content)[0].to_dict()["configuration"]
    return f"{cfg['cname']}-{cfg['shuffle']}"


def main() -> None:
    rng = np.random.default_rng(0)
    hu = ct_phantom((128, 256, 256), (1.5, 1.4, 1.4), ("Lung nodule", "Emphysema"), rng)
    lung16 = ct.apply_window(hu, "lung")
    lung8 = ct.apply_window(hu, "lung", "uint8")
    gray = rng.random((8, 396, 640), dtype=np.float32)
    counts = spike.voxel_bins(spike.simulate_spikes(gray, threshold=2.0, repeat=10), 40)
    measure("hu_int16", chunks(hu, 64), chosen_name(hu.dtype, "dense"))
    measure("window_float16", chunks(lung16, 64), chosen_name(lung16.dtype, "dense"))
    measure("window_uint8", chunks(lung8, 64), chosen_name(lung8.dtype, "dense"))
    measure("spike_bins_uint8", chunks(counts, 0), chosen_name(counts.dtype, "events"))


if __name__ == "__main__":
    main()
