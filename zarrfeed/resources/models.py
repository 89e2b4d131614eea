"""Where trained models go."""

from __future__ import annotations

import dagster as dg


class ModelsResource(dg.ConfigurableResource):
    """Where training runs keep checkpoints, metrics and loss curves:
    ``<root>/<task>/<run>/``."""

    root: str = "data/models"
