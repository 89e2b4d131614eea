"""Every fact a declaration holds is written once: the package's code takes names, paths and
versions from the families' declarations (and the tasks' and defaults' modules), never
restates them.

The scan reads every module of the package as a syntax tree: a string constant (docstrings
aside) equal to a declared fact is allowed only in the module that declares it; a store
call names a table or an array of another module's declaration only through it; no
``code_version=`` is a literal; no module keeps a registry keyed by family names.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import zarrfeed
from zarrfeed import defaults
from zarrfeed.components import project_families
from zarrfeed.training.tasks import TASK_TYPES, model_asset_name

PACKAGE = Path(zarrfeed.__file__).parent
STORE_CALLS = {
    "open_partition", "has_partition", "write_partition", "read_array", "open_array",
    "commit_record", "commit_records", "list_partitions", "delete_partition", "consolidate",
    "partition_url", "record_summaries", "read_manifest", "write_dataset",
}  # fmt: skip


def module_file(module: str) -> Path:
    return Path(importlib.import_module(module).__file__).resolve()


def declared() -> tuple[dict[str, Path], dict[str, Path]]:
    """(fact -> the file that declares it, table/array name -> its file): every family of the
    code location, the tasks, the default paths."""
    facts: dict[str, Path] = {}
    names: dict[str, Path] = {}
    for component in project_families():
        family = component.declaration
        home = module_file(family.settings.__module__)  # the module that declares it
        own = [family.partitions, family.raw.asset, family.dataset_asset, family.dataset_path,
               family.build_job, family.dataset_job, family.nightly, family.discovery]  # fmt: skip
        for spec in family.assets:
            own += [spec.name, spec.path]
            names |= dict.fromkeys((a.name for a in spec.arrays if not a.per), home)
        if family.hub:
            own += [family.hub.asset, family.hub.path, family.hub.job]
            names[family.hub.labels] = home
        facts |= dict.fromkeys(own, home)
        names |= {t.name: home for t in (*family.tables, *family.extras)}
    for t, task in TASK_TYPES.items():  # each in its family's tasks module
        facts |= dict.fromkeys((t, model_asset_name(t)), module_file(task.__module__))
    paths = module_file("zarrfeed.defaults")
    facts |= {v: paths for v in (defaults.STORE, defaults.RAW, defaults.MODELS)}
    return facts, names


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.resolve(), ast.parse(path.read_text(), str(path))


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"


def test_the_scan_finds_the_declarations():
    facts, names = declared()
    assert {"ct_hu", "ct/hu", "ct_scans", "ct_raw_scan", "images_dataset", "hub/catalog"} <= set(
        facts
    )
    assert {"patches", "labels", "hu", "voxels"} <= set(names)
    assert facts["ct_classifier_model"].name == "tasks.py"


def test_no_module_restates_a_declared_fact():
    facts, _ = declared()
    found = []
    for path, tree in sources():
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                home = facts.get(node.value)
                if home is not None and home != path and id(node) not in skip:
                    found.append(f"{where(path, node)}: {node.value!r} (declared in {home.name})")
    assert not found, "declared facts restated:\n" + "\n".join(found)


def test_store_calls_name_tables_and_arrays_through_their_declaration():
    _, names = declared()
    found = []
    for path, tree in sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            # A store method (store.read_array(…)) or a dataset function (consolidate(store, …)).
            called = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if called not in STORE_CALLS:
                continue
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                literal = isinstance(arg, ast.Constant) and arg.value in names
                if literal and names[arg.value] != path:
                    found.append(f"{where(path, arg)}: {called}(… {arg.value!r} …)")
    assert not found, "tables or arrays named by a literal:\n" + "\n".join(found)


def test_code_versions_come_from_declarations():
    found = []
    for path, tree in sources():
        for node in ast.walk(tree):
            literal = isinstance(getattr(node, "value", None), ast.Constant)
            if isinstance(node, ast.keyword) and node.arg == "code_version" and literal:
                found.append(f"{where(path, node.value)}: code_version={node.value.value!r}")
    assert not found, "literal code versions:\n" + "\n".join(found)


def family_packages() -> list[str]:
    """The family packages: every package directly under ``zarrfeed/families``."""
    return sorted(p.parent.name for p in (PACKAGE / "families").glob("*/__init__.py"))


def family_references(tree: ast.Module, module: str, packages: list[str]) -> list[tuple[int, str]]:
    """(line, name) of each import in ``tree`` (module ``module``) of a family package or of
    a module in one — at module level, deferred or for type checking alike — and of each
    string constant (docstrings aside) naming one, as ``"module:Class"`` readers do.  The
    generic ``zarrfeed.families`` modules (the registry, the Family type) are not families."""
    prefixes = [f"zarrfeed.families.{p}" for p in packages]
    is_package = Path(module.replace(".", "/")).name == "__init__"
    here = module.removesuffix(".__init__") if is_package else module.rpartition(".")[0]
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(part for part in (base, node.module or "") if part)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
        ):
            names = [node.value.partition(":")[0]]
        else:
            continue
        hits = [n for n in names if any(n == p or n.startswith(f"{p}.") for p in prefixes)]
        found += [(node.lineno, n) for n in hits[:1]]
    return sorted(found)


def test_training_names_no_family():
    """``zarrfeed.training`` is generic: each family's datasets, models and tasks live in its
    own package (``zarrfeed.families.<family>``), which imports training, never the other way
    (that its models live there is :func:`test_each_task_builds_a_model_of_its_own_family`)."""
    packages = family_packages()
    assert {"ct", "images", "spike"} <= set(packages)  # the scan sees the families
    found = []
    for path, tree in sources():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[:2] != ("zarrfeed", "training"):
            continue
        for line, name in family_references(tree, ".".join(parts), packages):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    assert not found, "training modules naming a family:\n" + "\n".join(found)


def test_each_task_builds_a_model_of_its_own_family():
    """A task's model lives in its family's package beside the task (training holds only the
    blocks models are built from), so that a family's model moves and changes with it."""
    from zarrfeed.training.config import TrainConfig

    # What the tasks' models read of their dataset: the classifier's labels, the spike clips'
    # voxel shape (frames, bins, height, width).
    dataset = SimpleNamespace(label_names=["a", "b"], voxel_shapes=[(8, 5, 16, 16)])
    for name, task_type in TASK_TYPES.items():
        home = task_type.__module__.rpartition(".")[0]
        model = task_type(TrainConfig.model_validate({"task": name})).model(dataset)
        assert type(model).__module__.startswith(f"{home}."), (name, type(model).__module__)


