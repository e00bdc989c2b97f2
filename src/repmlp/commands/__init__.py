"""One module per ``repmlp`` command, each exposing ``add_parser(subparsers)`` and ``run(args) -> int``.

A command parses its options, builds a typed config and calls a task, deploy or bench function; shared
option groups live in :mod:`._common` and :mod:`.task_options`, the argparse classes in :mod:`._parser`.
May import every room; only :mod:`repmlp.cli` imports it.
"""
