"""The ``zarrfeed`` subcommands that read the store and the instance: ``inspect``, ``verify``,
``status``, ``partitions``, and the table output they share."""
