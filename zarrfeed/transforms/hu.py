"""Hounsfield units from evidence: which rescale turns stored CT values into HU, and why.

A CT file's stored values become HU as ``stored · slope + intercept``.  Which (slope,
intercept) applies is decided from every source of evidence, never from one value such as
the minimum.  Sources, highest precedence first (``decide_hu``):

1. ``override``: the user's per-scan entry, ``"hu"`` or ``{"slope": s, "intercept": b}``.
   Taken as given (it exists for the scans the evidence cannot settle); its facts are
   still recorded.
2. ``dicom``: the reader applied each slice's RescaleSlope/RescaleIntercept, so the claim is
   "these values are HU" (slope 1, intercept 0).
3. ``nifti_header``: ``scl_slope``/``scl_inter`` when set and not (1, 0), which writers
   put on unscaled data (slope 0 or NaN means unset).
4. ``csv``: RescaleSlope/RescaleIntercept of the CT-RATE metadata row, read like every
   claim as stored value → HU (they are the source DICOM's own tags).
5. ``sidecar``: ``units``/``slope``/``intercept`` next to a ``.npy``/``.npz`` volume.
6. the data: the two hypotheses "already HU" (1, 0) and "raw CT" (1, −1024).

Every claim is tested against the data.  After rescaling, the voxels (padding excluded) must
hold air or aerated lung (−1100…−750 HU, at least 1 %) and soft tissue (−100…100 HU, at
least 5 %), and almost nothing below −1100 HU (at most 0.5 %: no such tissue exists).  A
claim off by 1024 fails one of these: +1024 leaves no air, −1024 pushes air below −2000 or
leaves no tissue.  The decision:

* every claim must fit the data, and all that fit must agree; the first of them decides;
* the CSV alone may be overruled, and only when its rescale is physically impossible for
  this file (values below −1100 HU) while the data or another claim fits: CT-RATE's CSV
  describes the original DICOM series, and re-exported volumes that already hold HU keep
  the CSV's −1024 intercept;
* with no claim left, the data decides when exactly one hypothesis fits;
* anything else (a claim the data contradicts, claims that disagree, data with no air or
  no tissue) raises :class:`InputError` naming the file and listing each claim's facts.

Padding (outside the field of view) is no evidence and no anatomy.  A voxel is padding when
the reader marks it (DICOM PixelPaddingValue/PixelPaddingRangeLimit) or when its stored
value, or its value after the rescale being tested, is a sentinel (−3024, −2000, −32768).
Padding is left out of every share above and becomes air (−1024 HU) in :func:`to_hu`, before
any resampling, so interpolation never smears −3024 into tissue.

Pure numpy: no I/O.  Readers (``zarrfeed.formats``) supply the claims and the padding mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from zarrfeed.errors import ConfigError, InputError

AIR_FILL = -1024.0  # HU given to padding; also the floor of the HU presets
SENTINELS = (-3024.0, -2000.0, -32768.0)  # common out-of-field values, stored or HU
AIR_BAND = (-1100.0, -750.0)  # air and aerated lung
TISSUE_BAND = (-100.0, 100.0)  # fat margin, muscle, organs, blood
MIN_AIR_SHARE = 0.01
MIN_TISSUE_SHARE = 0.05
MAX_BELOW_SHARE = 0.005  # share of voxels below AIR_BAND[0] that a real HU volume may have
EVIDENCE_VOXELS = 1 << 20  # voxels sampled for the evidence (all of them in smaller volumes)
CLAIM_ORDER = ("dicom", "nifti_header", "csv", "sidecar")
_HU_BLOCK = 1 << 16  # voxels :func:`to_hu` converts at once (in cache)

Override = Literal["hu"] | Mapping[str, float]


@dataclass(frozen=True)
class Rescale:
    """HU = stored · slope + intercept."""

    slope: float
    intercept: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slope) and math.isfinite(self.intercept) and self.slope):
            raise ValueError(f"a rescale needs a finite non-zero slope, got {self}")

    def close_to(self, other: Rescale) -> bool:
        return math.isclose(self.slope, other.slope, rel_tol=1e-6) and math.isclose(
            self.intercept, other.intercept, rel_tol=1e-6, abs_tol=1e-6
        )

    def __str__(self) -> str:
        return f"slope {self.slope:g}, intercept {self.intercept:g}"


IDENTITY = Rescale(1.0, 0.0)
HYPOTHESES = {"hu": IDENTITY, "raw": Rescale(1.0, -1024.0)}


@dataclass(frozen=True)
class HuDecision:
    """The rescale to apply, the source that decided it, and the facts behind it
    (JSON-ready, for provenance)."""

    slope: float
    intercept: float
    source: str  # override | dicom | nifti_header | csv | sidecar | data
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def rescale(self) -> Rescale:
        return Rescale(self.slope, self.intercept)


def parse_override(entry: Rescale | Override, where: str = "HU override") -> Rescale:
    """A per-scan override as a user writes it: ``"hu"`` or ``{"slope": s, "intercept": b}``."""
    if isinstance(entry, Rescale):
        return entry
    if entry == "hu":
        return IDENTITY
    if isinstance(entry, Mapping) and set(entry) == {"slope", "intercept"}:
        try:
            return Rescale(float(entry["slope"]), float(entry["intercept"]))
        except (TypeError, ValueError):
            pass
    raise ConfigError(
        f"{where}: expected 'hu' or {{'slope': number, 'intercept': number}}, found {entry!r}"
    )


def parse_overrides(overrides: Mapping[str, Rescale | Override]) -> dict[str, Rescale]:
    """Validate a whole ``{scan key: override}`` mapping up front (a config error, not a
    failed partition later)."""
    return {key: parse_override(v, f"HU override for {key!r}") for key, v in overrides.items()}


def csv_rescale(row: Mapping[str, str] | None, source: str = "metadata CSV") -> Rescale | None:
    """The claim of a CT-RATE metadata row, or None when the row gives no rescale."""
    slope, intercept = ((row or {}).get(c) or "" for c in ("RescaleSlope", "RescaleIntercept"))
    if not (slope.strip() or intercept.strip()):
        return None
    try:
        return Rescale(float(slope or 1.0), float(intercept or 0.0))
    except ValueError:
        found = f"{slope!r}, {intercept!r} for {(row or {}).get('VolumeName', '?')}"
        raise InputError(source, "numeric RescaleSlope and RescaleIntercept", found) from None


def _sample(stored: np.ndarray, padding: np.ndarray | None):
    """Up to EVIDENCE_VOXELS stored values (float64) and their padding flags: one voxel at a
    fixed random place in each of EVIDENCE_VOXELS equal runs of the flat volume (stratified,
    so a strided layout cannot alias with the image rows, and sorted without a sort)."""
    if stored.size <= EVIDENCE_VOXELS:
        values = np.asarray(stored, dtype=np.float64).reshape(-1)
        flags = None if padding is None else np.asarray(padding, dtype=bool).reshape(-1)
        return values, flags
    run = stored.size / EVIDENCE_VOXELS
    jitter = np.random.default_rng(0).random(EVIDENCE_VOXELS)
    flat = ((np.arange(EVIDENCE_VOXELS) + jitter) * run).astype(np.intp)
    np.minimum(flat, stored.size - 1, out=flat)  # rounding must not step past the end

    def pick(a: np.ndarray) -> np.ndarray:
        if a.flags.c_contiguous:
            return a.reshape(-1)[flat]
        return a[np.unravel_index(flat, a.shape)]

    flags = None if padding is None else np.asarray(pick(padding), dtype=bool)
    return np.asarray(pick(stored), dtype=np.float64), flags


def _sentinels(values: np.ndarray) -> np.ndarray | None:
    if not values.size or values.min() > max(SENTINELS):
        return None  # the common case, found by one pass
    return functools.reduce(np.logical_or, [values == s for s in SENTINELS])


def outside_mask(
    stored: np.ndarray, hu: np.ndarray, padding: np.ndarray | None = None
) -> np.ndarray | None:
    """Padding: the reader's mask, or a sentinel in stored values or in HU; None if none."""
    masks = [m for m in (_sentinels(stored), _sentinels(hu), padding) if m is not None]
    return functools.reduce(np.logical_or, masks) if masks else None


