"""``zarrfeed demo``: the whole graph on the sample data, in a persistent Dagster instance.

Runs the real build jobs partition by partition into ``DAGSTER_HOME`` (default
``.dagster_home`` in the working folder), each launched as the UI launches it
(:mod:`zarrfeed.commands.launcher`), so ``dg dev -w workspace.yaml`` started afterwards with
the same ``DAGSTER_HOME`` shows every run under its job, re-executable as its own, and every
partition and check.

The terminal shows one progress display and a summary; Dagster's own logs (and anything the
runs print) go to a log file the summary names, since a failure's root cause is one line in
the summary and its stack trace belongs in the log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from zarrfeed import defaults
from zarrfeed.commands.instance import hold_home
from zarrfeed.commands.launcher import REPO, Finished, Launcher, code_location
from zarrfeed.errors import ConfigError, root_cause

# Run monitoring: a run whose process died with no one to report it (a killed `zarrfeed demo`,
# a lost `dagster dev`) would stay STARTED and hold one of the {runs} run slots forever; the
# daemon of `dagster dev` fails it after max_runtime_seconds, frees the pool slots its steps
# held, and run_retries retries it once.  deploy/dagster.yaml is the production counterpart.
DAGSTER_YAML = """\
telemetry:
  enabled: false
freshness:
  enabled: true
concurrency:
  runs:
    max_concurrent_runs: {runs}
run_coordinator:  # a queued run starts within a second of its slot freeing (default: 5 s)
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    dequeue_interval_seconds: 1
run_monitoring:
  enabled: true
  start_timeout_seconds: 180
  cancel_timeout_seconds: 180
  max_runtime_seconds: 1800
  poll_interval_seconds: 30
  free_slots_after_run_end_seconds: 60
run_retries:
  enabled: true
  max_retries: 1
  retry_on_asset_or_op_failure: false
"""
PARTITION_TAG = "dagster/partition"  # the tag that makes a submitted run one partition's

MIB = 1 << 20


@dataclass
class Row:
    """One run of the demo, as the summary shows it."""

    family: str
    partition: str
    ok: bool
    assets: int
    checks: str
    stored_bytes: int | None
    seconds: float
    cause: str = ""  # the root cause of a failure, one line
    result: str = ""  # a model's headline metric before -> after, or why it did not learn


Progress = Callable[[str], None]  # called with what starts next
Display = Callable[[int], contextlib.AbstractContextManager[Progress]]  # total runs -> progress


def prepare_home(home: Path, runs: int) -> None:
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML.format(runs=runs))


def use_home(home: Path, **env: str) -> None:
    """Point Dagster at ``home`` and the resources at ``env`` (``ZARRFEED_*``, read when a
    run starts)."""
    from zarrfeed.processes import usable_cpus

    os.environ.update({"DAGSTER_HOME": str(home.resolve()), **env})
    prepare_home(home, usable_cpus())


def thread_share(at_once: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``at_once`` runs side by side: each its share of the CPUs.
    Left to itself, a training takes every CPU less its loader workers, two such runs
    oversubscribe the cores, and OpenMP's spinning threads then make a step 2-3x slower; a
    value the user set wins."""
    from zarrfeed.processes import usable_cpus

    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, usable_cpus() // at_once))}


def demo_training(model: Any) -> dict[str, Any]:
    """Run config of the demo's training of ``model`` (an asset key): the task's defaults,
    but a narrower, shorter occupancy autoencoder: 64³ grids at width 16 take ~1 s a step
    on two cores, and at width 8 its IoU reaches 0.86 in 20 steps (0.89 in the default 40,
    at 1.3 s a step on one thread)."""
    from zarrfeed.families.ct.tasks import SparseAutoencoder
    from zarrfeed.training.tasks import model_asset_name

    asset = model_asset_name(SparseAutoencoder.name)
    if model.to_user_string() != asset:
        return {}  # a run's config names only the ops it runs
    return {"ops": {asset: {"config": {"train": {"width": 8, "steps": 20}}}}}


