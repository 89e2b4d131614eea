"""The ``zarrfeed`` subcommands: ``train``, and those that read the store and the instance
(``inspect``, ``verify``, ``status``, ``partitions``) with the table output they share."""
