"""The layer rules of DESIGN.md, checked in a fresh interpreter."""

import subprocess
import sys


def imported_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return {m.split(".")[0] for m in out.stdout.split()}


def test_inner_layers_do_not_import_dagster():
    assert "dagster" not in imported_after(
        "import zarrfeed.transforms, zarrfeed.store, zarrfeed.formats, zarrfeed.datasets"
    )


def test_transforms_do_not_import_zarr():
    mods = imported_after("import zarrfeed.transforms")
    assert "zarr" not in mods and "dagster" not in mods


def test_training_and_sources_do_not_import_dagster():
    assert "dagster" not in imported_after("import zarrfeed.training, zarrfeed.sources")


def test_definitions_load():
    # A fresh interpreter: Dagster's process-global definitions state from other tests'
    # (closed) instances must not decide this.
    imported_after("from zarrfeed.definitions import defs; defs().resolve_all_job_defs()")
