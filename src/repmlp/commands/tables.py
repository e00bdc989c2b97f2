"""``repmlp tables``: the paper's model tables (structures, params, FLOPs) as computed by this package."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tables",
        help="print the paper's model tables (params, FLOPs) computed from the registered models",
        description=__doc__,
    )
    p.add_argument("--output", type=Path, default=None, help="also write the Markdown to this file")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import atomic_write_text
    from ..tables import render_tables
    from ._common import check_report_output

    check_report_output(args.output)
    text = render_tables()
    print(text)
    if args.output is not None:
        atomic_write_text(args.output, text if text.endswith("\n") else text + "\n")
    return 0
