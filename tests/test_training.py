"""The trainer on a store built by the real assets: every task learns, resume is exact,
checkpoints load with weights_only=True, and torchrun trains with DDP on gloo."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zarrfeed.cli import main
from zarrfeed.errors import ConfigError
from zarrfeed.families.ct.datasets import CTPatchDataset
from zarrfeed.training.checkpoints import RunFolderHeld
from zarrfeed.training.config import TrainConfig
from zarrfeed.training.data.device import DevicePatches
from zarrfeed.training.data.sampler import BlockSampler, ResumableSampler
from zarrfeed.training.runtime import amp_policy, make_optimizer
from zarrfeed.training.trainer import train

ROOT = Path(__file__).resolve().parents[1]

# Eval loss after / before, on fixed batches scored before and after a short run.
BOUNDS = {
    "ct_classifier": 0.5,
    "sparse_autoencoder": 0.5,
    "spike_deblur": 0.5,
    "defect_segmentation": 0.85,
}


def config(built, tmp_path, task: str, **train_opts) -> TrainConfig:
    store, _ = built
    width = 8 if task == "sparse_autoencoder" else 16  # 3-D grids: keep the CPU run short
    return TrainConfig.model_validate(
        {
            "task": task,
            "store": store.url,
            "out": str(tmp_path / "models"),
            "dataloader": {"workers": 1},
            "train": {"steps": 30, "log_every": 10, "width": width, **train_opts},
        }
    )


@pytest.mark.slow
@pytest.mark.parametrize("task", sorted(BOUNDS))
def test_every_task_learns(built, tmp_path, task):
    lines: list[str] = []
    result = train(config(built, tmp_path, task), log=lines.append)
    before, after = result.eval_before["loss"], result.eval_after["loss"]
    assert after <= BOUNDS[task] * before, (task, before, after)
    assert result.step == 30 and len(result.history["loss"]) == 30
    assert 0 < result.data_wait_share < 1 and result.samples_per_s > 0
    # seed 001's log line, and the loader block with its reasons
    assert any(f"[{task}] step 30 | loss=" in s and "data_time=" in s for s in lines)
    assert any("data_wait=" in s for s in lines) and any("num_workers=1" in s for s in lines)
    run = tmp_path / "models" / task
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["eval_after"] == result.eval_after and metrics["data"]["partitions"] > 0
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_repeats_the_uninterrupted_loss_curve(built, tmp_path):
    # fp32: CPUs with native bf16 (AVX512-BF16) need not repeat bf16 kernels bit for bit
    opts = {"steps": 12, "checkpoint_every": 6, "amp": "off"}
    whole = train(config(built, tmp_path / "a", "ct_classifier", **opts))
    cut = config(built, tmp_path / "b", "ct_classifier", **{**opts, "steps": 6})
    first = train(cut)
    assert first.history["loss"] == whole.history["loss"][:6]
    # no pickled objects: the checkpoint loads with weights_only=True
    saved = torch.load(first.checkpoint, weights_only=True)
    assert saved["step"] == 6 and saved["position"] == 6 and "optimizer" in saved
    cut.train.steps = 12
    resumed = train(cut)
    assert resumed.resumed_from == 6 and resumed.step == 12
    assert resumed.history["loss"] == whole.history["loss"]
    assert resumed.eval_after == whole.eval_after


def test_beyond_ram_training_uses_the_block_sampler_and_resumes_exactly(built, tmp_path):
    def cfg(where: str, steps: int):
        c = config(built, tmp_path / where, "ct_classifier", steps=steps, checkpoint_every=3)
        c.data.cache_gb = 0.012  # 12 MB for 24 MB of windows: out of core
        c.train.amp = "off"  # CPU bf16 kernels need not repeat bit for bit
        return c

    lines: list[str] = []
    whole = train(cfg("a", 6), log=lines.append)
    assert any("sampler: block shuffle" in s and "decoded >" in s for s in lines)
    cut = cfg("b", 3)
    assert train(cut).history["loss"] == whole.history["loss"][:3]
    cut.train.steps = 6
    resumed = train(cut)
    assert resumed.resumed_from == 3 and resumed.history["loss"] == whole.history["loss"]


def test_a_checkpoint_of_another_epoch_order_is_another_run(built, tmp_path):
    """The block shuffle's blocks follow the memory of the machine: a checkpoint records
    them.  Blocks this machine cannot take up make the checkpoint another run (a new folder,
    the old one untouched) instead of a resumed epoch that repeats some samples and skips
    others; a checkpoint written before orders were recorded still resumes."""
    c = config(built, tmp_path, "ct_classifier", steps=3, checkpoint_every=3, amp="off")
    c.data.cache_gb = 0.012  # out of core: a block shuffle
    train(c)
    path = c.run_dir / "last.pt"
    saved = torch.load(path, weights_only=True)
    assert saved["sample_order"]["kind"] == "block"
    saved["sample_order"]["block_bytes"] *= 4  # a machine with a larger cache wrote it
    torch.save(saved, path)
    c.train.steps = 6
    lines: list[str] = []
    other = train(c, log=lines.append)
    assert other.resumed_from == 0
    assert Path(other.checkpoint).parent.name == f"{c.run_name or 'run'}-2"
    assert any("not resuming" in s and "sample order" in s for s in lines), lines
    del saved["sample_order"]
    torch.save(saved, path)
    assert train(c).resumed_from == 3


def test_device_cache_cuts_the_loader_batches_and_trains_alike(built, tmp_path):
    store, _ = built
    ds = CTPatchDataset(store, window="lung", cache_gb=0.25)
    held = DevicePatches(ds, torch.device("cpu"))
    assert held.nbytes() == ds.nbytes()
    order = np.random.default_rng(0).permutation(len(ds))[:6]
    want, got = ds.collate(ds.__getitems__(list(order))), held.batch(order)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]) or torch.allclose(got[k], want[k], equal_nan=True), k
    lines: list[str] = []
    on = config(built, tmp_path / "on", "ct_classifier", steps=6, amp="off")  # fp32: see above
    on.dataloader.device_cache = "on"
    loaded = train(config(built, tmp_path / "off", "ct_classifier", steps=6, amp="off"))
    cut = train(on, log=lines.append)
    assert any("device cache: volumes held on cpu" in s for s in lines)
    assert any("num_workers=0" in s for s in lines)
    np.testing.assert_allclose(cut.history["loss"], loaded.history["loss"], rtol=1e-5)
    assert cut.history["samples"] == loaded.history["samples"]


def test_gradient_accumulation_and_checkpointing_run(built, tmp_path):
    opts = {"steps": 4, "accumulate": 3, "batch_size": 4}  # not the task's own batch of 8
    cfg = config(built, tmp_path, "defect_segmentation", **opts)
    cfg.train.grad_checkpointing = True
    result = train(cfg)
    assert result.step == 4 and result.history["samples"] == [12] * 4  # 3 batches of 4 per step


def test_a_held_run_folder_refuses_another_training_and_dead_writers_files_go(built, tmp_path):
    """A process holding the run folder's lock (as a training does for its life) refuses a
    second training at once, by the holder's pid and host, before it writes anything; once
    the holder is killed the kernel frees the folder, and the run that starts removes the
    checkpoint file a dead writer left and keeps a live writer's."""
    cfg = config(built, tmp_path, "spike_deblur", steps=2)
    run = cfg.run_dir
    hold_it = "import sys, time; from zarrfeed.processes import hold; h = hold(sys.argv[1]); "
    holder = subprocess.Popen(
        [sys.executable, "-c", hold_it + "print('held', flush=True); time.sleep(600)",
         str(run / "train.lock")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    live = subprocess.Popen(["sleep", "600"])
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderHeld) as refused:
            train(cfg, log=None)
        message = str(refused.value)
        assert str(run) in message and f"pid {holder.pid} on {socket.gethostname()}" in message
        assert sorted(p.name for p in run.iterdir()) == ["train.lock"]  # no events, no checkpoint
        ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True)  # fmt: skip
        dead_tmp, live_tmp = run / f"last.{int(ended.stdout)}.tmp", run / f"last.{live.pid}.tmp"
        dead_tmp.write_bytes(b"half a checkpoint")
        live_tmp.write_bytes(b"a checkpoint being written")
        holder.kill()  # kill -9: no clean-up, the kernel drops its lock
        holder.wait()
        lines: list[str] = []
        assert train(cfg, log=lines.append).step == 2
        assert not dead_tmp.exists() and live_tmp.exists() and (run / "last.pt").exists()
        assert any(f"removed {dead_tmp}: its writer is dead" in line for line in lines)
    finally:
        for process in (holder, live):
            process.kill()
            process.wait()


