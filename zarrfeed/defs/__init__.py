"""The code location's definitions, one folder per component (``defs.yaml``): a folder per
data family with its settings, training, and the deployment."""
