"""Issue 37: the ``learned`` check and the demo's summary read each task's headline metric
(held-out per-finding AUROC for the CT classifier, never its accuracy over 18 rare findings),
and the summary reads at 80 columns."""

import io
import re

import numpy as np
import pytest
from dagster._core.definitions.metadata import MetadataValue

from zarrfeed.commands.demo import Row, _score, print_summary
from zarrfeed.families.ct.datasets import CTPatchDataset, held_out
from zarrfeed.families.ct.tasks import CTClassification
from zarrfeed.training.data.protocols import HoldsOut
from zarrfeed.training.pipes import learned_check
from zarrfeed.training.result import TrainResult
from zarrfeed.training.tasks import TASK_TYPES, Task


def result(task: str, before: dict, after: dict) -> TrainResult:
    return TrainResult(task=task, step=40, history={"loss": [1.0, 0.5]}, eval_before=before,
                       eval_after=after, samples_per_s=1.0, data_wait_share=0.0,
                       checkpoint="/x/last.pt", data={}, config={})  # fmt: skip


def test_every_task_declares_a_headline_metric_and_its_direction():
    for task in TASK_TYPES.values():
        assert task.metric and task.label and isinstance(task.higher_is_better, bool), task.name
    assert CTClassification.metric == "auroc_mean" and CTClassification.chance == 0.5
    assert CTClassification.evaluates_on == "held_out"


def test_a_classifier_whose_accuracy_rises_but_auroc_stays_at_chance_fails_learned():
    before = {"loss": 0.69, "accuracy": 0.43, "auroc_mean": 0.46}
    after = {"loss": 0.30, "accuracy": 0.93, "auroc_mean": 0.40}
    check = learned_check(result("ct_classifier", before, after))
    assert check["passed"] is False
    meta = check["metadata"]
    assert meta["auroc_mean_after"] == 0.4 and "accuracy_after" not in meta
    assert check["metadata"]["verdict"] == "did not learn: AUROC 0.40 ≤ 0.5 (chance)"
    # above chance but no better than before training: not learned either
    assert not learned_check(result("ct_classifier", {**before, "auroc_mean": 0.7},
                                    {**after, "auroc_mean": 0.6}))["passed"]  # fmt: skip
    # undefined (no finding with both classes among the held-out scans): not learned
    check = learned_check(result("ct_classifier", before, {**after, "auroc_mean": None}))
    assert not check["passed"] and "undefined" in check["metadata"]["verdict"]
    good = learned_check(result("ct_classifier", before, {**after, "auroc_mean": 0.81}))
    assert good["passed"] and good["metadata"]["verdict"] == "AUROC 0.46 -> 0.81"


def test_a_lower_is_better_metric_learns_when_it_falls():
    class Denoise(Task):
        name, metric, label, higher_is_better = "denoise", "mse", "MSE", False

    assert Denoise.learned({"loss": 1, "mse": 0.2}, {"loss": 0.5, "mse": 0.1})[0]
    assert not Denoise.learned({"loss": 1, "mse": 0.1}, {"loss": 0.5, "mse": 0.2})[0]
    assert not Denoise.learned({"loss": 1, "mse": 0.2}, {"loss": 1.5, "mse": 0.1})[0]  # loss rose


def test_the_summary_shows_the_classifiers_auroc_not_its_accuracy():
    def metadata(**values):
        return {f"eval_{k}": MetadataValue.float(v) for k, v in values.items()}

    fell = metadata(loss=0.3, loss_before=0.69, accuracy=0.93, accuracy_before=0.43,
                    auroc_mean=0.40, auroc_mean_before=0.46)  # fmt: skip
    assert _score("ct_classifier_model", fell) == "did not learn: AUROC 0.40 ≤ 0.5 (chance)"
    rose = {**fell, **metadata(auroc_mean=0.81)}
    assert _score("ct_classifier_model", rose) == "AUROC 0.46 -> 0.81"
    iou = metadata(loss=0.3, loss_before=0.7, iou=0.39, iou_before=0.0)
    assert _score("defect_segmentation_model", iou) == "IoU 0.00 -> 0.39"
    assert _score("ct_windows", fell) == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


