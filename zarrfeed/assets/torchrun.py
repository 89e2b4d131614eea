"""Training as an external process: ``torchrun`` launched through Dagster Pipes.

The step writes the resolved training config next to the checkpoints, runs
``torchrun --nproc-per-node=N -m zarrfeed.training.pipes --config <run>/train.yaml`` with
:class:`dagster.PipesSubprocessClient`, and takes rank 0's reports (logs, materialisation,
check) as its own.  torchrun keeps each rank's output and error file under
``<run>/torchrun/<run id>/``; when training fails or a rank is killed, the step fails with
the error and the last lines the ranks wrote.  On Kubernetes, ``PipesK8sClient`` runs the
same command in a pod (deploy/README.md).
"""

import json
import shlex
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from zarrfeed.assets.messages import WholeLineMessageReader
from zarrfeed.training.config import TrainConfig

TAIL_LINES = 15


class TorchrunResource(dg.ConfigurableResource):
    """How model assets launch training on this machine (the training component's
    ``nproc_per_node``)."""

    nproc_per_node: int = Field(
        default=1, description="training processes: one per GPU, or a few CPU ranks (gloo)"
    )

    def command(self, config_path: Path, log_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.nproc_per_node}", f"--log-dir={log_dir}",
            "--redirects=3", "--tee=3",  # each rank's output to a file and to the step's log
            "-m", "zarrfeed.training.pipes", "--config", str(config_path),
        ]  # fmt: skip

    def train(
        self, context: dg.AssetExecutionContext, config: TrainConfig, extras: Mapping[str, Any]
    ) -> dg.PipesClientCompletedInvocation:
        """Run ``config`` under torchrun; ``extras`` reach rank 0 through Pipes."""
        run_dir = config.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        config_path = run_dir / "train.yaml"
        config_path.write_text(config.to_yaml())
        log_dir = run_dir / "torchrun" / context.run.run_id
        command = self.command(config_path, log_dir)
        context.log.info(
            f"training through Pipes: {shlex.join(command)}\n"
            f"outside Dagster: torchrun --nproc-per-node={self.nproc_per_node} "
            f"-m zarrfeed.training.pipes --config {config_path}"
        )
        try:
            with warnings.catch_warnings():
                # dagster 1.13's own Pipes client warns about its internals on every launch
                # (it reads context.run_id; PipesMessageReader.expected_writer_count is in
                # preview): nothing a user of `dg dev` or `zarrfeed demo` can act on.
                warnings.filterwarnings("ignore", ".*run_id is deprecated", DeprecationWarning)
                warnings.filterwarnings("ignore", ".*expected_writer_count", dg.PreviewWarning)
                return dg.PipesSubprocessClient(message_reader=WholeLineMessageReader()).run(
                    context=context, command=command, extras=dict(extras)
                )
        except Exception as exc:  # the client's error names only the exit code
            raise dg.Failure(
                description=f"training failed: {exc}\n{last_lines(log_dir)}",
                metadata={
                    "command": shlex.join(command),
                    "rank_logs": dg.MetadataValue.path(str(log_dir)),
                },
            ) from exc


def last_lines(log_dir: Path) -> str:
    """The error a rank raised (torchrun's error file), else the last lines every rank
    wrote: a killed rank leaves no error, only where it stopped."""
    errors = sorted(log_dir.glob("*/attempt_*/*/error.json"))
    if errors:
        message = json.loads(errors[0].read_text())["message"]
        trace = message.get("extraInfo", {}).get("py_callstack", "")
        lines = [*trace.strip().splitlines()[-TAIL_LINES:]] or [message.get("message", "")]
        rank = errors[0].parent.name
        return f"local rank {rank} raised:\n" + "\n".join(lines)
    parts = []
    for rank_dir in sorted(log_dir.glob("*/attempt_*/*")):
        for stream in ("stdout", "stderr"):
            path = rank_dir / f"{stream}.log"
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            tail = "\n".join(f"  {line}" for line in lines[-TAIL_LINES:]) or "  (nothing)"
            parts.append(f"local rank {rank_dir.name}, last lines of {stream}:\n{tail}")
    if not parts:
        return f"no rank started (no output under {log_dir}); see the step's stderr"
    return (
        "no rank raised an error (one was killed or crashed: torchrun's summary at the end of "
        "the step's stderr names the signal)\n" + "\n".join(parts)
    )
