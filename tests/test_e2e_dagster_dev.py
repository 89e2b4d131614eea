"""End to end: ``dagster dev`` on 127.0.0.1 with a temporary DAGSTER_HOME, driven over GraphQL.

The images discovery sensor (running by default) must turn a raw image set into a partition
and a successful run with no click; a partition run launched through the API must succeed.
"""

import os
import shutil

import pytest
from dagsterdev import start_dagster_dev, wait_for

pytestmark = pytest.mark.slow
RUNS_QUERY = """
query Runs($key: String!, $value: String!) {
  runsOrError(filter: {tags: [{key: $key, value: $value}]}) {
    ... on Runs { results { runId status jobName } }
  }
}"""
RANGE = ("dagster/asset_partition_range_start", "dagster/asset_partition_range_end")


@pytest.fixture
def dagster_dev(tmp_path, sample_dir):
    raw = tmp_path / "raw"
    shutil.copytree(sample_dir / "inspection", raw / "inspection")  # the quickest family
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(raw),
           "ZARRFEED_STORE": str(tmp_path / "store.zarr")}  # fmt: skip
    with start_dagster_dev(env, tmp_path / "dagster_dev.log") as port:
        yield port, tmp_path


def test_sensor_and_graphql_runs_succeed_against_dagster_dev(dagster_dev):
    from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError

    from zarrfeed.store import ZarrStore

    port, tmp_path = dagster_dev
    client = DagsterGraphQLClient("127.0.0.1", port_number=port)

    def runs(key):
        """The runs that build ``key``: its own, or a batched run whose range starts or ends
        at it (the sensor requests new sets as ranges of consecutive partitions)."""
        found = []
        for tag in ("dagster/partition", *RANGE):
            data = client._execute(RUNS_QUERY, {"key": tag, "value": key})
            found += data["runsOrError"]["results"]
        return found

    # 1. No click: the discovery sensor adds both sets and launches their runs.
    for key in ("inspection_test", "inspection_train"):
        wait_for(lambda k=key: any(r["status"] == "SUCCESS" for r in runs(k)), 240,
                 f"a sensor-launched run of {key} to succeed")  # fmt: skip
    # 2. A run launched through the API, with force so it really rebuilds.
    run_id = client.submit_job_execution(
        "images_build",
        tags={"dagster/partition": "inspection_test"},
        run_config={"resources": {"build": {"config": {"force": True}}}},
    )

    def finished():
        try:
            status = client.get_run_status(run_id).value
        except DagsterGraphQLClientError:
            return None
        return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None

    log = (tmp_path / "dagster_dev.log").read_text
    assert wait_for(finished, 240, "the API run") == "SUCCESS", log()[-3000:]
    store = ZarrStore(tmp_path / "store.zarr")
    assert store.list_partitions("images/patches") == ["inspection_test", "inspection_train"]