NAMES = [
    *("ct-sources_dicom_patient_1_CT", "train_12_a_2", "valid_3_a_1", "twin_scan"),
    *("ct_classifier_model", "sparse_autoencoder_model", "defect_segmentation_model"),
]


@pytest.mark.parametrize("columns", [80, 120])
def test_the_demo_summary_reads_in_an_80_column_terminal(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    rows = [Row("ct", NAMES[0], True, 9, "12/12", 12_345_678, 12.3),
            Row("ct", NAMES[1], True, 9, "12/12", 2_345_678, 4.1),
            Row("ct", NAMES[2], True, 9, "12/12", 2_345_678, 4.0),
            Row("ct", NAMES[3], False, 0, "0/0", None, 3.4, cause="ct_hu: 'twin scan.nii.gz'"),
            Row("datasets", "-", True, 3, "3/3", 1234, 5.0)]  # fmt: skip
    results = ["did not learn: AUROC 0.48 ≤ 0.5 (chance)", "IoU 0.01 -> 0.39", "IoU 0.00 -> 0.2"]
    rows += [Row("training", n, True, 1, "1/1", None, 41.5, result=r)
             for n, r in zip(NAMES[4:], results, strict=True)]  # fmt: skip
    out = Terminal()
    print_summary(rows, out)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue()).splitlines()
    assert max(map(len, lines)) <= columns, "\n".join(lines)
    for name in [*NAMES, *results, "training", "datasets", "stored"]:
        assert any(name in line for line in lines), (name, "\n".join(lines))  # whole, one line
    assert "…" not in out.getvalue()  # nothing cut short either: they fit
    [line] = [ln for ln in lines if ln.startswith("ct_classifier_model")]
    assert "AUROC 0.48" in line
    assert lines[-1] == "ct twin_scan failed: ct_hu: 'twin scan.nii.gz'"


def test_held_out_keys_are_ct_rates_valid_scans_else_a_fixed_quarter():
    keys = ["train_1_a_1", "train_1_a_2", "valid_1_a_1", "scaled_1"]
    assert held_out(keys).tolist() == [False, False, True, False]
    names = [f"scan_{i}" for i in range(40)]
    mask = held_out(names)
    assert 0 < mask.sum() < 40 and mask.tolist() == held_out(names).tolist()
    # a key keeps its side when other keys come
    assert held_out([*names, "scan_99"])[:40].tolist() == mask.tolist()
    assert held_out(["a", "b"]).sum() == 1 and held_out(["only"]).sum() == 0
    assert held_out([f"valid_{i}" for i in range(8)]).sum() in range(1, 8)  # all valid_: hashed


def test_the_classifier_never_scores_a_scan_it_trains_on(built):
    store, _ = built
    train, evaluate, every = (CTPatchDataset(store, split=s) for s in ("train", "eval", None))
    keys = np.array(every.keys)
    seen, scored = set(keys[train.items]), set(keys[evaluate.items])
    assert scored == set(every.eval_keys) and all(k.startswith("valid_") for k in scored)
    assert isinstance(every, HoldsOut)  # what the trainer's evaluation line reads
    assert not seen & scored and seen | scored == set(keys[every.items])
    assert len(train) + len(evaluate) == len(every)
    np.testing.assert_array_equal(  # the patches are those of the whole index
        np.concatenate([train.origins, evaluate.origins]).tolist().sort(),
        every.origins.tolist().sort(),
    )


def test_the_demos_valid_scans_hold_both_classes_of_every_rendered_finding():
    from zarrfeed.commands.sample_data import DEMO_SCANS
    from zarrfeed.samples import RENDERED, ct_scan_specs

    specs = ct_scan_specs(DEMO_SCANS, np.random.default_rng([0, 1]))
    valid = [s for s in specs if s.split == "valid"]
    assert len(valid) >= 2 and held_out([s.name for s in specs]).sum() == len(valid)
    for finding in RENDERED:
        assert {finding in s.findings for s in valid} == {True, False}, finding
