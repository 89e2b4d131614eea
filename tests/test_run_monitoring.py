"""The embedded demo instance (SQLite, the multiprocess executor) under the same crash as the
production one: runs killed mid-step together with their code server no longer hold the queue,
and their retries complete the partitions."""

import pytest
import yaml
from crash import POLL_S, crash_and_recover
from ct_builds import ct_deployment, ct_raw
from services import instance_yaml

from zarrfeed.commands.demo import prepare_home

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """(deployment, raw folder, keys): the demo's dagster.yaml (one run slot, as on one core:
    one crash fills the queue) with a short monitoring interval, 2 raw scans (one crashed,
    one built first to measure the machine)."""
    tmp = tmp_path_factory.mktemp("embedded")
    raw = ct_raw(tmp / "raw", 2)
    demo_home = tmp / "demo_home"
    prepare_home(demo_home, runs=1)
    demo = yaml.safe_load((demo_home / "dagster.yaml").read_text())
    limits = {"poll_interval_seconds": POLL_S, "free_slots_after_run_end_seconds": 1}
    with ct_deployment(tmp, raw, instance_yaml(demo, **limits), {}) as (d, keys):
        yield d, raw, keys


def test_crashed_runs_of_the_demo_instance_do_not_block_its_queue(embedded):
    d, raw, keys = embedded
    victims = {keys[0]: next(raw.rglob(f"{keys[0]}.nii.gz"))}
    seconds = crash_and_recover(d, victims, {}, measure=keys[1])
    print(f"crashed runs failed {seconds}")
