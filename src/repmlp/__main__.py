"""``python -m repmlp`` is the ``repmlp`` command."""

from repmlp.cli import main

raise SystemExit(main())