def test_sampler_shards_cover_each_epoch_and_resume_mid_epoch():
    a, b = ResumableSampler(10, 0, 2, seed=3), ResumableSampler(10, 1, 2, seed=3)
    shards = list(a), list(b)
    assert len(shards[0]) == len(shards[1]) == 5 and set(shards[0]) | set(shards[1]) == set(
        range(10)
    )
    a.set_epoch(1)
    second = list(a)
    assert second != shards[0]
    a.set_epoch(1, start=2)
    assert list(a) == second[2:] and len(a) == 3


class TinyPartitions:
    """What BlockSampler reads of a dataset: two samples per partition, 1 kB each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cache = SimpleNamespace(capacity_bytes=4096)

    def sample_items(self) -> list[int]:
        return [i // 2 for i in range(self.size)]

    def partition_bytes(self) -> list[int]:
        return [1024] * ((self.size + 1) // 2)


def samplers(kind: str, size: int, world: int) -> list[ResumableSampler | BlockSampler]:
    if kind == "block":
        return [
            BlockSampler(TinyPartitions(size), r, world, 7, prefetch=False) for r in range(world)
        ]
    return [ResumableSampler(size, r, world, seed=7) for r in range(world)]


@pytest.mark.parametrize("kind", ["shuffle", "block"])
@pytest.mark.parametrize(
    ("size", "world"), [(1, 8), (2, 8), (3, 8), (5, 8), (9, 8), (17, 8), (1, 3), (7, 2)]
)
def test_every_rank_gets_as_many_samples_whatever_the_world(kind, size, world):
    """A small split on more ranks than twice its samples: padding repeats the order as
    DistributedSampler does, else ranks get different counts and DDP waits forever."""
    ranks = samplers(kind, size, world)
    for sampler in ranks:
        sampler.set_epoch(3)
    shards = [list(s) for s in ranks]
    per_rank = -(-size // world)
    assert [len(s) for s in shards] == [len(s) for s in ranks] == [per_rank] * world
    assert set().union(*shards) == set(range(size))
    counts = np.bincount([i for s in shards for i in s], minlength=size)
    assert counts.max() - counts.min() <= 1  # repeated as evenly as the order allows
    for sampler, shard in zip(ranks, shards, strict=True):  # resume mid-epoch, every rank
        for start in range(per_rank + 1):
            sampler.set_epoch(3, start)
            assert len(sampler) == per_rank - start and list(sampler) == shard[start:]


def test_a_task_s_own_defaults_lie_under_whatever_is_given():
    """defect_segmentation learns nothing in the sections' 40 steps of 4: its defaults hold in
    the CLI, in YAML and in the model asset's run config (an automated retrain uses them)."""
    from graph import model_assets as every_model

    model_assets = every_model()
    defect = TrainConfig.model_validate({"task": "defect_segmentation"}).train
    assert (defect.steps, defect.batch_size, defect.lr) == (100, 8, 0.003)
    given = TrainConfig.model_validate({"task": "defect_segmentation", "train": {"steps": 5}})
    assert (given.train.steps, given.train.batch_size) == (5, 8)
    ct_steps = TrainConfig.model_validate({"task": "ct_classifier"}).train.steps
    assert ct_steps == TrainConfig.model_validate({}).train.steps == 40
    steps = {
        a.key.to_user_string(): a.op.config_schema.config_type.fields["train"]
        .config_type.fields["steps"]
        .default_value
        for a in model_assets
    }
    assert steps["defect_segmentation_model"] == 100 and steps["ct_classifier_model"] == 40
    versions = {a.key.to_user_string(): a.code_versions_by_key[a.key] for a in model_assets}
    assert versions["defect_segmentation_model"] != versions["ct_classifier_model"]  # its recipe


