"""Scale figures at 50,000 partitions (``scale.py``): discovery, per-partition overhead, the
nightly evaluation, manifests, collection and a training dataset over synthetic CT-RATE-named
raw files and commit records shaped like real ones (current fingerprints, 1 % stale), plus a
synthetic consolidated patch index.  Imported by ``scale.py``.
"""

import csv
import hashlib
import json
import os
import time
from datetime import datetime
from pathlib import Path

import dagster as dg
import numpy as np
from _bench import bench

from zarrfeed.assets import family_assets
from zarrfeed.components import family_defs
from zarrfeed.datasets import Retention, collect, write_dataset
from zarrfeed.families.ct import CT, CTSettings
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.formats import write_nifti
from zarrfeed.jobs.queue import IN_FLIGHT, PER_TICK, BuildQueue
from zarrfeed.resources import (
    BuildOptions,
    HuggingFaceResource,
    RawFolderResource,
    ZarrStoreResource,
)
from zarrfeed.samples import METADATA_COLUMNS, ct_rate_path
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.sources.raw import source_identity
from zarrfeed.store import ZarrStore

VERSION = "v20261122T000000000Z-00000000"  # of every synthetic partition
REAL = 32  # raw files that are tiny real NIfTI volumes (the overhead runs read them)


def name(i: int) -> str:
    return f"train_{i}_a_1"


def make_raw(raw: Path, start: int, stop: int) -> None:
    """Empty CT-RATE files ``train_<i>_a_1.nii.gz`` (tiny real ones for i < REAL)."""
    for i in range(start, stop):
        path = raw / "ct-rate" / ct_rate_path(name(i))
        path.parent.mkdir(parents=True, exist_ok=True)
        if i < REAL:
            write_nifti(path, np.full((4, 8, 8), 40 + i, np.int16), (2.0, 1.0, 1.0))
        else:
            path.touch()


def make_metadata(raw: Path, n: int) -> None:
    path = raw / "ct-rate/dataset/metadata/train_metadata.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, METADATA_COLUMNS)
        writer.writeheader()
        empty = dict.fromkeys(METADATA_COLUMNS, "")
        for i in range(n):
            writer.writerow({**empty, "VolumeName": f"{name(i)}.nii.gz", "RescaleSlope": "1",
                             "RescaleIntercept": "-1024"})  # fmt: skip


def tick(sensor: dg.SensorDefinition, instance: dg.DagsterInstance, resources: dict) -> tuple:
    """One discovery tick, then what the daemon does with it (add the new partitions):
    (wall seconds, CPU seconds, the sensor's result)."""
    t0, c0 = time.perf_counter(), time.process_time()
    result = sensor(dg.build_sensor_context(instance=instance, resources=resources))
    for request in getattr(result, "dynamic_partitions_requests", []):  # none on a skip
        instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
    return time.perf_counter() - t0, time.process_time() - c0, result


