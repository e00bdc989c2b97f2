"""One module per ``repmlp`` command, each with ``add_arguments(parser)`` and ``run(args) -> int``.

A command parses its options, builds a typed config and calls a task, deploy or bench function; what several
share (output files, option types, options built from the tasks' configs) lives in :mod:`._common` and
:mod:`.task_options`, the argparse classes in :mod:`._parser`. May import every folder; only :mod:`repmlp.cli`
imports it, one command at a time.
"""