def no_display(total: int | None) -> contextlib.AbstractContextManager[Progress]:
    return contextlib.nullcontext(lambda what: None)


def run_demo(raw: Path, store: str, home: Path, display: Display = no_display) -> list[Row]:
    """Discover, build every partition of every family, the dataset manifests, then train
    every model on them; ``display(total)`` hears of each run before it starts."""
    # Absolute, so the raw items' locations are the ones dg dev's discovery will see too.
    raw, store = raw.resolve(), store if "://" in store else str(Path(store).resolve())
    use_home(
        home,
        ZARRFEED_RAW=str(raw),
        ZARRFEED_STORE=store,
        ZARRFEED_MODELS=os.environ.get("ZARRFEED_MODELS", defaults.MODELS),
        **thread_share(RUNS_AT_ONCE),
    )
    import dagster as dg

    # The webserver loads the code location while this process imports it and discovers.
    with dg.DagsterInstance.get() as instance, code_location(home, instance) as launcher:
        from zarrfeed.components import project_families
        from zarrfeed.definitions import defs
        from zarrfeed.errors import InputError
        from zarrfeed.jobs.build import datasets_build, train
        from zarrfeed.jobs.discovery import discover_into
        from zarrfeed.resources import RawFolderResource, ZarrStoreResource

        raw_resource, zarr_store = RawFolderResource(root=str(raw)), ZarrStoreResource(url=store)
        families = [c.declaration for c in project_families()]
        keys = {f: discover_into(instance, f, raw_resource, zarr_store) for f in families}
        if not any(keys.values()):
            kinds = [f.raw.items for f in families]
            raise InputError(
                raw,
                "raw " + " or ".join([", ".join(kinds[:-1]), kinds[-1]] if kinds[1:] else kinds),
                "none (`zarrfeed sample-data DIR` writes some)",
            )
        builds: list[Request] = [
            (f"{f.name} {key}", f.build_job, f.name, key, {"tags": {PARTITION_TAG: key}})
            for f, family_keys in keys.items()
            for key in family_keys
        ]
        manifests: Request = ("dataset manifests", datasets_build.name, "datasets", "-", {})
        trainings: list[Request] = []
        graph = defs().resolve_asset_graph()
        for key in sorted(dg.AssetSelection.groups("training").resolve(graph)):
            name = key.to_user_string()
            selected = {"asset_selection": [key], "run_config": demo_training(key)}
            trainings.append((f"training {name}", train.name, "training", name, selected))
        rows = []
        with display(len(builds) + 1 + len(trainings)) as progress:
            rows += runs(launcher, progress, builds, at_once=RUNS_AT_ONCE)
            rows += runs(launcher, progress, [manifests])
            rows += runs(launcher, progress, trainings, at_once=RUNS_AT_ONCE)
    return rows


# Partitions build in runs of their own, and models train in theirs, independent of one
# another: with two in flight, one run's process starts (imports and loads the code location,
# ~4 s of CPU) while the other works, and two trainings on one CPU thread each keep two cores
# busy (on two busy cores: 240 s for the four models instead of 414 s one after another).
RUNS_AT_ONCE = 2
Request = tuple[str, str, str, str, dict[str, Any]]  # (shown, job, family, key, its options)


def runs(
    launcher: Launcher, progress: Progress, requests: list[Request], at_once: int = 1
) -> list[Row]:
    """Each request's run launched through ``launcher`` (``submit_job_execution``'s options),
    ``at_once`` in flight, to its end, as summary rows in the order requested; ``progress``
    hears of each as it is submitted.  Their steps run in the run's own process: a process a
    step would cost more than the sample data's steps themselves.  A Ctrl-C terminates the
    runs in flight and stops the whole demo."""

    def submitted() -> Iterator[tuple[str, dict[str, Any]]]:
        for shown, job, _, _, options in requests:
            progress(shown)
            yield job, in_process(options)

    with contextlib.closing(launcher.runs(submitted(), at_once)) as done:
        return [_row(next(done), family, key) for _, _, family, key, _ in requests]