def test_amp_policy():
    cpu = torch.device("cpu")
    assert amp_policy("off", cpu) == (None, False)
    assert amp_policy("bf16", cpu) == (torch.bfloat16, False)
    assert amp_policy("auto", cpu) == (None, False)  # fp32: bf16 autocast NaN'd on the CPU
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        amp_policy("fp16", cpu)


def test_a_scaled_step_reads_nothing_back_with_the_optimizer_cuda_gets(monkeypatch):
    """fp16 needs a GradScaler; with the fused AdamW the trainer makes on CUDA, its inf check
    and unscale stay on the device (run here with the same kernels on the CPU): no value is
    read back to the host in the step, where any other optimizer reads the inf flag."""
    cpu = torch.device("cpu")
    assert make_optimizer(torch.nn.Linear(2, 2), 1e-3, 0.0, cpu).param_groups[0]["fused"] is None

    def run(fused: bool, grads: float) -> tuple[torch.Tensor, int]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        reads = []
        item = torch.Tensor.item
        monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or item(t))
        for _ in range(2):
            scaler.scale(model(torch.ones(3, 4)).sum() * grads).backward()
            scaler.unscale_(optimizer)  # the trainer's gradient clipping does this first
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        monkeypatch.setattr(torch.Tensor, "item", item)
        return model.weight.detach().clone(), len(reads)

    fused, fused_reads = run(True, 1.0)
    plain, plain_reads = run(False, 1.0)
    assert fused_reads == 0 and plain_reads >= 2  # at least one per step without the fused kernel
    torch.testing.assert_close(fused, plain)  # the same update
    skipped, _ = run(True, float("inf"))  # an overflow: the step is skipped on the device
    torch.manual_seed(0)
    assert torch.equal(skipped, torch.nn.Linear(4, 2).weight.detach())