def discovery(work: Path, n: int, more: int, resources: dict, instance) -> None:
    raw = Path(resources["raw"].root)
    make_raw(raw, 0, n)
    make_metadata(raw, n)
    sensor = code_location(resources).resolve_sensor_def(CT.discovery)
    first, cpu, result = tick(sensor, instance, resources)
    requested = len(result.run_requests)
    bench("scale.discovery_50k_s", first, "s",
          f"first ct_discovery tick over {n} raw files (synthetic: empty CT-RATE NIfTIs + "
          f"metadata CSV) incl. adding {n} partitions; {requested} runs requested now, "
          f"the rest queued; CPU {cpu:.1f}s")  # fmt: skip
    make_raw(raw, n, n + more)
    make_metadata(raw, n + more)
    second, cpu, result = tick(sensor, instance, resources)
    bench("scale.discovery_incremental_s", second, "s",
          f"next tick with {more} new files among {n + more} (CSV rewritten too); "
          f"CPU {cpu:.1f}s, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          "cores")  # fmt: skip
    for _ in range(3):  # the daemon releases the queue tick by tick
        tick(sensor, instance, resources)
    queued = len(BuildQueue(resources["zarr_store"].store().backend, "ct").load())
    bench("scale.build_queue_waiting", queued, "partitions",
          f"waiting after 5 ticks of {n + more} new partitions: at most {PER_TICK} runs a "
          f"tick, never more than {IN_FLIGHT} of the family queued or running")  # fmt: skip


def overhead(work: Path, resources: dict, big: dg.DagsterInstance, runs: int) -> None:
    """Per-run wall time of the raw-ingest step (catalog lookup + hash of a tiny file) with
    every partition known vs with 100, interleaved so both see the same load."""
    settings = resources["ct_settings"]
    raw_scan = [a for a in family_assets(CT, settings) if a.node_def.name == CT.raw.asset]
    (work / "home100").mkdir()
    with dg.instance_for_test(temp_dir=str(work / "home100")) as small:
        small.add_dynamic_partitions("ct_scans", [name(i) for i in range(100)])
        wall: dict[str, list[float]] = {"big": [], "small": []}
        cpu: dict[str, list[float]] = {"big": [], "small": []}
        for i in range(runs):
            for label, instance, key in (("small", small, name(i)), ("big", big, name(i + runs))):
                t0, c0 = time.perf_counter(), time.process_time()
                dg.materialize(raw_scan, partition_key=key, resources=resources, instance=instance)
                wall[label].append(time.perf_counter() - t0)
                cpu[label].append(time.process_time() - c0)
    n = len(big.get_dynamic_partitions("ct_scans"))
    # Medians after the first run (imports); CPU time, since the wall time of a 1 s run on
    # two cores shared with other work varies by ±50 % from run to run.
    per = {k: float(np.median(v[1:])) for k, v in cpu.items()}
    per_wall = {k: float(np.median(v[1:])) for k, v in wall.items()}
    bench("scale.partition_overhead_50k_vs_100", per["big"] / per["small"], "x",
          f"median CPU time of a ct_raw_scan[key] run (catalog lookup, hash of a tiny file, "
          f"Dagster run, in-process) with {n} dynamic partitions {per['big']:.3f}s / with 100 "
          f"{per['small']:.3f}s, {runs - 1} runs each; wall medians {per_wall['big']:.3f}s / "
          f"{per_wall['small']:.3f}s")  # fmt: skip


def synthetic_commits(store: ZarrStore, instance, settings: dict, keys: list[str]) -> None:
    """A commit record per key for every CT asset, shaped like a real build's: current
    fingerprints from the catalog items (1 % deliberately stale), no array data."""
    index = RawCatalog(store.backend, "ct").index()
    rng = np.random.default_rng(0)
    records: dict[str, dict[str, bytes]] = {spec.path: {} for spec in CT.assets}
    for i, key in enumerate(keys):
        item = index[key]
        sha = hashlib.sha256(key.encode()).hexdigest()
        expected = CT.expected(settings, key, source_identity(item, sha))
        shape = [int(rng.integers(200, 300)), 480, 480]
        for spec in CT.assets:
            arrays = {a: {"shape": shape, "dtype": spec.array(a).dtype
                          if isinstance(spec.array(a).dtype, str) else "uint8",
                          "chunks": [64, 64, 64], "shards": None, "codec": None,
                          "nbytes": int(np.prod(shape)) * 2}
                      for a in spec.array_names(settings)}  # fmt: skip
            attrs = {"source": item.location, "source_sha256": sha, "code_version": spec.version,
                     "fingerprint": expected[spec.name] if i % 100 else "stale",
                     "source_stamp": item.stamp, "params": spec.settings_of(settings, key),
                     "patch_shape": [64, 64, 64]}  # fmt: skip
            record = {"layout": 2, "asset": spec.path, "key": key, "version": VERSION,
                      "committed_at": "2026-11-22T00:00:00Z", "committed_unix": time.time(),
                      "zarrfeed_version": "0.1.0", "arrays": arrays,
                      "stored_bytes": int(np.prod(shape)) // 2, "attrs": attrs,
                      "checks": dict.fromkeys(spec.check_names, True)}  # fmt: skip
            records[spec.path][f"{key}.json"] = json.dumps(record).encode()
    for path, objects in records.items():
        store.backend.put_many(store.backend.join(".zarrfeed", "commits", path), objects)
        store.changes(path).begin(0)  # the log of a store whose records all predate it


def synthetic_table(store: ZarrStore, manifest: dict) -> None:
    """The dataset's patch table, 8 patches per key, written for ``manifest`` (its keys and
    the ct/patches versions it lists) as the dataset build writes it; no data read."""
    keys = manifest["keys"]
    versions = [p["version"] for p in manifest["assets"]["ct/patches"]["partitions"]]
    offsets = np.arange(0, 8 * len(keys) + 1, 8, dtype=np.int64)
    origins = np.random.default_rng(0).integers(0, 200, (8 * len(keys), 3)).astype(np.uint16)
    attrs = {"source_asset": "ct/patches", "keys": keys, "versions": versions}
    with store.write_partition("datasets/ct", "patches", attrs) as w:
        w.write("offsets", offsets, read="whole")
        w.write("origins", origins, read="rows")


def rebuild(store: ZarrStore, keys: list[str], every: int, seed: int) -> int:
    """Rewrite the commit records of one key in ``every`` (what rebuilding those partitions
    does to the records); returns how many partitions changed."""
    changed = keys[seed::every]
    for spec in CT.assets:
        folder = store.backend.join(".zarrfeed", "commits", spec.path)
        records = store.commit_records(spec.path, changed)
        for key, record in records.items():
            record["version"] = VERSION.replace("00000000", f"{seed:08d}")
            store.changes(spec.path).note(key, record["version"])  # as a commit does first
        store.backend.put_many(folder, {f"{k}.json": json.dumps(r).encode()
                                        for k, r in records.items()})  # fmt: skip
    return len(changed)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def manifests_nightly_dataset(store: ZarrStore, resources: dict, instance) -> None:
    keys = sorted(instance.get_dynamic_partitions("ct_scans"))
    assets = [a.path for a in CT.assets]
    first, manifest = timed(lambda: write_dataset(store, "ct", assets))
    bench("scale.manifest_50k_s", first, "s",
          f"the first ct dataset manifest of a store: {len(keys)} synthetic committed "
          f"partitions x 4 assets, every commit record read once")  # fmt: skip
    changed = rebuild(store, keys, 100, 1)
    seconds, manifest = timed(lambda: write_dataset(store, "ct", assets))
    bench("scale.manifest_50k_incremental_s", seconds, "s",
          f"the next ct dataset manifest over {len(keys)} committed partitions x 4 assets after "
          f"{changed} were rebuilt: the previous manifest's rows plus the change logs since, "
          f"only their records re-read; "
          f"{len(manifest['keys'])} keys")  # fmt: skip
    synthetic_table(store, manifest)
    nightly = code_location(resources).resolve_schedule_def(CT.nightly)

    def evaluate() -> int:
        when = datetime(2026, 11, 23, 2)
        with dg.build_schedule_context(
            instance=instance, resources=resources, scheduled_execution_time=when
        ) as ctx:
            out = nightly(ctx)  # fmt: skip
        return 0 if isinstance(out, dg.SkipReason) else len(out)

    changed = rebuild(store, keys, 100, 2)
    seconds, requested = timed(evaluate)
    bench("scale.nightly_eval_50k_s", seconds, "s",
          f"ct_nightly evaluation over {len(keys)} partitions x 4 assets, {changed} rebuilt "
          f"since the last evaluation (their records re-read); {requested} runs requested, "
          f"the rest of the stale 1 % queued")  # fmt: skip
    store.backend.remove_tree(store.backend.join(".zarrfeed", "indexes"))
    seconds, _ = timed(evaluate)
    bench("scale.nightly_eval_50k_first_s", seconds, "s",
          "the same evaluation with no record summaries cached (a store's first): every "
          "commit record read once")  # fmt: skip
    seconds, dataset = timed(lambda: CTPatchDataset(ZarrStore(store.url), window="lung"))
    bench("scale.dataset_init_50k_s", seconds, "s",
          f"CTPatchDataset over the manifest: {len(dataset.keys)} partitions, "
          f"{len(dataset)} patches (synthetic consolidated patch index, its keys and "
          f"versions checked against the manifest's)")  # fmt: skip


def collection(store: ZarrStore, keys: list[str]) -> None:
    """Garbage collection over every partition with 10 retained dataset versions: each
    version written after 1 % of the keys were rebuilt, every committed and superseded
    version a folder of its own (its guard only: collection never opens the arrays)."""
    assets = [a.path for a in CT.assets]

    def folders() -> None:
        for path in assets:
            for key, summary in store.record_summaries(path).items():
                folder = Path(store.path(path, key)) / summary["version"]
                if not folder.exists():
                    folder.mkdir(parents=True)
                    (folder / "zarr.json").write_bytes(b"{}")

    folders()
    for seed in range(3, 13):
        rebuild(store, keys, 100, seed)
        folders()
        write_dataset(store, "ct", assets, retention=Retention(last=10, days=0))
    orphans = keys[::100]  # versions of writers that died before their commit
    for path in assets:
        for key in orphans:
            folder = Path(store.path(path, key)) / VERSION.replace("-00000000", "-deadbeef")
            folder.mkdir(parents=True)
            (folder / "zarr.json").write_bytes(b"{}")
    stale = len(orphans) * len(assets)
    seconds, report = timed(lambda: collect(store, older_than_s=0))
    bench("scale.gc_50k_s", seconds, "s",
          f"collection over {len(keys)} partitions x {len(assets)} assets with "
          f"{len(report.kept)} retained dataset versions: {report.removed} objects removed (of "
          f"them {stale} orphaned partition versions), "
          f"{report.retained_versions} superseded versions kept for retained dataset "
          f"versions")  # fmt: skip


def resources_for(store: str, raw: Path, settings: CTSettings) -> dict:
    """The resources the CT family's definitions need, and its settings (``ct_settings``,
    which the definitions take, not the runs)."""
    return {
        "build": BuildOptions(),
        "hf": HuggingFaceResource(),
        "zarr_store": ZarrStoreResource(url=store),
        "raw": RawFolderResource(root=str(raw)),
        "ct_settings": settings,
    }


def code_location(resources: dict) -> dg.Definitions:
    """The CT family's definitions with the settings in ``resources``."""
    # The family's definitions bring their own hub resource; the rest comes from here.
    runtime = {k: v for k, v in resources.items() if k not in ("ct_settings", "hf")}
    return dg.Definitions.merge(
        family_defs(CT, resources["ct_settings"]), dg.Definitions(resources=runtime)
    )


def scale(work: Path, n: int, more: int, runs: int) -> None:
    (work / "home").mkdir()
    resources = resources_for(str(work / "store.zarr"), work / "raw", CTSettings())
    with dg.instance_for_test(temp_dir=str(work / "home")) as instance:
        discovery(work, n, more, resources, instance)
        if runs:
            overhead(work, resources, instance, runs)
        store = resources["zarr_store"].store()
        keys = sorted(instance.get_dynamic_partitions("ct_scans"))
        synthetic_commits(store, instance, CT.values(resources["ct_settings"]), keys)
        manifests_nightly_dataset(store, resources, instance)
        collection(store, keys)