def hu_facts(hu: np.ndarray) -> dict[str, Any]:
    """Shares of air, soft tissue and impossible values, and where the air peak lies."""
    n = int(hu.size)
    if not n:
        return {"voxels": 0, "air_share": 0.0, "air_peak_hu": None, "tissue_share": 0.0,
                "below_share": 0.0}  # fmt: skip
    lo, hi = AIR_BAND
    air = hu[(hu >= lo) & (hu <= hi)]
    peak = None
    if air.size:
        counts, edges = np.histogram(air, bins=np.arange(lo - 5, hi + 10, 10))
        peak = float(edges[int(np.argmax(counts))] + 5)  # bins centred on multiples of 10
    tissue = int(np.count_nonzero((hu >= TISSUE_BAND[0]) & (hu <= TISSUE_BAND[1])))
    return {
        "voxels": n,
        "air_share": round(air.size / n, 4),
        "air_peak_hu": peak,
        "tissue_share": round(tissue / n, 4),
        "below_share": round(int(np.count_nonzero(hu < lo)) / n, 4),
    }


def _verdict(facts: Mapping[str, Any]) -> str:
    if facts["below_share"] > MAX_BELOW_SHARE:
        return "refuted"
    if facts["air_share"] >= MIN_AIR_SHARE and facts["tissue_share"] >= MIN_TISSUE_SHARE:
        return "fits"
    return "unconfirmed"