def test_bf16_autocast_on_cpu_trains(built, tmp_path):
    result = train(config(built, tmp_path, "spike_deblur", steps=3, amp="bf16"))
    assert result.step == 3 and all(torch.isfinite(torch.tensor(result.history["loss"])))


def test_yaml_config_and_cli(built, tmp_path, capsys):
    store, _ = built
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert TrainConfig.load(path).task == path.stem  # the shipped examples stay valid
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: ct_classifier\ntrain:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line 3: train.stepz: unknown key"):
        TrainConfig.load(bad)
    good = tmp_path / "spike.yaml"
    good.write_text(
        f"task: spike_deblur\nstore: {store.url}\nout: {tmp_path / 'm'}\n"
        "dataloader:\n  workers: 1\ntrain:\n  steps: 2\n"
    )
    assert main(["train", "--config", str(good), "--print-config"]) == 0
    assert "voxels: stored" in capsys.readouterr().out
    assert main(["train", "--config", str(good)]) == 0
    assert (tmp_path / "m" / "spike_deblur" / "last.pt").exists()
    assert main(["train", "--config", str(bad)]) == 2  # one line, exit code 2
    assert "train.stepz" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("cache_gb", [1.0, 0.012], ids=["in-RAM", "out-of-core"])
def test_torchrun_ddp_two_processes_on_gloo(built, tmp_path, cache_gb):
    store, _ = built
    cfg = tmp_path / "ddp.yaml"
    cfg.write_text(
        f"task: ct_classifier\nstore: {store.url}\nout: {tmp_path / 'out'}\n"
        f"data:\n  cache_gb: {cache_gb}\n"
        "dataloader:\n  workers: 1\ntrain:\n  steps: 6\n  log_every: 3\n"
    )
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
        "-m", "zarrfeed.cli", "train", "--config", str(cfg),
    ]  # fmt: skip
    out = subprocess.run(args, capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-4000:]
    log = out.stdout
    assert "world=2" in log and "local world size: 2" in log
    assert ("block shuffle" in log) == (cache_gb < 0.1)  # both ranks share one arena
    assert log.count("step 6 | loss=") == 1  # only rank 0 logs
    assert log.count("checkpoint ") == 1  # and writes
    saved = torch.load(tmp_path / "out" / "ct_classifier" / "last.pt", weights_only=True)
    assert saved["step"] == 6
    assert saved["position"] == 6  # batches of this rank's shard consumed in the epoch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("task", sorted(BOUNDS))
def test_cuda_amp_pinned_training(built, tmp_path, task):
    lines: list[str] = []
    cfg = config(built, tmp_path, task, device="cuda")
    cfg.dataloader.device_cache = "auto"
    result = train(cfg, log=lines.append)
    if task == "ct_classifier":  # the sample volumes fit the GPU: cut there
        assert any("device cache: volumes held on cuda" in s for s in lines)
    else:
        assert any("pinned memory: on" in s for s in lines)
    assert result.peak_memory_mb > 0
    assert result.eval_after["loss"] < result.eval_before["loss"]
