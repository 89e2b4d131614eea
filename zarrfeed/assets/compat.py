"""What Dagster 1.13 cannot do publicly: per-partition data versions in a batched step.

A step that returns a result for a range of partitions gets one event per partition from
Dagster, all with the same data version (``MaterializeResult.data_version`` and ``tags`` are
per asset, never per partition), and every partition of the range recorded as
materialised, the failed ones too.  So a batched step logs its own
``dg.AssetMaterialization`` per committed partition (public), and two things here are not:

- the names of the tags Dagster writes for data versions and input provenance, which its
  staleness reads (no public constant or helper names them): :func:`provenance_tags`;
- the metadata key that makes Dagster skip its own events for a step's output
  (:data:`LOGGED_BY_STEP`; Dagster uses it for its auto-converted observable source assets).
  The public ways to skip them all stop the next steps of the run: an output not yielded
  (``output_required=False``, ``AssetSpec(skippable=True)``) skips every step that depends on
  it, and a step that raises before yielding it abandons them; a batched run builds all its
  stages in one run, each on the partitions the last one committed.

``tests/test_dagster_compat.py`` fails the day Dagster changes either: it compares these tags
with those of a public one-partition materialisation and checks that a batched step with the
marker records exactly one event per partition.
"""

from collections.abc import Mapping

import dagster as dg

DATA_VERSION_TAG = "dagster/data_version"
CODE_VERSION_TAG = "dagster/code_version"
USER_PROVIDED_TAG = "dagster/data_version_is_user_provided"
NULL_EVENT_POINTER = "NULL"
INITIAL = "INITIAL"  # the data version Dagster assumes for an upstream never materialised
LOGGED_BY_STEP = "__source_asset_observation__"
"""Output metadata key: the step logged the output's materialisations itself."""


def input_version_tag(upstream: dg.AssetKey) -> str:
    """The tag holding the data version of ``upstream`` that a materialisation read."""
    return f"dagster/input_data_version/{upstream.to_user_string()}"


def input_pointer_tag(upstream: dg.AssetKey) -> str:
    """The tag holding the storage id of the ``upstream`` event that a materialisation read."""
    return f"dagster/input_event_pointer/{upstream.to_user_string()}"


def provenance_tags(
    data_version: str,
    code_version: str | None,
    upstream: Mapping[dg.AssetKey, tuple[str, int | None]],
) -> dict[str, str]:
    """The tags Dagster writes on a one-partition materialisation with a user-provided
    ``data_version``: its code version and, for each upstream asset, the (data version,
    storage id) of the event it read."""
    tags = {DATA_VERSION_TAG: data_version, USER_PROVIDED_TAG: "true"}
    if code_version is not None:
        tags[CODE_VERSION_TAG] = code_version
    for up, (version, storage_id) in upstream.items():
        tags[input_version_tag(up)] = version
        tags[input_pointer_tag(up)] = str(storage_id or NULL_EVENT_POINTER)
    return tags


def data_version_of(tags: Mapping[str, str]) -> str | None:
    """The data version an event's tags record, if any."""
    return tags.get(DATA_VERSION_TAG)