def _test(values: np.ndarray, flags: np.ndarray | None, rescale: Rescale) -> dict[str, Any]:
    hu = values * rescale.slope + rescale.intercept
    outside = outside_mask(values, hu, flags)
    facts = hu_facts(hu if outside is None else hu[~outside])
    padded = 0 if outside is None else int(np.count_nonzero(outside))
    facts["padding_share"] = round(padded / max(values.size, 1), 4)
    facts["slope"], facts["intercept"] = rescale.slope, rescale.intercept
    facts["verdict"] = _verdict(facts)
    return facts


def hu_plausibility(
    hu: np.ndarray, outside: np.ndarray | None = None, *, overridden: bool = False
) -> tuple[bool, dict]:
    """Blocking check on an HU volume: air (or aerated lung) and soft tissue present, nothing
    below −1100 HU, so a volume 1024 off in either direction fails.

    ``overridden``: the rescale is the user's per-scan override, which exists for the scans
    whose content cannot show air and tissue (a crop of spine and muscle).  Absence of that
    evidence is then accepted ("unconfirmed" passes), but contrary evidence still fails: an
    override that puts voxels below −1100 HU, where no tissue exists, is refuted.

    :func:`decide_hu` already demands this of every decision but an override, on the source
    with padding excluded; this check guards what later steps (resampling, clipping, an
    override) made of it.  ``outside`` (see :func:`outside_mask`) leaves the filled padding
    out.  Without it, voxels at exactly −1024 are left out instead: the fill and the presets'
    floor prove no air.  The fill's interpolated edge still lands in the air band: about
    0.3 % of a 512² field of view, more in small or upsampled images, so pass ``outside``
    where it is known.
    """
    values, flags = _sample(hu, outside)
    keep = values != AIR_FILL if flags is None else ~flags
    facts = hu_facts(values[keep])
    verdict = _verdict(facts)
    if overridden:
        facts["judged_as"] = "override: passes unless refuted"
        return verdict != "refuted", facts
    return verdict == "fits", facts


def _describe(name: str, facts: Mapping[str, Any]) -> str:
    peak = facts["air_peak_hu"]
    return (
        f"{name} (slope {facts['slope']:g}, intercept {facts['intercept']:g}) {facts['verdict']}: "
        f"air {facts['air_share']:.1%} (peak {'none' if peak is None else f'{peak:g} HU'}), "
        f"tissue {facts['tissue_share']:.1%}, below −1100 HU {facts['below_share']:.1%}"
    )


