"""Declarative automation of the unpartitioned assets: manifests follow the stores, models
follow the manifests, both only when the data they read changed.

``eager()`` is not used: it waits while any upstream partition is missing, and a newly
discovered scan is missing until it is built.  "Updated" is not
enough either: a run that reuses every partition records new materialisations with the same
data versions, and must not refresh a manifest or retrain a model.

A new upstream data version is handled once the asset is requested for it, or once a run
launched by hand updates it.  The end of a run the automation launched handles nothing: it
read what was there when it started, and a version that landed meanwhile (a manifest
rewritten during hours of training) would otherwise be forgotten.
"""

import dagster as dg

# The tag Dagster's automation daemon puts on every run it launches (its value is "true").
AUTOMATED = {"dagster/from_automation_condition"}

HANDLED = (
    dg.AutomationCondition.newly_requested()
    | (
        dg.AutomationCondition.newly_updated()
        & ~dg.AutomationCondition.all_new_updates_have_run_tags(tag_keys=AUTOMATED)
    )
    | dg.AutomationCondition.initial_evaluation()
).with_label("requested, or updated by hand")

ON_NEW_DATA = (
    dg.AutomationCondition.any_deps_match(dg.AutomationCondition.data_version_changed()).since(
        HANDLED
    )
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
).with_label("on_new_data_version")
