"""Model assets train as ``torchrun`` through Dagster Pipes: two gloo ranks, rank 0 reporting
logs, metadata and the check; the same command trains outside Dagster; a failed or killed
training fails the step with its last lines."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import dagster as dg
import pytest
import yaml
from dagsterdev import wait_for
from graph import base_resources
from procs import descendants

from zarrfeed.assets.datasets import dataset_asset
from zarrfeed.assets.messages import whole_lines
from zarrfeed.assets.torchrun import TorchrunResource
from zarrfeed.assets.training import model_asset
from zarrfeed.families.ct import CT
from zarrfeed.resources import ModelsResource, RawFolderResource, ZarrStoreResource

pytestmark = pytest.mark.slow
MODEL = model_asset("ct_classifier")
DATASET = dataset_asset(CT)


def run(built, tmp_path, nproc: int, **train) -> tuple[dg.ExecuteInProcessResult, list[str]]:
    """Materialise the CT classifier on ``nproc`` ranks: the result and the run's log lines."""
    store, raw = built
    resources = {
        **base_resources(),
        "zarr_store": ZarrStoreResource(url=store.url),
        "raw": RawFolderResource(root=str(raw)),
        "models": ModelsResource(root=str(tmp_path / "models")),
        "torchrun": TorchrunResource(nproc_per_node=nproc),
    }
    config = {"dataloader": {"workers": "1"}, "train": {"log_every": 3, **train}}
    (tmp_path / "home").mkdir(exist_ok=True)
    with dg.instance_for_test(temp_dir=str(tmp_path / "home")) as instance:
        result = dg.materialize(
            [DATASET, MODEL],
            resources=resources,
            instance=instance,
            run_config={"ops": {"ct_classifier_model": {"config": config}}},
            raise_on_error=False,
        )
        return result, [e.user_message for e in instance.all_logs(result.run_id)]


def failure(result: dg.ExecuteInProcessResult) -> str:
    event = next(e for e in result.all_events if e.is_step_failure)
    error = event.step_failure_data.user_failure_data
    return error.description if error else event.step_failure_data.error.message


def test_two_gloo_ranks_report_through_rank_0_and_the_command_reruns_outside(built, tmp_path):
    result, lines = run(built, tmp_path, nproc=2, steps=6)
    assert result.success
    meta = result.asset_materializations_for_node("ct_classifier_model")[0].metadata
    assert meta["steps"].value == 6 and meta["resumed_from_step"].value == 0
    assert "![loss curve](data:image/png;base64," in meta["loss_curve"].value
    trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
    assert int(trained_on["partitions"]) > 0 and trained_on["data version of ct_dataset"]
    (check,) = [c for c in result.get_asset_check_evaluations() if c.check_name == "learned"]
    assert check.severity == dg.AssetCheckSeverity.WARN
    assert any("world=2" in m for m in lines)  # the trainer's log, through Pipes
    assert sum("step 6 | loss=" in m for m in lines) == 1  # from rank 0 only

    # The YAML the asset left runs outside Dagster with the same command, resuming the run.
    run_dir = tmp_path / "models" / "ct_classifier" / result.run_id
    config = yaml.safe_load((run_dir / "train.yaml").read_text())
    config["train"]["steps"] = 8
    (run_dir / "train.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    code = "import sys, zarrfeed.training.pipes; assert 'dagster' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "zarrfeed.training.pipes", "--config", str(run_dir / "train.yaml")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step 8 | loss=" in out.stdout


def test_a_failed_training_fails_the_step_with_its_error(built, tmp_path):
    result, _ = run(built, tmp_path, nproc=1, steps=4, batch_size=100_000)
    assert not result.success
    text = failure(result)
    assert "training failed" in text and "local rank 0 raised" in text
    assert "lower train.batch_size" in text  # the trainer's own error, from the rank


def test_a_killed_training_process_fails_the_step_with_its_last_lines(built, tmp_path):
    killed: list[int] = []

    def kill_the_rank_once_it_trains() -> None:
        logs = tmp_path / "models"

        def training_rank() -> int | None:
            started = any("step 3 |" in p.read_text() for p in logs.rglob("0/stdout.log"))
            ranks = [p for p, cmd in descendants(os.getpid()) if "zarrfeed.training.pipes" in cmd
                     and "torch.distributed.run" not in cmd]  # fmt: skip
            return ranks[0] if started and ranks else None

        pid = wait_for(training_rank, 240, "the training rank to log step 3")
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    watcher = threading.Thread(target=kill_the_rank_once_it_trains, daemon=True)
    watcher.start()
    result, _ = run(built, tmp_path, nproc=1, steps=100_000)
    watcher.join(10)
    assert killed and not result.success
    text = failure(result)
    assert "no rank raised an error" in text
    assert "local rank 0, last lines of stdout" in text
    assert re.search(r"step \d+ \| loss=", text)  # where it stopped


def test_a_message_caught_mid_write_is_read_whole(tmp_path):
    """A read that lands while a long message is half written waits for its newline (Dagster
    1.13's reader hands on the half and its thread dies); a line written just before the
    close is still read; a last line cut off by a killed writer is dropped."""
    path = tmp_path / "messages"
    path.write_text("")
    closed = threading.Event()
    message = json.dumps({"method": "report", "params": {"text": "x" * 5000}})
    halfway, written = threading.Event(), threading.Event()  # the rest is being written

    def writer() -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(message[:900])
            f.flush()
            time.sleep(0.3)  # the reader polls every 10 ms: it finds the half line
            halfway.set()
            f.write(message[900:] + "\n")
            f.write('{"method": "closed"}\n{"method": "cut')
        written.set()
        closed.set()

    lines: list[str] = []
    thread = threading.Thread(target=writer)
    thread.start()
    for line in whole_lines(str(path), closed.is_set):
        lines.append(line)
        if not halfway.is_set():
            pytest.fail("a line was handed on before its newline")
    thread.join()
    assert written.is_set() and [json.loads(x) for x in lines] == [
        json.loads(message),
        {"method": "closed"},
    ]
