"""One module per ``repmlp`` command, each exposing ``add_parser(subparsers)`` and ``run(args) -> int``."""
