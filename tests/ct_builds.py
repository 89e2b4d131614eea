"""CT builds to compare: raw scans, their partitions, the embedded build (SQLite instance,
the demo's in-process execution) and the store's arrays as digests.

Deployments and the embedded build serve :func:`small_defs`: the project's code location with
small CT settings, as its defs folder would give with those settings in ``defs/ct``.

``python ct_builds.py RAW STORE DAGSTER_HOME RUN_CONFIG_JSON KEY...`` runs the embedded build
in a fresh interpreter (Dagster keeps process-global state; a test's process stays clean).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
from services import Deployment

# Small CT settings, as tests/conftest.py's dagster_env: a partition builds in about a second.
SETTINGS = {"spacing_zyx_mm": [5.0, 3.0, 3.0], "windows": ["lung", "bone"], "sparse_grid": 16}
# How a deployment serves small_defs: `dagster code-server start` loads it from this file.
SMALL_LOCATION = ("-f", __file__, "-a", "small_defs", "-d", str(Path(__file__).parent))


@dg.definitions
def small_defs() -> dg.Definitions:
    """The project's components, the CT family's with :data:`SETTINGS` over its YAML's."""
    from zarrfeed.components import DeploymentComponent, FamilyComponent, TrainingComponent
    from zarrfeed.components.project import PROJECT
    from zarrfeed.families.ct import CT

    tree = dg.ComponentTree.for_project(PROJECT)
    parts: list[Any] = [
        *tree.get_all_components(of_type=DeploymentComponent),
        *tree.get_all_components(of_type=TrainingComponent),
    ]
    for family in tree.get_all_components(of_type=FamilyComponent):
        if family.declaration is CT:
            family = family.model_copy(update={"settings": {**family.settings, **SETTINGS}})
        parts.append(family)
    return dg.Definitions.merge(*(part.build_defs(None) for part in parts))


def ct_raw(folder: Path, scans: int, size: str = "small") -> Path:
    """``scans`` synthetic CT-RATE volumes of ``size`` (``make_ct_rate``'s: ``"small"``
    40×96×96, ``"full"`` 300×512×512) under ``folder``, the raw folder a deployment reads."""
    from zarrfeed.samples import make_ct_rate

    list(make_ct_rate(folder / "ct-rate", scans, size, np.random.default_rng(0)))
    return folder


def register(instance: Any, raw: Path, store: str) -> list[str]:
    """Discover the CT scans under ``raw`` into ``store``'s catalog and ``instance``'s
    partitions, as a discovery tick does; returns the keys."""
    from zarrfeed.families.ct import CT
    from zarrfeed.jobs.discovery import discover_into
    from zarrfeed.resources import RawFolderResource, ZarrStoreResource

    raw_folder, zarr_store = RawFolderResource(root=str(raw)), ZarrStoreResource(url=store)
    return discover_into(instance, CT, raw_folder, zarr_store)


@contextlib.contextmanager
def ct_deployment(
    folder: Path,
    raw: Path,
    dagster_yaml: str,
    env: Mapping[str, str],
    workers: Sequence[str] = (),
    location: Sequence[str] = SMALL_LOCATION,
) -> Iterator[tuple[Deployment, list[str]]]:
    """A deployment with its home, store and models in ``folder``, the CT scans under ``raw``
    discovered before the daemon starts, serving ``location`` (:func:`small_defs` unless
    told); (deployment, partition keys), stopped at the end."""
    home = folder / "home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(dagster_yaml)
    store = str(folder / "store.zarr")
    paths = {"ZARRFEED_RAW": str(raw), "ZARRFEED_STORE": store,
             "ZARRFEED_MODELS": str(folder / "models")}  # fmt: skip
    d = Deployment(home, {**env, **paths}, location)
    try:
        with d.instance() as instance:
            keys = register(instance, raw, store)
        d.start(workers)
        yield d, keys
    finally:
        d.stop()


def embedded_build(raw: Path, store: str, home: Path, run_config: dict, keys: list[str]) -> None:
    """Build ``keys`` of ``ct_build`` into ``store`` in a fresh interpreter, the way
    ``zarrfeed demo`` does: a SQLite instance in ``home``, each partition in process."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {
        **{k: v for k, v in os.environ.items() if k != "ZARRFEED_EXECUTOR"},
        "DAGSTER_HOME": str(home),
        "ZARRFEED_RAW": str(raw),
        "ZARRFEED_STORE": store,
        "ZARRFEED_MODELS": str(home / "models"),
    }
    args = [sys.executable, __file__, str(raw), store, str(home), json.dumps(run_config), *keys]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=home)
    if out.returncode:
        raise AssertionError(f"the embedded build failed:\n{out.stderr[-3000:]}")


def store_arrays(url: str, family: str = "ct") -> dict[tuple[str, str, str], str]:
    """(store path, partition, array) → digest of dtype, shape and bytes, for every committed
    partition of ``family``'s stored assets."""
    from graph import FAMILIES

    from zarrfeed.store import ZarrStore

    store, found = ZarrStore(url), {}
    for spec in FAMILIES[family].assets:
        for key in store.list_partitions(spec.path):
            group = store.open_partition(spec.path, key)
            for name in sorted(group.array_keys()):
                data = np.ascontiguousarray(group[name][...])
                blob = f"{data.dtype}{data.shape}".encode() + data.tobytes()
                found[spec.path, key, name] = hashlib.sha256(blob).hexdigest()
    return found


def _main(raw: str, store: str, home: str, run_config: str, *keys: str) -> None:
    job = small_defs().resolve_job_def("ct_build")
    with dg.DagsterInstance.get() as instance:
        register(instance, Path(raw), store)
        for key in keys:
            result = job.execute_in_process(
                partition_key=key,
                run_config=json.loads(run_config),
                instance=instance,
                raise_on_error=False,
            )
            if not result.success:
                sys.exit(f"partition {key} failed in the embedded build")


if __name__ == "__main__":
    _main(*sys.argv[1:])
