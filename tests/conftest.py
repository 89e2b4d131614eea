"""Shared fixtures: real files shipped in PyPI wheels, and the sample data made once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from zarrfeed.samples import make_sample_data


def package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it (spikezoo is installed
    with --no-deps only for its data)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{name} is not installed; .ci/run installs it (see README)")
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="session")
def spikezoo_data() -> Path:
    return package_dir("spikezoo") / "data" / "base"


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("samples")
    make_sample_data(out)
    return out
