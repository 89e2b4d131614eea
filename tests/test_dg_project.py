"""``dg`` sees the project as its own: the components are registered in ``[tool.dg.project]``
(``registry_modules``), so ``dg list components`` lists them beside Dagster's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import zarrfeed

ROOT = Path(zarrfeed.__file__).resolve().parents[1]


def test_dg_lists_the_family_training_and_deployment_components():
    dg_cli = Path(sys.executable).with_name("dg")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [dg_cli, "list", "components", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    keys = {item["key"] for item in json.loads(out)["items"]}
    for name in ["FamilyComponent", "TrainingComponent", "DeploymentComponent"]:
        assert f"zarrfeed.components.{name}" in keys, sorted(keys)
