"""The embedded demo instance (SQLite, the multiprocess executor) under the same crash as the
production one: runs killed mid-step together with their code server no longer hold the queue,
and their retries complete the partitions."""

import signal
import sys
import time

import pytest
import yaml
from crash import POLL_S, crash_and_recover
from ct_builds import ct_deployment, ct_raw
from services import Deployment, instance_yaml

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


# What Dagster's CLIs do first (dagster._utils.interrupts.setup_interrupt_handlers), then wait.
AS_DAGSTER = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT)); "
    "print('up', flush=True); time.sleep(600)"
)


def test_a_deployment_process_stops_on_sigterm_though_its_starter_ignores_sigint(tmp_path):
    """pytest-xdist workers ignore SIGINT; a process the deployment starts must not inherit
    that (Dagster's CLIs would then ignore SIGTERM too, and each stop wait 30 s for SIGKILL)."""
    d = Deployment(tmp_path / "home", {})
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = d.spawn("as_dagster", sys.executable, "-c", AS_DAGSTER)
    finally:
        signal.signal(signal.SIGINT, before)
    log = d.logs / "as_dagster.log"
    d.wait_until(lambda: "up" in log.read_text(), 60, "the child's signal handlers")
    t0 = time.monotonic()
    d.kill("as_dagster", signal.SIGTERM)
    # SIGTERM ran SIGINT's handler (KeyboardInterrupt), not kill()'s SIGKILL after 30 s
    assert proc.returncode == -signal.SIGINT, (proc.returncode, log.read_text())
    assert time.monotonic() - t0 < 10