def run(launcher: Launcher, job: str, family: str, key: str, **options: Any) -> Row:
    """One run of ``job`` launched through ``launcher``, to its end, as a summary row (as
    :func:`runs`)."""
    return _row(launcher.run(job, **in_process(options)), family, key)


def in_process(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with run config that runs every step in the run's own process."""
    from zarrfeed.jobs.liveness import IN_PROCESS

    execution = {"execution": {"config": {IN_PROCESS: True}}}
    return {**options, "run_config": {**(options.get("run_config") or {}), **execution}}


def _row(finished: Finished, family: str, key: str) -> Row:
    """The summary row of a finished run from its Dagster events."""
    import dagster as dg

    run, events = finished.run, finished.events

    checks = [
        e.asset_check_evaluation_data
        for e in events
        if e.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION
    ]
    made = [
        e.step_materialization_data.materialization for e in events if e.is_step_materialization
    ]
    stored = None
    for materialization in made:
        value = materialization.metadata.get("stored_MiB")
        if value is not None:
            stored = (stored or 0) + round(value.value * MIB)
    cause, score = "", ""
    for materialization in made:
        score = score or _score(materialization.asset_key.path[-1], materialization.metadata)
    if not run.is_success:
        failure = next((e for e in events if e.is_step_failure), None)
        failed_checks = [c for c in checks if not c.passed]
        if failure is not None:
            cause = f"{failure.step_key}: {root_cause(failure.step_failure_data.error)}"
        elif failed_checks:
            c = failed_checks[0]
            cause = f"check {c.asset_key.to_user_string()}.{c.check_name} failed"
        else:
            cause = f"the run ended {run.status.value}; see the log"
    return Row(
        family,
        key,
        run.is_success,
        len(made),
        f"{sum(c.passed for c in checks)}/{len(checks)}",
        stored,
        finished.seconds,
        cause,
        score,
    )


def _score(asset: str, metadata: dict[str, Any]) -> str:
    """``IoU 0.00 -> 0.39`` for a model asset: its task's headline metric before and after
    training, or ``did not learn: AUROC 0.48 ≤ 0.5 (chance)`` (:meth:`Task.learned`, the
    verdict of its ``learned`` check)."""
    from zarrfeed.training.tasks import TASK_TYPES, model_asset_name

    task = next((t for n, t in TASK_TYPES.items() if model_asset_name(n) == asset), None)
    if task is None or "eval_loss" not in metadata:
        return ""
    before, after = (
        {
            name: value.value
            for name in ("loss", task.metric)
            if (value := metadata.get(f"eval_{name}{suffix}")) is not None
        }
        for suffix in ("_before", "")
    )
    return task.learned(before, after)[1]


def print_summary(rows: list[Row], stream: TextIO) -> None:
    """The summary: one row per run, then what each model learned, each failure's root
    cause in one line below; a name is never split over lines (80 columns hold it)."""
    from zarrfeed.commands.output import human_bytes, print_table

    table = [
        [
            r.family,
            r.partition,
            "yes" if r.ok else "NO",
            r.assets,
            r.checks,
            human_bytes(r.stored_bytes) if r.stored_bytes is not None else "",
            f"{r.seconds:.1f}",
        ]
        for r in rows
    ]
    models = [[r.partition, r.result] for r in rows if r.family == "training" and r.result]
    notes = [f"{r.family} {r.partition} failed: {r.cause}" for r in rows if not r.ok]
    print_table(
        ["family", "partition", "ok", "assets", "checks", "stored", "s"],
        table,
        stream=stream,
        notes=() if models else notes,
        compact=True,
    )
    if models:
        print_table(["model", "trained"], models, stream=stream, notes=notes, compact=True)


@contextlib.contextmanager
def output_to(log_path: Path) -> Iterator[TextIO]:
    """Send everything written to stdout and stderr — Dagster's logs, warnings, worker
    processes — to ``log_path``; yields a stream to the terminal for the progress display."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield terminal
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.close()


@contextlib.contextmanager
def progress_display(total: int | None, stream: TextIO) -> Iterator[Progress]:
    """One progress bar in a terminal (``total`` None: not known yet); one line per run when
    piped."""
    from zarrfeed.commands.output import is_terminal

    if not is_terminal(stream):
        count = 0

        def line(what: str) -> None:
            nonlocal count
            count += 1
            print(f"[{count}/{total or '?'}] {what}", file=stream, flush=True)

        yield line
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.progress import Progress as Bar

    # rich replaces sys.stdout/sys.stderr while a bar is shown, and Dagster opens its console
    # log handler on sys.stderr at the start of every run: with the redirect, every DEBUG
    # line of every run lands on the terminal above the bar instead of in the log file.
    with Bar(
        SpinnerColumn(),
        TextColumn("{task.description:<40}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream),
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    ) as bar:
        task = bar.add_task("starting", total=total)
        started = False

        def step(what: str) -> None:
            nonlocal started
            bar.update(task, description=what, advance=1 if started else 0)
            started = True

        yield step


def ui_command(home: Path, env: dict[str, str]) -> str:
    """The command that opens the UI on the demo's instance, runnable as printed: an absolute
    ``DAGSTER_HOME`` (Dagster refuses a relative one).  Where the demo used folders other than
    the repository's defaults, the command names them and runs outside the repository, since
    the dagster CLI lets the ``.env`` of its working folder override the environment."""
    defaults = dict(
        line.split("=", 1)
        for line in (REPO / ".env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assigns = [f"DAGSTER_HOME={home.resolve()}"]
    for name, value in env.items():
        local = "://" not in value
        same = local and (REPO / defaults.get(name, "")).resolve() == Path(value).resolve()
        if not same:
            assigns.append(f"{name}={Path(value).resolve() if local else value}")
    dg = Path(sys.executable).with_name("dg")
    if len(assigns) == 1 and Path.cwd().resolve() == REPO:
        shown = dg.relative_to(REPO) if dg.is_relative_to(REPO) else dg
        return f"{assigns[0]} {shown} dev -w workspace.yaml"
    where = home.resolve() if len(assigns) > 1 else REPO
    return f"cd {where} && {' '.join(assigns)} {dg} dev -w {REPO / 'workspace.yaml'}"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="build the whole asset graph on the sample data")
    p.add_argument("--raw", default=defaults.RAW, help="raw folder (sample data made if absent)")
    p.add_argument("--store", default=defaults.STORE, help="Zarr store folder or URL")
    p.add_argument(
        "--dagster-home", default=defaults.DAGSTER_HOME, help="persistent Dagster instance"
    )
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from zarrfeed.commands import sample_data

    raw, home = Path(args.raw), Path(args.dagster_home)
    if raw.exists() and not raw.is_dir():
        raise ConfigError(f"--raw {raw} is a file: give the folder of raw data")
    if not raw.exists():
        sample_data.write(raw, bars=False)
    log = home.resolve() / "demo.log"
    t0 = time.perf_counter()
    with hold_home(home, "demo"), output_to(log) as terminal:
        rows = run_demo(raw, args.store, home, lambda total: progress_display(total, terminal))
    print_summary(rows, sys.stdout)
    failed = [r for r in rows if not r.ok]
    env = {
        "ZARRFEED_STORE": args.store,
        "ZARRFEED_RAW": str(raw),
        "ZARRFEED_MODELS": os.environ.get("ZARRFEED_MODELS", defaults.MODELS),
    }
    print(
        f"{len(rows) - len(failed)}/{len(rows)} runs succeeded in {time.perf_counter() - t0:.0f}s;"
        f" store {args.store}; full log {log}\n"
        f"See every run, partition, check and preview in the UI:\n  {ui_command(home, env)}"
    )
    return 1 if failed else 0
