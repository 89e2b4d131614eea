"""The ``zarrfeed`` subcommands, one module each (``add_parser`` and ``main``), with the
options and table output they share; ``zarrfeed.cli`` assembles them."""
