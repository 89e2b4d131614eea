"""Options of a build run."""

from __future__ import annotations

import dagster as dg


class BuildOptions(dg.ConfigurableResource):
    """``force`` rebuilds partitions whose inputs, code and settings are unchanged.

    Without it a partition already committed with the fingerprint it would get now is reused
    (and re-checked; one whose stored data fails its checks is rebuilt), which makes reruns
    and retried backfills cheap.  Set it per run in the launchpad
    (``resources: build: config: force: true``).  What the data looks like is not a run
    option: it is the family's settings, in its component's YAML.
    """

    force: bool = False
