"""Where things are when nothing says otherwise: the store, the raw folder, the models and
the Dagster instance, relative to the working folder (the repository's ``.env`` tells the
dagster CLI the same)."""

STORE = "data/zarrfeed.zarr"
RAW = "data/raw"
MODELS = "data/models"
DAGSTER_HOME = ".dagster_home"
