"""Work proportional to what changed: the cached tree walk, the catalog index, incremental
record summaries, and the build queue that releases a bounded number of runs per tick.  The
50,000-partition figures are in benchmarks/scale.py; its --quick run is smoke-tested here."""

from datetime import datetime

import dagster as dg
import pytest
from graph import FAMILIES, requested, schedule
from graph import sensor as sensor_of
from test_benchmarks import bench_names

from zarrfeed.families.ct import tables as ct_rate
from zarrfeed.formats import TreeCache, walk
from zarrfeed.jobs import queue
from zarrfeed.sources.catalog import RawCatalog
from zarrfeed.store import LocalBackend, ZarrStore
from zarrfeed.store.records import summarise

KEYS = ["train_1_a_1", "train_1_a_2", "train_2_a_1", "valid_1_a_1"]


def test_a_settled_folder_is_not_listed_again(tmp_path, monkeypatch):
    for i in range(3):
        (tmp_path / f"f{i}").mkdir()
        (tmp_path / f"f{i}" / "a.nii.gz").touch()
    listed = []
    real = walk._list
    monkeypatch.setattr(walk, "_list", lambda folder: listed.append(folder) or real(folder))
    cache = TreeCache(settled_ns=0)  # every mtime is old enough to trust
    first = walk.walk_tree(tmp_path, cache)
    assert len(listed) == 4
    (tmp_path / "f1" / "b.nii.gz").touch()  # f1's mtime changes; the others' do not
    listed.clear()
    second = walk.walk_tree(tmp_path, cache)
    assert [p.rsplit("/", 1)[-1] for p in listed] == ["f1"]
    assert second[tmp_path / "f1"] == ["a.nii.gz", "b.nii.gz"]
    assert {k: v for k, v in second.items() if k.name != "f1"} == {
        k: v for k, v in first.items() if k.name != "f1"
    }


def test_a_link_whose_target_appears_is_found_in_a_settled_folder(tmp_path):
    """A link into storage that is not mounted yet dangles; when its target appears, the
    folder holding the link does not change (its mtime neither): a folder with broken
    entries is listed again on every walk, not kept as it was."""
    cache = TreeCache(settled_ns=0)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.nii.gz").symlink_to(tmp_path / "store" / "a.nii.gz")
    first = walk.walk_tree(tmp_path / "raw", cache)
    assert first[tmp_path / "raw"] == [] and list(first.skipped) == [
        str(tmp_path / "raw" / "a.nii.gz")
    ]
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "a.nii.gz").touch()
    second = walk.walk_tree(tmp_path / "raw", cache)
    assert second[tmp_path / "raw"] == ["a.nii.gz"] and not second.skipped


def test_a_linked_folder_is_reported_not_dropped_silently(tmp_path):
    """Links to folders are not followed (they could form a cycle), but a raw tree made of
    links to where the data lies must not look empty without a word."""
    (tmp_path / "data" / "ct").mkdir(parents=True)
    (tmp_path / "data" / "ct" / "a.nii.gz").touch()
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "ct").symlink_to(tmp_path / "data" / "ct")
    tree = walk.walk_tree(tmp_path / "raw")
    assert list(tree) == [tmp_path / "raw"]
    why = tree.skipped[str(tmp_path / "raw" / "ct")]
    assert "link to a folder" in why and str(tmp_path / "data" / "ct") in why


def test_the_walk_lists_folders_in_path_order_without_a_global_sort(tmp_path):
    """Depth first over sorted subfolders is path order by components: ``a``, then all of
    ``a/…``, then ``a-b`` (a plain string sort would put ``a-b`` before ``a/x``)."""
    for folder in ["a/x/deep", "a-b", "a.c/y", "B", "a/w"]:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "f.nii").touch()
    cache = TreeCache()
    tree = walk.walk_tree(tmp_path, cache)
    order = [p.relative_to(tmp_path).parts for p in tree]
    assert order == sorted(order) and len(order) == 9
    assert list(walk.walk_tree(tmp_path, cache)) == list(tree)  # the cached listings too


def test_the_metadata_csv_reads_as_dictreader_would(tmp_path):
    """The fast reader gives DictReader's rows: quoted commas, short rows (None), blank
    lines skipped, folders and suffixes off the key, the last of a repeated name."""
    import csv
    import io

    text = (
        "VolumeName,RescaleSlope,RescaleIntercept,Note\r\n"
        'train_1_a_1.nii.gz,1,-1024,"a, b"\r\n'
        "\r\n"
        "sub/train_2_a_1.nii,1,-1024\r\n"
        "train_3_a_1.nii.gz,2,-2048,x\r\n"
        "train_3_a_1.nii.gz,1,-1024,y\r\n"
    )
    path = tmp_path / "train_metadata.csv"
    path.write_text(text)
    expected = {
        ct_rate.ct_stem(row["VolumeName"]): row for row in csv.DictReader(io.StringIO(text))
    }
    assert ct_rate.read_ct_rate_metadata(tmp_path) == expected
    assert list(expected) == ["train_1_a_1", "train_2_a_1", "train_3_a_1"]
    assert expected["train_2_a_1"]["Note"] is None and expected["train_3_a_1"]["Note"] == "y"


