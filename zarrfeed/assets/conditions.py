"""Declarative automation of the unpartitioned assets: manifests follow the stores, models
follow the manifests, both only when the data they read changed.

``eager()`` is not used: it waits while any upstream partition is missing, and a newly
discovered scan is missing until it is built.  "Updated" is not
enough either: a run that reuses every partition records new materialisations with the same
data versions, and must not refresh a manifest or retrain a model.
"""

import dagster as dg

ON_NEW_DATA = (
    dg.AutomationCondition.any_deps_match(
        dg.AutomationCondition.data_version_changed()
    ).since_last_handled()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
).with_label("on_new_data_version")
