"""``zarrfeed demo``: the whole graph on the sample data, in a persistent Dagster instance.

Runs the real build jobs partition by partition into ``DAGSTER_HOME`` (default
``.dagster_home`` in the working folder), so ``dg dev -w workspace.yaml`` started afterwards
with the same ``DAGSTER_HOME`` shows every run under its job, every partition and check.

The terminal shows one progress display and a summary; Dagster's own logs (and anything the
runs print) go to a log file the summary names, since a failure's root cause is one line in
the summary and its stack trace belongs in the log.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

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
REPO = Path(__file__).resolve().parents[2]
WORKSPACE = REPO / "workspace.yaml"
REPOSITORY = "__repository__"  # the name Dagster gives a module's single Definitions

# Each task's defaults, but a narrower occupancy autoencoder: 64³ grids at width 16 take ~1 s
# a step on two cores, and the demo should stay around two minutes.
DEMO_TRAINING = {"ops": {"sparse_autoencoder_model": {"config": {"train": {"width": 8}}}}}
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
    result: str = ""  # a model's task metric before -> after training


Progress = Callable[[str], None]  # called with what starts next
Display = Callable[[int], contextlib.AbstractContextManager[Progress]]  # total runs -> progress


def prepare_home(home: Path, runs: int) -> None:
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML.format(runs=runs))


def use_home(home: Path, **env: str) -> None:
    """Point Dagster at ``home`` and the resources at ``env`` (``ZARRFEED_*``): before the
    definitions are imported, since resource defaults are read then."""
    os.environ.update({"DAGSTER_HOME": str(home.resolve()), **env})
    from zarrfeed.definitions import usable_cpus

    prepare_home(home, usable_cpus())


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
        ZARRFEED_MODELS=os.environ.get("ZARRFEED_MODELS", "data/models"),
    )
    import dagster as dg

    from zarrfeed.assets import model_assets
    from zarrfeed.definitions import defs
    from zarrfeed.errors import InputError
    from zarrfeed.jobs.discovery import discover_into
    from zarrfeed.resources import RawFolderResource, ZarrStoreResource
    from zarrfeed.store.contract import FAMILIES

    raw_resource, zarr_store = RawFolderResource(root=str(raw)), ZarrStoreResource(url=store)
    rows = []
    with dg.DagsterInstance.get() as instance, workspace_origin(instance) as tags:
        keys = {f: discover_into(instance, f, raw_resource, zarr_store) for f in FAMILIES}
        if not any(keys.values()):
            raise InputError(
                raw,
                "raw CT scans, spike sequences or image sets",
                "none (`zarrfeed sample-data DIR` writes some)",
            )
        total = sum(map(len, keys.values())) + 1 + len(model_assets)
        with display(total) as progress:
            for family, family_keys in keys.items():
                job = defs.resolve_job_def(f"{family}_build")
                for key in family_keys:
                    progress(f"{family} {key}")
                    rows.append(run(job, instance, family, key, tags=tags, partition_key=key))
            progress("dataset manifests")
            job = defs.resolve_job_def("datasets_build")
            rows.append(run(job, instance, "datasets", "-", tags=tags))
            train = defs.resolve_job_def("train")
            for key in [a.key for a in model_assets]:
                progress(f"training {key.path[0]}")
                rows.append(
                    run(
                        train,
                        instance,
                        "training",
                        key.path[0],
                        tags=tags,
                        asset_selection=[key],
                        run_config=DEMO_TRAINING,
                    )
                )
    return rows


@contextlib.contextmanager
def workspace_origin(instance: Any) -> Iterator[dict[str, str]]:
    """Runs executed in this process in this block carry the origin of the code location
    that ``dg dev -w workspace.yaml`` loads; with the tags yielded (its repository's), the UI
    lists them under their job and re-executes them as its own, not as runs "loaded from a
    different code location".  ``execute_in_process`` records no origin and Dagster offers
    no public way to give it one, so the instance's run creation adds it for the block's
    duration (internal Dagster names, checked against dagster 1.13)."""
    from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    [location] = WorkspaceFileTarget([str(WORKSPACE)]).create_origins()
    repository = RemoteRepositoryOrigin(location, REPOSITORY)
    create = instance.create_run_for_job

    def create_with_origin(*args: Any, job_def: Any, **kwargs: Any) -> Any:
        if kwargs.get("asset_selection") and job_def.asset_selection_data is not None:
            # A job already subset to the selection, which run creation subsets again: the
            # run would name that subset as its parent, a job no code location has.
            job_def = job_def.asset_selection_data.parent_job_def
        origin = RemoteJobOrigin(repository, job_def.name)
        return create(*args, job_def=job_def, remote_job_origin=origin, **kwargs)

    instance.create_run_for_job = create_with_origin
    try:
        yield {".dagster/repository": f"{REPOSITORY}@{location.location_name}"}
    finally:
        del instance.create_run_for_job


def run(job: Any, instance: Any, family: str, key: str, **options: Any) -> Row:
    """One run of ``job`` in this process (in a :func:`workspace_origin` block, with its
    tags), as a summary row."""
    t0 = time.perf_counter()
    result = job.execute_in_process(instance=instance, raise_on_error=False, **options)
    if any(e.cls_name in INTERRUPTED for e in _failures(result)):
        raise KeyboardInterrupt  # Ctrl-C stops the whole demo, not only this run
    return _row(result, family, key, time.perf_counter() - t0)


INTERRUPTED = {"DagsterExecutionInterruptedError", "KeyboardInterrupt"}


def _failures(result: Any) -> Iterator[Any]:
    """Every error in the cause chains of a run's step failures."""
    for event in result.all_events:
        error = event.event_specific_data.error if event.is_step_failure else None
        while error is not None:
            yield error
            error = getattr(error, "cause", None)


def run_hub(hf_config: dict, store: str, home: Path, progress: Progress = lambda _: None):
    """List the hub split (partitions appear), then build each volume."""
    use_home(
        home,
        ZARRFEED_STORE=store,
        ZARRFEED_RAW=os.environ.get("ZARRFEED_RAW", "data/raw"),
        ZARRFEED_MODELS=os.environ.get("ZARRFEED_MODELS", "data/models"),
    )
    import dagster as dg

    from zarrfeed.assets.partitions import ct_scans
    from zarrfeed.definitions import defs

    run_config = {"resources": {"hf": {"config": hf_config}}}
    rows = []
    with dg.DagsterInstance.get() as instance, workspace_origin(instance) as tags:
        progress("hub listing")
        catalog = defs.resolve_job_def("hub_catalog")
        rows.append(run(catalog, instance, "hub", "catalog", tags=tags, run_config=run_config))
        if not rows[0].ok:
            return rows
        keys = sorted(instance.get_dynamic_partitions(ct_scans.name))
        if hf_config.get("max_scans"):
            keys = keys[: hf_config["max_scans"]]
        job = defs.resolve_job_def("ct_build")
        for key in keys:
            progress(f"hub volume {key}")
            rows.append(
                run(job, instance, "hub", key, tags=tags, partition_key=key, run_config=run_config)
            )
    return rows


def _subclass_names(cls: type) -> set[str]:
    return {cls.__name__, *(n for sub in cls.__subclasses__() for n in _subclass_names(sub))}


def root_cause(error: Any) -> str:
    """What failed, in one line, from a Dagster error (a ``SerializableErrorInfo``): the
    outermost zarrfeed error of its cause chain — the message that names the file or the
    server, not its own cause (a bare gzip or socket error) nor Dagster's "Error occurred
    while executing op" — else the innermost cause."""
    from zarrfeed.errors import ZarrfeedError

    chain = []
    while error is not None:
        chain.append(error)
        error = getattr(error, "cause", None)
    ours = _subclass_names(ZarrfeedError)
    error = next((e for e in chain if e.cls_name in ours), chain[-1])
    message = (error.message or "").strip()
    # "zarrfeed.errors.InputError: path: expected …" → "path: expected …"
    message = re.sub(rf"^[\w.]*{re.escape(error.cls_name)}: ", "", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "1 blocking asset check failed …:"
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else error.cls_name


def _row(result: Any, family: str, key: str, seconds: float) -> Row:
    checks = result.get_asset_check_evaluations()
    stored = None
    for event in result.get_asset_materialization_events():
        value = event.materialization.metadata.get("stored_MiB")
        if value is not None:
            stored = (stored or 0) + round(value.value * MIB)
    cause, score = "", ""
    for event in result.get_asset_materialization_events():
        score = score or _score(event.asset_key.path[-1], event.materialization.metadata)
    if not result.success:
        failure = next((e for e in result.all_events if e.is_step_failure), None)
        failed_checks = [c for c in checks if not c.passed]
        if failure is not None:
            cause = f"{failure.step_key}: {root_cause(failure.event_specific_data.error)}"
        elif failed_checks:
            c = failed_checks[0]
            cause = f"check {c.asset_key.to_user_string()}.{c.check_name} failed"
        else:
            cause = "the run failed; see the log"
    return Row(
        family,
        key,
        result.success,
        len(result.get_asset_materialization_events()),
        f"{sum(c.passed for c in checks)}/{len(checks)}",
        stored,
        seconds,
        cause,
        score,
    )


def _score(asset: str, metadata: dict[str, Any]) -> str:
    """``iou 0.00 -> 0.39`` for a model asset: its task metric before and after training."""
    from zarrfeed.training.tasks import TASK_TYPES

    task = TASK_TYPES.get(asset.removesuffix("_model"))
    after = metadata.get(f"eval_{task.metric}") if task else None
    before = metadata.get(f"eval_{task.metric}_before") if task else None
    if after is None or before is None:
        return ""
    return f"{task.metric} {before.value:.2f} -> {after.value:.2f}"


def print_summary(rows: list[Row], stream: TextIO) -> None:
    """The summary table; each failure's root cause in one line below it."""
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
            r.result,
        ]
        for r in rows
    ]
    notes = [f"{r.family} {r.partition} failed: {r.cause}" for r in rows if not r.ok]
    print_table(
        ["family", "partition", "ok", "assets", "checks", "stored", "s", "trained"],
        table,
        stream=stream,
        notes=notes,
    )


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