def test_an_unchanged_index_is_parsed_once_per_process(tmp_path, monkeypatch):
    backend = LocalBackend(tmp_path)
    catalog = RawCatalog(backend, "ct")
    from zarrfeed.families.ct.discover import scan_ct
    from zarrfeed.samples import make_sample_data

    make_sample_data(tmp_path / "raw", scans=2, sequences=1, images=1)
    catalog.update("raw:x", scan_ct(tmp_path / "raw"))
    reads = []
    real = LocalBackend.read
    monkeypatch.setattr(LocalBackend, "read", lambda self, p: reads.append(p) or real(self, p))
    assert sorted(RawCatalog(backend, "ct").index()) == sorted(catalog.index())
    assert reads == []  # the same object this process wrote
    index = backend.join(".zarrfeed/catalog/ct/index.json")
    backend.write_atomic(index, backend.read(index))  # rewritten: parsed again
    reads.clear()
    assert len(RawCatalog(backend, "ct").index()) == 2 and len(reads) == 1


def test_record_summaries_read_only_new_and_changed_records(tmp_path):
    from test_store import write

    store = ZarrStore(tmp_path / "s.zarr")
    write(store, "scan_1", 0.5)
    write(store, "scan_2", 0.5)
    assert sorted(store.record_summaries("ct/windows")) == ["scan_1", "scan_2"]
    write(store, "scan_2", 0.25)
    store.delete_partition("ct/windows", "scan_1")
    seen = []
    real = store.commit_records
    store.commit_records = lambda asset, keys: seen.extend(keys) or real(asset, keys)
    summaries = store.record_summaries("ct/windows")
    assert seen == ["scan_2"] and list(summaries) == ["scan_2"]
    record = store.commit_record("ct/windows", "scan_2")
    assert {k: v for k, v in summaries["scan_2"].items() if k != "stamp"} == summarise(record)


def test_the_discovery_sensor_releases_a_bounded_number_of_runs_per_tick(dagster_env, monkeypatch):
    _, resources, instance = dagster_env
    monkeypatch.setattr(queue, "PER_TICK", 3)
    monkeypatch.setattr(queue, "BATCH", dg.BackfillPolicy.multi_run(1))  # a run per key
    sensor = sensor_of(resources, "ct_discovery")
    ctx = dg.build_sensor_context(instance=instance, resources=resources)
    first = sensor(ctx)
    assert list(requested(first.run_requests, KEYS)) == KEYS[:3]
    assert first.dynamic_partitions_requests[0].partition_keys == KEYS  # all known at once
    instance.add_dynamic_partitions("ct_scans", KEYS)
    second = sensor(ctx)
    assert requested(second.run_requests, KEYS) == {KEYS[3]: "new raw item"}
    assert isinstance(sensor(ctx), dg.SkipReason)  # the queue is empty
    monkeypatch.setattr(queue, "IN_FLIGHT", 0)  # runs in flight leave no room: none released
    store = resources["zarr_store"].store()
    queue.BuildQueue(store.backend, "ct").add({KEYS[0]: "test"})
    assert isinstance(sensor(ctx), dg.SkipReason)
    assert queue.BuildQueue(store.backend, "ct").load() == {KEYS[0]: "test"}


def test_a_nightly_with_more_work_than_a_tick_queues_the_rest(dagster_env, monkeypatch):
    _, resources, instance = dagster_env
    monkeypatch.setattr(queue, "PER_TICK", 1)
    monkeypatch.setattr(queue, "BATCH", dg.BackfillPolicy.multi_run(1))
    instance.add_dynamic_partitions("ct_scans", KEYS)
    resources["zarr_store"].catalog("ct").update(
        resources["raw"].origin, resources["raw"].scan(FAMILIES["ct"])
    )
    with dg.build_schedule_context(
        instance=instance, resources=resources, scheduled_execution_time=datetime(2026, 11, 22, 2)
    ) as ctx:
        requests = schedule(resources, "ct_nightly")(ctx)
    assert list(requested(requests, KEYS)) == KEYS[:1]
    waiting = queue.BuildQueue(resources["zarr_store"].store().backend, "ct").load()
    assert waiting == dict.fromkeys(KEYS[1:], "ct_hu missing")
    sensor = sensor_of(resources, "ct_discovery")
    for key in KEYS[1:]:  # the sensor releases them, a tick's worth at a time
        tick = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        assert list(requested(tick.run_requests, KEYS)) == [key]


