"""Declarative automation: manifests follow the stores, models follow the manifests."""

import dagster as dg


def automation_sensor(group: str) -> dg.AutomationConditionSensorDefinition:
    """Evaluates the automation conditions of ``group``; running by default (Dagster's own
    default automation sensor starts stopped, so nothing would run until someone starts it)."""
    return dg.AutomationConditionSensorDefinition(
        f"{group}_automation",
        target=dg.AssetSelection.groups(group),
        default_status=dg.DefaultSensorStatus.RUNNING,
        minimum_interval_seconds=15,
        description=f"Materialises the {group} assets whose inputs have a new data version "
        "(a manifest when a stored partition changed, a model when its manifest did).",
        tags={"stage": group},
    )


datasets_automation = automation_sensor("datasets")
training_automation = automation_sensor("training")
