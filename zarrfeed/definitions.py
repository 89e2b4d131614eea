"""The Dagster code location (``dagster dev -w workspace.yaml``).

Assets, resources, schedules and sensors are assembled here and only here.
"""

import dagster as dg

defs = dg.Definitions()