def test_a_partition_queued_again_is_released_under_a_new_run_key(dagster_env):
    """A partition the nightly queues again (its run failed, and a backlog keeps the nightly
    from releasing it itself) gets a run key never used before: the daemon drops a request
    whose run key its sensor used, and the partition would leave the queue unbuilt."""
    _, resources, instance = dagster_env
    instance.add_dynamic_partitions("ct_scans", KEYS)
    resources["zarr_store"].catalog("ct").update(
        resources["raw"].origin, resources["raw"].scan(FAMILIES["ct"])
    )
    sensor = sensor_of(resources, "ct_discovery")
    waiting = queue.BuildQueue(resources["zarr_store"].store().backend, "ct")
    run_keys = []
    for _ in range(2):
        waiting.add({KEYS[1]: "ct_hu missing"})  # what the nightly queues, night after night
        tick = sensor(dg.build_sensor_context(instance=instance, resources=resources))
        (request,) = tick.run_requests
        assert request.partition_key == KEYS[1]
        run_keys.append(request.run_key)
    assert run_keys[0] != run_keys[1]


def test_a_tick_requests_a_bounded_number_of_runs_whatever_their_sizes(tmp_path, monkeypatch):
    """Non-adjacent keys are a run each: the bound counts runs, and the runs in flight."""
    monkeypatch.setattr(queue, "PER_TICK", 3)
    monkeypatch.setattr(queue, "IN_FLIGHT", 5)
    assert [queue.room(n) for n in (0, 2, 3, 5, 9)] == [3, 3, 2, 0, 0]
    order = [f"k{i:02d}" for i in range(20)]
    wanted = dict.fromkeys(order[::2], "new")  # no two adjacent: ten runs
    wanted["gone"] = "new"  # no raw source: leaves the queue
    build = queue.BuildQueue(LocalBackend(tmp_path / "s.zarr"), "ct")
    with dg.instance_for_test() as instance:

        def launch(n: int) -> None:
            for _ in range(n):
                run = dg.DagsterRun(job_name="ct_build", tags={"family": "ct"},
                                    status=dg.DagsterRunStatus.STARTED)  # fmt: skip
                instance.add_run(run)

        runs = build.release(instance, wanted, [order], order)
        assert runs == [[(k, "new")] for k in order[:6:2]]
        assert list(build.load()) == order[6::2]
        launch(3)  # three runs in flight: room for two more
        assert [k for ((k, _),) in build.release(instance, {}, [order], order)] == order[6:10:2]
        launch(2)
        changed = dict.fromkeys(order[7:10], "changed")
        assert build.release(instance, changed, [order], order) == []  # five in flight
        assert list(build.load()) == [*order[10::2], *order[7:10]]
    with dg.instance_for_test() as instance:  # consecutive keys share a run
        runs = build.release(instance, {}, [order], order)
        assert [[k for k, _ in run] for run in runs] == [order[7:11], ["k12"], ["k14"]]


def test_a_run_never_spans_partitions_that_exist_and_those_the_tick_adds(dagster_env):
    """A range is resolved in Dagster's order: the keys a tick adds come after every key
    there, so a range over both could cover keys nobody asked for."""
    _, resources, instance = dagster_env
    instance.add_dynamic_partitions("ct_scans", [KEYS[0], KEYS[2]])
    sensor = sensor_of(resources, "ct_discovery")
    result = sensor(dg.build_sensor_context(instance=instance, resources=resources))
    order = [KEYS[0], KEYS[2], KEYS[1], KEYS[3]]  # what Dagster has once the tick is applied
    assert result.dynamic_partitions_requests[0].partition_keys == [KEYS[1], KEYS[3]]
    runs = [list(requested([r], order)) for r in result.run_requests]
    assert sorted(map(sorted, runs)) == [sorted(KEYS[0::2]), sorted(KEYS[1::2])]


@pytest.mark.slow
def test_scale_benchmark_quick():
    assert {
        "scale.discovery_50k_s",
        "scale.discovery_incremental_s",
        "scale.partition_overhead_50k_vs_100",
        "scale.nightly_eval_50k_s",
        "scale.manifest_50k_s",
        "scale.dataset_init_50k_s",
        "s3.write_vs_local",
        "s3.read_vs_local",
        "s3.read_vs_raw_get",
    } <= bench_names("scale.py")
