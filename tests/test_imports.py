"""The package's modules import one another without cycles, and importing one sets no
global state: no environment read decides a value at import, no warning filter is installed.

Imports are read from the syntax tree (module level and inside functions alike: a deferred
import that closes a cycle is still a cycle in the design; imports for type checking only
aside), resolved to zarrfeed modules.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import zarrfeed

PACKAGE = Path(zarrfeed.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the zarrfeed modules it imports (a package import as the package)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target.startswith("zarrfeed.") and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), packages set aside:
    a package's ``__init__`` re-exporting its modules is not a cycle of the design."""
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    edges = {
        m: {t for t in ts if t not in packages} for m, ts in graph.items() if m not in packages
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return out


def test_the_scan_sees_the_imports():
    graph = imports()
    assert "zarrfeed.store.contract" in graph["zarrfeed.families.family"]
    assert "zarrfeed.assets.build" in graph["zarrfeed.assets.family"]


def test_the_store_is_only_storage_and_datasets_sit_above_it():
    """The store knows nothing of datasets (manifests, versions, retention, leases);
    datasets use the store, and training and the Dagster layer use datasets, never the
    other way round."""
    graph = imports()

    def under(prefix: str) -> dict[str, set[str]]:
        return {m: ts for m, ts in graph.items() if m == prefix or m.startswith(f"{prefix}.")}

    users = ("training", "assets", "resources", "jobs", "components", "definitions", "commands")
    users = tuple(f"zarrfeed.{m}" for m in users)
    above = ("zarrfeed.datasets", *users)
    for module, targets in under("zarrfeed.store").items():
        assert not [t for t in targets if t.startswith(above)], module
    for module, targets in under("zarrfeed.datasets").items():
        assert not [t for t in targets if t.startswith(users)], module
    assert "zarrfeed.store.records" in graph["zarrfeed.datasets.plan"]  # the scan sees them


def test_no_import_cycles():
    assert cycles(imports()) == []


def test_a_detected_cycle_is_reported():
    assert cycles({"zarrfeed.a": {"zarrfeed.b"}, "zarrfeed.b": {"zarrfeed.a"}}) == [
        ["zarrfeed.a", "zarrfeed.b"]
    ]


IMPORT_ALL = """
import importlib, os, pkgutil, sys, warnings
import zarrfeed
PACKAGE = os.path.dirname(zarrfeed.__file__)
found = []

def watched(name, real):
    def call(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(PACKAGE):  # zarrfeed's own code, not a library it imports
            found.append(f"{name}{args[:1]} at {os.path.relpath(caller, PACKAGE)}")
        return real(*args, **kwargs)
    return call

os.environ.get = watched("os.environ.get", os.environ.get)
os.getenv = watched("os.getenv", os.getenv)
warnings.filterwarnings = watched("warnings.filterwarnings", warnings.filterwarnings)
warnings.simplefilter = watched("warnings.simplefilter", warnings.simplefilter)
for info in pkgutil.walk_packages(zarrfeed.__path__, "zarrfeed."):
    importlib.import_module(info.name)
print("\\n".join(found))
"""


def run_python(code: str) -> str:
    """The output of ``code`` run in a fresh interpreter, which must succeed."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_importing_any_module_reads_no_setting_and_installs_no_warning_filter():
    """What a module's import reads from the environment is fixed before anyone can set it
    (a code location, a test, ``zarrfeed demo``); a filter it installs hides warnings from
    every other code in the process."""
    out = run_python(IMPORT_ALL)
    assert out.strip() == "", out


def test_the_cli_and_the_code_location_start_without_torch():
    """``zarrfeed status``, ``inspect``, ``--help``, a code location's load (every run and
    step process does one) and a validated training config import no torch (~1.1–1.7 s on
    two cores): the CT transforms, the statistics and the training tasks load it when they
    first compute, and a family package loads its datasets only when they are imported; the
    public training names still import from ``zarrfeed.training``, each family's datasets
    from its package, not from ``zarrfeed.training``."""
    code = (
        "import sys, zarrfeed.cli, zarrfeed.definitions, zarrfeed.training.config\n"
        "import zarrfeed.families.ct, zarrfeed.families.images, zarrfeed.families.spike\n"
        "zarrfeed.definitions.defs().get_repository_def()  # what a run process loads\n"
        "zarrfeed.training.config.TrainConfig.model_validate({'task': 'ct_classifier'})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from zarrfeed.training import TrainConfig, Trainer, make_loader\n"
        "from zarrfeed.families.ct.datasets import CTPatchDataset\n"
        "import zarrfeed.training as t\n"
        "assert {'Trainer', 'train', 'make_loader'} <= set(t.__all__)\n"
        "assert not {'CTPatchDataset', 'ImagePatchDataset', 'SpikeClipDataset'} & set(t.__all__)\n"
    )
    run_python(code)


def test_the_code_location_loads_without_the_readers_libraries():
    """A code location's load declares the families and opens no array and reads no scan:
    zarr, nibabel, pydicom (and the scipy nibabel pulls in) and the hub's client
    (huggingface_hub, httpx), ~1 s of every run and step process's start on two cores, load
    when an array is opened or written, a reader or the hub first used; the public reader and
    hub names still import from their packages."""
    code = (
        "import sys, zarrfeed.definitions\n"
        "zarrfeed.definitions.defs().get_repository_def()  # what a run process loads\n"
        "heavy = {'zarr', 'nibabel', 'pydicom', 'scipy', 'huggingface_hub', 'httpx2'}\n"
        "assert not heavy & set(sys.modules), sorted(heavy & set(sys.modules))\n"
        "from zarrfeed.formats import read_ct, read_dicom_series, read_nifti, Volume\n"
        "from zarrfeed.sources import CTRateHub, HubError\n"
        "assert {'nibabel', 'huggingface_hub'} <= set(sys.modules)\n"
        "from zarrfeed.store import compressors_for\n"
        "assert compressors_for('int16') and 'zarr' in sys.modules\n"
        "import zarrfeed.formats as f, zarrfeed.sources as s\n"
        "assert [getattr(f, n) for n in f.__all__] and [getattr(s, n) for n in s.__all__]\n"
    )
    run_python(code)


def test_the_cli_starts_without_dagster():
    """Every ``zarrfeed`` command imports every command module; dagster (~1.5 s on two
    cores) loads only in the commands that launch runs (``demo``, ``hub``), when they run."""
    run_python(
        "import sys, zarrfeed.cli\n"
        "zarrfeed.cli.build_parser()\n"
        "assert 'dagster' not in sys.modules, 'the CLI imported dagster'\n"
        "import zarrfeed.commands.launcher as launcher\n"
        "assert launcher.code_location and launcher.Launcher and launcher.Finished\n"
    )
