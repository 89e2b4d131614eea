"""``zarrfeed demo``: the whole graph on the sample data, in a persistent Dagster instance.

Runs the real build jobs partition by partition into ``DAGSTER_HOME`` (default
``.dagster_home`` in the working folder), so ``dagster dev -w workspace.yaml`` started
afterwards from the same folder shows every run, partition and check.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DAGSTER_YAML = """\
telemetry:
  enabled: false
freshness:
  enabled: true
concurrency:
  runs:
    max_concurrent_runs: {runs}
"""


# The defaults, but a narrower occupancy autoencoder: 64³ grids at width 16 take ~1 s a step
# on two cores, and the demo should stay around two minutes.
DEMO_TRAINING = {"ops": {"sparse_autoencoder_model": {"config": {"train": {"width": 8}}}}}


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


def run_demo(raw: Path, store: str, home: Path) -> list[dict]:
    """Discover, build every partition of every family, the dataset manifests, then train
    every model on them."""
    use_home(home, ZARRFEED_RAW=str(raw), ZARRFEED_STORE=store)
    import dagster as dg
    from tqdm import tqdm

    from zarrfeed.assets import model_assets
    from zarrfeed.definitions import defs
    from zarrfeed.jobs import FAMILIES

    raw_resource = defs.resources["raw"]
    rows = []
    with dg.DagsterInstance.get() as instance:
        for family, (partitions, sources, _) in FAMILIES.items():
            keys = sorted(sources(raw_resource))
            known = set(instance.get_dynamic_partitions(partitions.name))
            instance.add_dynamic_partitions(partitions.name, [k for k in keys if k not in known])
            job = defs.resolve_job_def(f"{family}_build")
            for key in tqdm(keys, desc=f"{family} partitions", unit="partition"):
                t0 = time.perf_counter()
                result = job.execute_in_process(
                    partition_key=key, instance=instance, raise_on_error=False
                )
                rows.append(_row(result, family, key, time.perf_counter() - t0))
        t0 = time.perf_counter()
        result = defs.resolve_job_def("datasets_build").execute_in_process(
            instance=instance, raise_on_error=False
        )
        rows.append(_row(result, "datasets", "-", time.perf_counter() - t0))
        train = defs.resolve_job_def("train")
        for key in tqdm([a.key for a in model_assets], desc="models", unit="model"):
            t0 = time.perf_counter()
            result = train.execute_in_process(
                instance=instance,
                asset_selection=[key],
                run_config=DEMO_TRAINING,
                raise_on_error=False,
            )
            rows.append(_row(result, "training", key.path[0], time.perf_counter() - t0))
    return rows


def run_hub(hf_config: dict, store: str, home: Path) -> list[dict]:
    """List the hub split (partitions appear), then build each volume with a progress bar."""
    use_home(home, ZARRFEED_STORE=store)
    import dagster as dg
    from tqdm import tqdm

    from zarrfeed.assets.partitions import hub_ct_scans
    from zarrfeed.definitions import defs

    run_config = {"resources": {"hf": {"config": hf_config}}}
    rows = []
    with dg.DagsterInstance.get() as instance:
        t0 = time.perf_counter()
        result = defs.resolve_job_def("hub_catalog").execute_in_process(
            run_config=run_config, instance=instance, raise_on_error=False
        )
        rows.append(_row(result, "hub", "catalog", time.perf_counter() - t0))
        if not result.success:
            return rows
        keys = sorted(instance.get_dynamic_partitions(hub_ct_scans.name))
        if hf_config.get("max_scans"):
            keys = keys[: hf_config["max_scans"]]
        job = defs.resolve_job_def("hub_build")
        for key in tqdm(keys, desc="hub volumes", unit="volume"):
            t0 = time.perf_counter()
            result = job.execute_in_process(
                partition_key=key, run_config=run_config, instance=instance, raise_on_error=False
            )
            rows.append(_row(result, "hub", key, time.perf_counter() - t0))
    return rows


def _row(result, family: str, key: str, seconds: float) -> dict:
    checks = result.get_asset_check_evaluations()
    stored = 0
    for event in result.get_asset_materialization_events():
        value = event.materialization.metadata.get("stored_bytes")
        stored += value.value if value is not None else 0
    failure = next((e for e in result.all_events if e.is_step_failure), None)
    return {
        "family": family,
        "partition": key,
        "ok": result.success,
        "assets": len(result.get_asset_materialization_events()),
        "checks": f"{sum(c.passed for c in checks)}/{len(checks)}",
        "stored_MB": stored / 1e6,
        "seconds": seconds,
        "error": failure.event_specific_data.error.message.strip() if failure else "",
    }


COLUMNS = ("{:<9}", "{:<25}", "{:<4}", "{:>6}", "{:>7}", "{:>10}", "{:>7}")


def format_table(rows: list[dict]) -> str:
    def line(*cells: object) -> str:
        return " ".join(f.format(c) for f, c in zip(COLUMNS, cells, strict=True))

    head = line("family", "partition", "ok", "assets", "checks", "stored MB", "s")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = "yes" if r["ok"] else "NO"
        lines.append(line(r["family"], r["partition"], ok, r["assets"], r["checks"],
                          f"{r['stored_MB']:.2f}", f"{r['seconds']:.1f}"))  # fmt: skip
        if r["error"]:
            lines.append(f"    error: {r['error'].splitlines()[0][:200]}")
    return "\n".join(lines)
