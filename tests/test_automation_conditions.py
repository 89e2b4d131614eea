"""The automation condition of manifests and models (``ON_NEW_DATA``) on toy assets: it
requests on a new upstream data version, and a new version that lands while the automated
run is under way is not lost when that run ends."""

import dagster as dg
from dagster._core.storage.tags import AUTOMATION_CONDITION_TAG

from zarrfeed.assets.compat import DATA_VERSION_TAG
from zarrfeed.assets.conditions import ON_NEW_DATA


@dg.asset
def upstream() -> None: ...


@dg.asset(deps=[upstream], automation_condition=ON_NEW_DATA)
def downstream() -> None: ...


def new_version(instance: dg.DagsterInstance, version: str) -> None:
    """``upstream`` materialised with data version ``version`` (as a build run records it)."""
    event = dg.AssetMaterialization("upstream", tags={DATA_VERSION_TAG: version})
    instance.report_runless_asset_event(event)


def test_a_version_that_lands_while_the_automated_run_is_under_way_is_requested_after_it():
    defs = dg.Definitions(assets=[upstream, downstream])
    key = dg.AssetKey("downstream")
    with dg.instance_for_test() as instance:
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        new_version(instance, "1")
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(key) == 1
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(key) == 0  # the next tick, while the run goes on
        # The requested run reads version 1; version 2 lands before it ends.
        new_version(instance, "2")
        automated = {AUTOMATION_CONDITION_TAG: "true"}
        assert dg.materialize([downstream], instance=instance, tags=automated).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(key) == 1
        # Once that run is done (nothing new since), nothing more is requested.
        assert dg.materialize([downstream], instance=instance, tags=automated).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(key) == 0


def test_a_manual_run_after_a_new_version_takes_its_place():
    """A run someone launched by hand after the new version landed consumed it: no second
    run (a retrain costs GPU hours)."""
    defs = dg.Definitions(assets=[upstream, downstream])
    key = dg.AssetKey("downstream")
    with dg.instance_for_test() as instance:
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        new_version(instance, "1")
        assert dg.materialize([downstream], instance=instance).success
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
        assert tick.get_num_requested(key) == 0