def decide_hu(
    stored: np.ndarray,
    path: str,
    claims: Mapping[str, Rescale] | None = None,
    *,
    padding: np.ndarray | None = None,
    override: Rescale | Override | None = None,
) -> HuDecision:
    """Decide the HU rescale of ``stored`` (finite values, any shape) from the claims of the
    sources in :data:`CLAIM_ORDER` and the data itself; see the module docstring.

    Raises :class:`InputError` naming ``path`` and every claim's facts when the claims and
    the data disagree or the data cannot confirm any of them.
    """
    claims = dict(claims or {})
    unknown = set(claims) - set(CLAIM_ORDER)
    if unknown:
        raise ValueError(f"unknown HU claim sources {sorted(unknown)}: use {CLAIM_ORDER}")
    values, flags = _sample(stored, padding)
    if override is not None:
        rescale = parse_override(override, f"HU override for {path}")
        evidence = {"override": _test(values, flags, rescale)}
        return HuDecision(rescale.slope, rescale.intercept, "override", evidence)
    tested = {n: _test(values, flags, claims[n]) for n in CLAIM_ORDER if n in claims}
    data = {n: _test(values, flags, r) for n, r in HYPOTHESES.items()}
    fitting = [n for n, f in data.items() if f["verdict"] == "fits"]
    data_says = fitting[0] if len(fitting) == 1 else None
    evidence: dict[str, Any] = {"claims": tested, "data": data, "data_says": data_says}
    kept = [n for n, f in tested.items() if f["verdict"] == "fits"]
    overruled = [
        n
        for n, f in tested.items()
        if n == "csv" and f["verdict"] == "refuted" and (kept or data_says)
    ]
    evidence["overruled"] = overruled
    failing = [n for n in tested if n not in kept and n not in overruled]
    disagree = any(not claims[n].close_to(claims[kept[0]]) for n in kept[1:])

    def fail(expected: str) -> InputError:
        lines = [_describe(n, f) for n, f in tested.items()]
        lines += [_describe(f"data as {n}", f) for n, f in data.items()]
        hint = "set a per-scan HU override ('hu' or {'slope', 'intercept'}) if you know better"
        return InputError(path, expected, "; ".join(lines) + f" ({hint})")

    if failing or disagree:
        what = "claims that the data confirms" if failing else "claims that agree"
        raise fail(f"HU evidence that settles the rescale: {what}")
    if kept:
        chosen = claims[kept[0]]
        return HuDecision(chosen.slope, chosen.intercept, kept[0], evidence)
    if data_says is None:
        raise fail("data that shows air and soft tissue under exactly one rescale")
    chosen = HYPOTHESES[data_says]
    return HuDecision(chosen.slope, chosen.intercept, "data", evidence)


def to_hu(
    stored: np.ndarray, decision: HuDecision | Rescale, padding: np.ndarray | None = None
) -> np.ndarray:
    """float32 HU (a new array) with padding replaced by air, ready for resampling."""
    rescale = decision.rescale if isinstance(decision, HuDecision) else decision
    stored = np.asarray(stored)
    out = np.empty(stored.shape, dtype=np.float32)
    # Block by block, sentinels filled on the way: one pass through memory instead of four
    # over a full-size float32 volume (the cast, the rescale, the two sentinel minima), and
    # no volume-sized mask per sentinel.  The blocks are taken from one slab (index along
    # the first axis) at a time: readers hand over reoriented views, which a flat reshape
    # of the whole volume would copy whole.
    slabs, out_slabs = (stored, out) if stored.ndim > 1 else (stored[None], out[None])
    slope, intercept = np.float32(rescale.slope), np.float32(rescale.intercept)
    for slab, out_slab in zip(slabs, out_slabs, strict=True):
        flat_in, flat_out = np.ascontiguousarray(slab).reshape(-1), out_slab.reshape(-1)
        for start in range(0, flat_out.size, _HU_BLOCK):
            block, source = flat_out[start : start + _HU_BLOCK], flat_in[start : start + _HU_BLOCK]
            block[...] = source
            if rescale.slope != 1:
                block *= slope
            if rescale.intercept != 0:
                block += intercept
            # fmin ignores NaN: a NaN beside a sentinel in one block must not hide it.
            lowest = min(float(np.fmin.reduce(source)), float(np.fmin.reduce(block)))
            if lowest <= max(SENTINELS):
                outside = outside_mask(source, block)
                if outside is not None:
                    block[outside] = AIR_FILL
    if padding is not None:
        out[np.asarray(padding, dtype=bool)] = AIR_FILL
    return out
