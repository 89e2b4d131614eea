"""A family declared outside zarrfeed — ``tests/mri_family.py``, one file — is a family like
the built-in ones: its component (YAML attributes, as in ``zarrfeed/defs``) gives a real
Dagster instance a discovery sensor that finds its raw items, a build job whose blocking
checks hold bad data back, a dataset manifest, a nightly schedule that rebuilds exactly what
a changed setting makes stale, a training reader over what was built, and a training task
that ``zarrfeed.training.train`` trains once ``ZARRFEED_FAMILIES`` registers the family."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import dagster as dg
import numpy as np
import pytest
from graph import requested
from mri_family import MRI, MRI_MASK, MRI_VOLUME
from torch.utils.data import DataLoader

from zarrfeed.components import FamilyComponent
from zarrfeed.datasets import read_manifest
from zarrfeed.errors import ConfigError
from zarrfeed.resources import BuildOptions, RawFolderResource, ZarrStoreResource
from zarrfeed.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]

GOOD, EMPTY = ["a", "b", "c"], "empty"
SHAPE = (12, 16, 16)


def component(percentile: float) -> dg.Definitions:
    """The family's definitions from its component's YAML, as a defs folder would load it."""
    yaml = f"family: mri_family:MRI\nsettings:\n  clip_percentile: {percentile}\n"
    return dg.build_defs_for_component(FamilyComponent.resolve_from_yaml(yaml))


def expected_volume(raw: Path, key: str, percentile: float) -> np.ndarray:
    volume = np.load(raw / "mri" / f"{key}.npy")
    return np.clip(volume / np.percentile(volume, percentile), 0, 1).astype(np.float16)


@pytest.mark.slow
def test_a_family_declared_in_one_file_is_discovered_built_checked_listed_read_and_rebuilt(
    tmp_path, monkeypatch
):
    raw = tmp_path / "raw"
    (raw / "mri").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for key in GOOD:  # a bright blob in noise
        volume = rng.gamma(2.0, 10.0, SHAPE).astype(np.float32)
        volume[3:9, 4:12, 4:12] += 200
        np.save(raw / "mri" / f"{key}.npy", volume)
    np.save(raw / "mri" / f"{EMPTY}.npy", np.zeros(SHAPE, np.float32))  # no tissue at all
    resources = {
        "zarr_store": ZarrStoreResource(url=str(tmp_path / "store.zarr")),
        "raw": RawFolderResource(root=str(raw)),
        "build": BuildOptions(),
    }
    store = resources["zarr_store"].store()
    defs = dg.Definitions.merge(component(99.0), dg.Definitions(resources=resources))
    keys = sorted([*GOOD, EMPTY])
    (tmp_path / "home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        # Discovered: its sensor makes every raw volume a partition and asks for its build.
        sensor = defs.resolve_sensor_def(MRI.discovery)
        found = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert list(requested(found.run_requests, keys)) == keys
        assert found.dynamic_partitions_requests[0].partition_keys == keys
        instance.add_dynamic_partitions(MRI.partitions, keys)  # what the daemon does

        # Built and checked, partition by partition, by its build job.
        job = defs.resolve_job_def(MRI.build_job)
        runs = {
            k: job.execute_in_process(partition_key=k, instance=instance, raise_on_error=False)
            for k in keys
        }
        for key in GOOD:
            assert runs[key].success
            assert all(c.passed for c in runs[key].get_asset_check_evaluations())
            stored = store.read_array(MRI_VOLUME.path, key, "volume")
            np.testing.assert_array_equal(stored, expected_volume(raw, key, 99.0))
            mask = store.read_array(MRI_MASK.path, key, "mask")
            np.testing.assert_array_equal(mask, (stored > 0.2).astype(np.uint8))
        failed = {(c.check_name, c.passed) for c in runs[EMPTY].get_asset_check_evaluations()}
        assert not runs[EMPTY].success and ("has_tissue", False) in failed  # blocking
        assert store.commit_record(MRI_MASK.path, EMPTY)["checks"] == {"has_tissue": False}

        # Listed in its dataset manifest: the complete keys that passed every check.
        assert defs.resolve_job_def(MRI.dataset_job).execute_in_process(instance=instance).success
        manifest = read_manifest(store, MRI.name)
        assert manifest["keys"] == GOOD
        assert manifest["failed"] == {EMPTY: [f"{MRI_MASK.path}:has_tissue"]}

        # Read by its training reader, through a plain DataLoader.
        dataset = MRI.readers[0].load()(store.url)
        batch = next(iter(DataLoader(dataset, batch_size=len(GOOD))))
        assert tuple(batch["image"].shape) == (len(GOOD), 1, *SHAPE)
        for row, key in enumerate(GOOD):
            expected = store.read_array(MRI_VOLUME.path, key, "volume")
            np.testing.assert_array_equal(batch["image"][row, 0].numpy(), expected)
            mask = store.read_array(MRI_MASK.path, key, "mask")
            np.testing.assert_array_equal(batch["mask"][row, 0].numpy(), mask)

        # Trained by its own task through the public entry point, once registered: the
        # config is the task's own model, whose data section is the task's.
        with pytest.raises(ConfigError, match="task: no task 'mri_tissue'"):
            TrainConfig.load(task="mri_tissue")
        monkeypatch.setenv("ZARRFEED_FAMILIES", "mri_family:MRI")
        with pytest.raises(ConfigError, match=r"data\.clip_len: unknown key .*volumes"):
            TrainConfig.load(task="mri_tissue", data={"clip_len": 3})
        config = TrainConfig.load(
            task="mri_tissue",
            store=store.url,
            out=str(tmp_path / "models"),
            dataloader={"workers": "0"},
            train={"steps": 40, "batch_size": 3, "lr": 0.05, "width": 4, "log_every": 10},
        )
        assert type(config.data).__name__ == "TissueData"
        result = train(config, log=None)
        assert result.task == "mri_tissue" and Path(result.checkpoint).is_file()
        assert result.eval_after["loss"] < result.eval_before["loss"]
        assert result.eval_after["iou"] > result.eval_before["iou"]

        # Rebuilt nightly when its setting changes, and only then.
        def nightly(definitions: dg.Definitions) -> dict[str, str]:
            schedule = definitions.resolve_schedule_def(MRI.nightly)
            with dg.build_schedule_context(
                instance=instance,
                resources=resources,
                scheduled_execution_time=datetime(2026, 11, 22, 2),
            ) as context:
                out = schedule(context)
            if isinstance(out, dg.SkipReason):
                return {}
            return requested(out, keys)

        assert nightly(defs) == {}  # nothing changed, the failed partition included
        changed = dg.Definitions.merge(component(95.0), dg.Definitions(resources=resources))

        def version(definitions: dg.Definitions, spec) -> str:
            return definitions.resolve_asset_graph().get(dg.AssetKey(spec.name)).code_version

        # The stage that declares the setting has a new code version (the UI shows it
        # stale against what its partitions were materialised with); the other has not.
        assert version(changed, MRI_VOLUME) != version(defs, MRI_VOLUME)
        assert version(changed, MRI_MASK) == version(defs, MRI_MASK)
        latest = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(MRI_VOLUME.name), asset_partitions=["a"]),
            limit=1,
        ).records[0]
        assert latest.asset_materialization.tags["dagster/code_version"] == version(
            defs, MRI_VOLUME
        )
        why = f"{MRI_VOLUME.name}: inputs, settings or code changed since the last build"
        assert nightly(changed) == dict.fromkeys(keys, why)
        rebuild = changed.resolve_job_def(MRI.build_job)
        for key in keys:
            rebuild.execute_in_process(partition_key=key, instance=instance, raise_on_error=False)
        assert nightly(changed) == {}
        for key in GOOD:
            stored = store.read_array(MRI_VOLUME.path, key, "volume")
            np.testing.assert_array_equal(stored, expected_volume(raw, key, 95.0))


def test_the_family_is_named_by_no_zarrfeed_module_and_touches_three_files_at_most():
    """Adding the family took its declaration and its test: nothing in zarrfeed (nor its
    configs) names it."""
    texts = [*ROOT.glob("zarrfeed/**/*.py"), *ROOT.glob("zarrfeed/**/*.yaml"),
             *ROOT.glob("configs/*"), *ROOT.glob("tests/*.py")]  # fmt: skip
    naming = sorted(
        p.relative_to(ROOT).as_posix() for p in texts if "mri_family" in p.read_text().lower()
    )
    assert naming == ["tests/mri_family.py", "tests/test_new_family.py"]
    assert len(naming) <= 3
