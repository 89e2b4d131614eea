"""Shared fixtures: real files shipped in PyPI wheels, and the sample data made once."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from services import remove_orphaned_semaphores, semaphores

from zarrfeed.samples import make_sample_data
from zarrfeed.store import ZarrStore


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (spikezoo is installed
    with --no-deps only for its data)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{name} is not installed; .ci/run installs it (see README)")
    return Path(next(iter(spec.submodule_search_locations)))


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest-xdist worker (and every process it starts: the demo, ``dg dev``'s runs,
    Celery workers, loader workers) gets its share of the cores for torch's intra-op
    threads.  Two workers each running torch with as many threads as the machine has cores
    oversubscribe it, and OpenMP's spinning threads then make a convolution step 2–3× slower
    than on one thread (measured on 2 cores: 2.5–3.3 s vs 1.0 s a step of the occupancy
    autoencoder while the other worker trained)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        share = max(1, len(os.sched_getaffinity(0)) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)  # read when torch (and OpenMP) start
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(share)


# Files that take minutes, longest first.  pytest-xdist hands whole files to its workers in
# collection order (``--no-loadscope-reorder``; its default orders files by test count), so
# these start at once, beside the many short files, instead of ending the run on one worker.
# The files after test_training.py each hold a test of 40-100 s (a full run's --durations);
# in name order the later ones started last.  The run's "slowest 15 files" checks the order.
LONGEST_FIRST = ("test_demo.py", "test_benchmarks.py", "test_run_monitoring.py",
                 "test_deploy_celery.py", "test_s3.py", "test_training.py",
                 "test_production_ui.py", "test_assets_training.py", "test_snapshots.py",
                 "test_scale.py", "test_backfill.py", "test_hub.py")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The files that took longest (setup, call and teardown of their tests summed) and the
    worker that ran each: what LONGEST_FIRST should list, and each worker's share."""
    per_file: dict[str, float] = {}
    per_worker: dict[str, float] = {}
    worker_of: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            if not isinstance(rep, pytest.TestReport):
                continue
            path = rep.nodeid.split("::")[0]
            worker = getattr(getattr(rep, "node", None), "gateway", None)
            worker_id = worker.id if worker is not None else "-"
            per_file[path] = per_file.get(path, 0.0) + rep.duration
            per_worker[worker_id] = per_worker.get(worker_id, 0.0) + rep.duration
            worker_of[path] = worker_id
    if not per_file:
        return
    terminalreporter.write_sep("=", "slowest 15 files")
    for path, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s {worker_of[path]:>5} {path}")
    shares = ", ".join(f"{w} {s:.0f}s" for w, s in sorted(per_worker.items()))
    terminalreporter.write_line(f"per worker: {shares}")


@pytest.fixture(scope="session", autouse=True)
def cache_root():
    """Shared caches made by the tests live in one folder removed at the end (tmpfs is RAM)."""
    import tempfile

    root = tempfile.mkdtemp(
        prefix="zarrfeed-tests-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    )
    old = os.environ.get("ZARRFEED_CACHE_ROOT")
    os.environ["ZARRFEED_CACHE_ROOT"] = root  # inherited by workers and subprocesses
    os.environ["ZARRFEED_DISK_CACHE"] = os.path.join(root, "disk")  # the object stores' tier
    yield Path(root)
    os.environ.pop("ZARRFEED_DISK_CACHE", None)
    if old is None:
        os.environ.pop("ZARRFEED_CACHE_ROOT", None)
    else:
        os.environ["ZARRFEED_CACHE_ROOT"] = old
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def orphaned_semaphores():
    """Tests that lose a machine on purpose SIGKILL whole process groups: the named
    semaphores they orphan go at the end of the session (only those)."""
    before = semaphores()
    yield
    remove_orphaned_semaphores(before)


@pytest.fixture(autouse=True)
def killable_children(request):
    """Children inherit an ignored SIGTERM across exec, and then a multiprocessing pool's
    terminate() waits for them forever.  Some library in the session leaves SIGTERM ignored
    (seen once in CI: a pool worker outlived pytest); the test that did is named and the
    default put back."""
    import signal
    import warnings

    yield
    if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        warnings.warn(f"{request.node.nodeid} left SIGTERM ignored; the default is restored",
                      stacklevel=1)  # fmt: skip


@pytest.fixture(scope="session")
def spikezoo_data() -> Path:
    return package_dir("spikezoo") / "data" / "base"


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    make_sample_data(out)
    return out


@pytest.fixture
def dagster_env(tmp_path: Path, sample_dir: Path):
    """(raw folder, resources, instance): a copy of the sample data, a store and a real
    Dagster instance in a temporary DAGSTER_HOME, with small CT settings for speed."""
    import dagster as dg
    from graph import base_resources

    from zarrfeed.families.ct import CTSettings
    from zarrfeed.resources import ModelsResource, RawFolderResource, ZarrStoreResource

    raw = tmp_path / "raw"
    shutil.copytree(sample_dir, raw)
    resources = {
        **base_resources(),
        "zarr_store": ZarrStoreResource(url=str(tmp_path / "store.zarr")),
        "raw": RawFolderResource(root=str(raw)),
        "models": ModelsResource(root=str(tmp_path / "models")),
        "ct_settings": CTSettings(
            spacing_zyx_mm=[5.0, 3.0, 3.0], windows=["lung", "bone"], sparse_grid=16
        ),
    }
    (tmp_path / "dagster_home").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster_home")) as instance:
        yield raw, resources, instance


@pytest.fixture(scope="session")
def built(tmp_path_factory, sample_dir):
    """Every family of the sample data materialised into one store (session-wide).

    Built in a fresh interpreter: Dagster keeps process-global definitions state, and these
    tests should not depend on which Dagster tests ran before them.
    """
    tmp = tmp_path_factory.mktemp("built")
    raw = tmp / "raw"
    shutil.copytree(sample_dir, raw)
    script = Path(__file__).with_name("build_sample_store.py")
    args = [sys.executable, str(script), str(raw), str(tmp / "store.zarr"), str(tmp / "home")]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return ZarrStore(tmp / "store.zarr"), raw


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """``zarrfeed sample-data --with-faults`` then ``zarrfeed demo``, once per session in a
    fresh folder: (folder, env pointing at what it made, the demo's completed process)."""
    tmp = tmp_path_factory.mktemp("demo")
    home, store, raw = tmp / "home", tmp / "store.zarr", tmp / "raw"
    env = {**os.environ, "DAGSTER_HOME": str(home), "ZARRFEED_RAW": str(raw),
           "ZARRFEED_STORE": str(store), "ZARRFEED_MODELS": str(tmp / "models")}  # fmt: skip
    zarrfeed = Path(sys.executable).with_name("zarrfeed")
    made = subprocess.run([zarrfeed, "sample-data", raw, "--with-faults"], capture_output=True)
    assert made.returncode == 0, made.stderr[-2000:]
    args = ["demo", "--raw", raw, "--store", store, "--dagster-home", home]
    out = subprocess.run(
        [zarrfeed, *args], capture_output=True, text=True, timeout=600, cwd=tmp, env=env
    )
    return tmp, env, out
