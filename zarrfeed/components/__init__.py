"""The code location's components: each folder of ``zarrfeed/defs`` names one in its
``defs.yaml``, with its settings as YAML attributes.

- :class:`FamilyComponent`: one data family (``family: module:NAME`` of its declaration,
  ``settings:`` its values) — its assets, checks, build job, discovery sensor and nightly
  schedule;
- :class:`TrainingComponent`: the model assets, the train job, training automation;
- :class:`DeploymentComponent`: what differs between an embedded and a production deployment
  (the executor), the resources every family shares, and the store-wide jobs and sensors.
"""

from zarrfeed.components.deployment import DeploymentComponent
from zarrfeed.components.family import FamilyComponent, family_defs
from zarrfeed.components.project import project_families
from zarrfeed.components.training import TrainingComponent

__all__ = [
    "DeploymentComponent",
    "FamilyComponent",
    "TrainingComponent",
    "family_defs",
    "project_families",
]