def test_a_family_reference_in_training_is_found():
    code = (
        '"""Docstring naming zarrfeed.families.ct is prose."""\n'
        "from zarrfeed.families.ct.datasets import CTPatchDataset\n"
        "from zarrfeed.families import Family, images\n"
        "from ...families.spike import SPIKE\n"
        "import zarrfeed.families.registry\n"
        "def load():\n"
        "    import zarrfeed.families.ct\n"
        "READER = 'zarrfeed.families.images.datasets:ImagePatchDataset'\n"
    )
    got = family_references(ast.parse(code), "zarrfeed.training.data.x", ["ct", "images", "spike"])
    assert got == [
        (2, "zarrfeed.families.ct.datasets"),
        (3, "zarrfeed.families.images"),
        (4, "zarrfeed.families.spike"),
        (7, "zarrfeed.families.ct"),
        (8, "zarrfeed.families.images.datasets"),
    ]


@pytest.mark.parametrize("kind", ["dict", "set"])
def test_no_registry_is_keyed_by_family_names(kind):
    """A new family must not need an entry in someone else's table."""
    families = {c.declaration.name for c in project_families()}
    found = []
    for path, tree in sources():
        exported = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                    and any(getattr(t, "id", "") == "__all__" for t in n.targets)}  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in exported:
                continue  # a package's module names
            keys = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if kind == "dict" and not isinstance(node, ast.Dict):
                continue
            if kind == "set" and not isinstance(node, ast.Set | ast.Tuple | ast.List):
                continue
            named = {k.value for k in keys or () if isinstance(k, ast.Constant)}
            if len(named & families) >= 2:
                found.append(f"{where(path, node)}: {sorted(named & families)}")
    assert not found, "per-family registries:\n" + "\n".join(found)


def test_the_docs_graph_table_follows_the_declarations():
    """The docs' table of the graph names every asset and check the declarations give, in
    its family's row: a new family, asset or check fails here until the table says so."""
    text = (PACKAGE.parent / "docs" / "dagster.md").read_text()
    start = text.index("| group | assets | checks (blocking) |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        rows[line.split("`")[1]] = line
    wanted: dict[str, list[str]] = {"datasets": [], "training": []}
    for component in project_families():
        family = component.declaration
        names = [family.raw.asset, family.raw.readable.name]
        names += [n for spec in family.assets for n in (spec.name, *spec.check_names)]
        wanted[family.name] = names
        wanted["datasets"].append(family.dataset_asset)
        if family.hub:
            wanted["hub"] = [family.hub.asset, family.hub.check.name]
    wanted["training"] = [model_asset_name(t) for t in TASK_TYPES]
    missing = {
        row: [n for n in names if f"`{n}`" not in rows.get(row, "")]
        for row, names in wanted.items()
    }
    assert not {k: v for k, v in missing.items() if v}, missing
