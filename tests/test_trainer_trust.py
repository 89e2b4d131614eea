"""A trainer a person can trust: it resumes only its own run, a signal saves the step it is
at, the CLI takes the config's fields as flags and names config errors by file and line, the
CT-RATE classifier reports per-finding AUROC, and every run leaves TensorBoard events."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu

from zarrfeed.cli import main
from zarrfeed.errors import ConfigError
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.metrics import auroc
from zarrfeed.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]


def config(built, out: Path, **train_opts) -> TrainConfig:
    store, _ = built
    return TrainConfig.model_validate(
        {
            "task": "ct_classifier",
            "store": store.url,
            "out": str(out),
            "dataloader": {"workers": 0},
            "data": {"eval_batches": 1},
            "train": {"steps": 2, "log_every": 1, "amp": "off", **train_opts},
        }
    )


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_auroc_is_the_rank_statistic_with_ties_and_undefined_for_one_class():
    # by hand: of the 4 (positive, negative) pairs, 3 are ordered right -> 0.75
    assert auroc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    # a tie between a positive and a negative counts one half
    assert auroc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    assert auroc(np.array([0, 1, 1]), np.array([0.2, 0.5, 0.5])) == 1.0
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200).astype(float)
    scores = np.round(rng.normal(size=200) + labels, 1)  # rounded: many ties
    u = mannwhitneyu(scores[labels == 1], scores[labels == 0]).statistic
    assert auroc(labels, scores) == pytest.approx(u / (labels.sum() * (200 - labels.sum())))
    # unknown labels (NaN) are left out, not counted as negatives
    labels[:50] = np.nan
    known = ~np.isnan(labels)
    assert auroc(labels, scores) == auroc(labels[known], scores[known])
    # one class only: undefined, never 0.5
    assert auroc(np.ones(5), np.arange(5.0)) is None
    assert auroc(np.array([np.nan, 0.0, 0.0]), np.arange(3.0)) is None


def test_an_unreadable_checkpoint_is_named_and_read_only_to_resume(built, tmp_path):
    """A damaged checkpoint (cut short by a copy) fails naming its file, where torch's own
    error named none; with resume off it is not read at all (it used to fail all the same)
    and its folder is skipped."""
    out = tmp_path / "models"
    damaged = out / "ct_classifier" / "last.pt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"PK\x03\x04 the first bytes of a checkpoint")
    with pytest.raises(ConfigError, match=f"{re.escape(str(damaged))}: not a readable checkpoint"):
        train(config(built, out))
    fresh = config(built, out)
    fresh.resume = False
    assert train(fresh).checkpoint == str(damaged.parent / "run-2/last.pt")
    assert damaged.read_bytes() == b"PK\x03\x04 the first bytes of a checkpoint"


def test_resume_only_its_own_run_otherwise_a_new_folder_and_the_old_one_untouched(built, tmp_path):
    out = tmp_path / "models"
    first = train(config(built, out, batch_size=4))
    old = out / "ct_classifier" / "last.pt"
    assert first.checkpoint == str(old)
    before = sha(old), sha(old.with_name("metrics.json"))

    lines: list[str] = []
    other = config(built, out, batch_size=8, accumulate=2)
    second = train(other, log=lines.append)
    refusal = next(s for s in lines if "not resuming" in s)
    assert "train.batch_size: 4 -> 8" in refusal and "train.accumulate: 1 -> 2" in refusal
    assert "train.steps" not in refusal  # steps, logging and paths never make another run
    assert second.resumed_from == 0 and second.checkpoint == str(old.parent / "run-2/last.pt")
    assert (sha(old), sha(old.with_name("metrics.json"))) == before  # untouched
    assert torch.load(old, weights_only=True)["config"]["train"]["batch_size"] == 4

    # the same other config again continues its own folder, not the refused one
    again = config(built, out, batch_size=8, accumulate=2, steps=3, log_every=3)
    continued = train(again)
    assert continued.resumed_from == 2 and continued.checkpoint == second.checkpoint

    # resume_anyway: the configured folder's checkpoint is continued despite the difference
    anyway = config(built, out, batch_size=8, accumulate=2, steps=3)
    anyway.resume_anyway = True
    lines.clear()
    forced = train(anyway, log=lines.append)
    assert forced.resumed_from == 2 and forced.checkpoint == str(old)
    assert any("anyway" in s and "train.batch_size: 4 -> 8" in s for s in lines)

    # resume off never overwrites a checkpoint either
    fresh = config(built, out, batch_size=4)
    fresh.resume = False
    assert train(fresh).checkpoint == str(old.parent / "run-3/last.pt")


def test_ct_classifier_reports_per_finding_auroc_and_tensorboard_events(built, tmp_path):
    from dagster._core.definitions.metadata.external_metadata import metadata_map_from_external
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zarrfeed.training.pipes import result_metadata

    cfg = config(built, tmp_path, steps=3)
    cfg.data.eval_batches = 4  # 16 patches: enough for both classes of some findings
    # the sample store holds one valid_ scan: held out alone, it has one class per finding
    cfg.data.holdout = "none"
    result = train(cfg)
    auc, pos, neg = (result.per_class[k] for k in ("auroc", "positives", "negatives"))
    assert len(auc) == 18
    for finding, value in auc.items():  # undefined exactly where eval holds one class
        assert (value is None) == (pos[finding] == 0 or neg[finding] == 0), finding
        assert value is None or 0 <= value <= 1
    defined = [v for v in auc.values() if v is not None]
    assert defined and result.eval_after["auroc_mean"] == pytest.approx(np.mean(defined), 1e-5)
    run = Path(result.checkpoint).parent
    metrics = json.loads((run / "metrics.json").read_text())  # strict JSON: null, never NaN
    assert metrics["per_class"]["auroc"] == auc and "auroc_mean" in metrics["eval_before"]

    events = EventAccumulator(str(run))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(result.history["loss"])
    assert {"train/data_time_ms", "train/step_time_ms", "train/samples_per_s"} <= set(tags)
    assert [e.step for e in events.Scalars("eval/auroc_mean")] == [0, 3]
    assert sum(t.startswith("eval_auroc/") for t in tags) == len(defined)

    # what the model asset shows: the task's own settings, the checkpoint, a per-finding
    # AUROC table, the loss as numbers, and trained_on as a table (Dagster accepts them all)
    meta = metadata_map_from_external(result_metadata(result, {"data_versions": {"ct": "v1"}}))
    assert meta["checkpoint"].value == result.checkpoint
    settings = {r.data["setting"]: r.data["value"] for r in meta["settings"].records}
    assert settings["train.steps"] == "3" and settings["data.window"] == "lung"
    assert not any(k in settings for k in ("data.clip_len", "data.defects", "out"))
    table = meta["auroc_per_finding"]
    assert [c.name for c in table.schema.columns][:3] == ["finding", "auroc_before", "auroc"]
    assert {r.data["finding"]: r.data["auroc"] for r in table.records} == {
        k: None if v is None else round(v, 4) for k, v in auc.items()
    }
    assert meta["eval_auroc_mean"].value == pytest.approx(result.eval_after["auroc_mean"], 1e-3)
    assert [r.data["step"] for r in meta["loss_by_step"].records] == [1, 2, 3]
    assert isinstance(meta["final_loss_mean"].value, float)
    trained_on = {r.data["what"]: r.data["value"] for r in meta["trained_on"].records}
    assert trained_on["data version of ct"] == "v1" and int(trained_on["partitions"]) > 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_run_saves_the_current_step(built, tmp_path, signum):
    store, _ = built
    out = tmp_path / "models"
    command = [
        sys.executable, "-m", "zarrfeed.cli", "train", "--store", store.url, "--out", str(out),
        "--steps", "1000", "--amp", "off", "--set", "data.eval_batches=1",
        "--set", "train.checkpoint_every=500", "--set", "train.log_every=1",
        # a loader worker under Ctrl-C (the group's signal reaches it); none for SIGTERM
        "--workers", "1" if signum == signal.SIGINT else "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        for line in proc.stdout:
            if "step 3 |" in line:
                break
        assert proc.poll() is None, proc.stderr.read()[-3000:]  # still training at step 3
        # SIGINT as a terminal sends it, to the whole group (loader workers too)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    (message,) = err.strip().splitlines()  # one line, no traceback
    assert message.startswith(f"zarrfeed train: stopped by {name} at step ")
    step = int(message.split(" at step ")[1].split("/")[0])
    assert 3 <= step < 500  # not the last checkpoint_every step
    run = out / "ct_classifier"
    saved = torch.load(run / "last.pt", weights_only=True)
    metrics = json.loads((run / "metrics.json").read_text())
    assert saved["step"] == metrics["step"] == len(metrics["history"]["loss"]) == step
    assert metrics["stopped_by"] == name and (run / "loss.png").exists()
    assert list(run.glob("events.out.tfevents.*"))


def test_train_flags_come_from_the_config_and_errors_name_file_line_and_keys(tmp_path, capsys):
    assert main(["train", "--list-tasks"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [s.split()[0] for s in listed] == [
        "ct_classifier", "sparse_autoencoder", "spike_deblur", "defect_segmentation",
    ]  # fmt: skip
    assert "CT-RATE multi-label classification (18 findings)" in listed[0]

    cfg = tmp_path / "run.yaml"
    cfg.write_text("task: ct_classifier\ntrain:\n  steps: 7\n  lr: 0.01\n")
    argv = ["train", "--config", str(cfg), "--batch-size", "8", "--amp", "bf16", "--seed", "3",
            "--workers", "2", "--run-name", "b8", "--set", "train.weight_decay=0.1",
            "--resume-anyway", "--print-config"]  # fmt: skip
    assert main(argv) == 0
    printed = TrainConfig.model_validate(__import__("yaml").safe_load(capsys.readouterr().out))
    t = printed.train
    assert (t.batch_size, t.amp, t.weight_decay, t.steps, t.lr) == (8, "bf16", 0.1, 7, 0.01)
    assert (printed.seed, printed.run_name, printed.dataloader.workers) == (3, "b8", "2")
    assert printed.resume_anyway

    broken = tmp_path / "broken.yaml"
    broken.write_text("task: ct_classifier\ntrain:\n  steps: 3\n  batch_size: [1\n")
    with pytest.raises(ConfigError) as err:
        TrainConfig.load(broken)
    assert str(err.value).startswith(f"{broken}: line ") and "unicode string" not in str(err.value)
    assert "starts at line 4" in str(err.value)

    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("task: ct_classifier\ntrain:\n  steps: 3\n  stepz: 4\n")
    assert main(["train", "--config", str(unknown)]) == 2
    message = capsys.readouterr().err
    assert f"{unknown}: line 4: train.stepz: unknown key (valid keys: steps, batch_size" in message
    assert main(["train", "--config", str(cfg), "--set", "train.warmup=5"]) == 2
    assert "train.warmup: unknown key (valid keys: steps" in capsys.readouterr().err
