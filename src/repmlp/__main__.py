"""``python -m repmlp`` is the ``repmlp`` command."""

from .cli import main

raise SystemExit(main())
