"""Where trained models go."""

from __future__ import annotations

import dagster as dg

from zarrfeed import defaults


class ModelsResource(dg.ConfigurableResource):
    """Where training runs keep checkpoints, metrics and loss curves:
    ``<root>/<task>/<run>/``."""

    root: str = defaults.MODELS
