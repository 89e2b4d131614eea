"""Where things are when nothing says otherwise: the store, the raw folder, the models and
the Dagster instance, relative to the working folder (the repository's ``.env`` tells the
dagster CLI the same)."""

STORE = "data/zarrfeed.zarr"
RAW = "data/raw"
MODELS = "data/models"
DAGSTER_HOME = ".dagster_home"
HUB_REPO = "ibrahimhamamci/CT-RATE"  # CT-RATE on the Hugging Face hub

# File symlinks under the raw folder (ZARRFEED_RAW_LINKS): "follow" reads every link at its
# target, wherever it lies, and records link, target and hash in the provenance; "inside"
# refuses a link whose target lies outside the raw folder (discovery skips it, naming both).
RAW_LINKS = "follow"
