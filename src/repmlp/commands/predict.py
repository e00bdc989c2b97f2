"""``repmlp predict``: the top-k classes of your own images under a model file.

INPUT: image files (any format and mode Pillow reads; a GIF's first frame), folders (every image file
under them, recursively, in sorted order) and glob patterns (quote them; ``**`` recurses). The model file
is any that repmlp writes or imports (training-time or deployed, bf16/fp16, int8); images get exactly
the model's evaluation preprocessing (what ``repmlp eval`` applies), class names come from the file
(``--labels`` overrides them; a file without names shows class indices).

Exit status: 0 every image was predicted; 1 some inputs were skipped (each named on stderr with the
reason: missing, unreadable, truncated, empty, not an image), the others predicted and written; 2 an
error: no input images, a missing or foreign checkpoint, a labels file that does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from repmlp.commands._common import (
    add_force_argument,
    add_runtime_argument,
    check_output_file,
    check_runtime,
    number_in,
)
from repmlp.deploy.predict import (
    output_format,
    predict_paths,
    printable,
    render_table,
    result_record,
    write_results,
)
from repmlp.engine import resolve_device
from repmlp.tasks.limits import ints


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or glob patterns")
    p.add_argument(
        "--checkpoint", required=True, help="model file (model.safetensors, deploy.safetensors, ...)"
    )
    p.add_argument(
        "--top-k", type=number_in(ints(1, 10**6)), default=5, metavar="K", help="classes per image"
    )
    p.add_argument("--batch-size", type=number_in("batch_size"), default=64)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (cuda when available)")
    p.add_argument(
        "--threads", type=number_in("threads"), default=None, help="CPU threads (default: torch's)"
    )
    p.add_argument("--workers", type=_workers, default=None, metavar="N|auto", help="image decoding processes that "
                   "work ahead of the model (0: decode in this process between batches). Default auto: one per CPU "
                   "core the model leaves free, 0 when its threads use them all")  # fmt: skip
    p.add_argument(
        "--labels", default=None, metavar="FILE", help="class names, one a line (overrides the file's)"
    )
    add_runtime_argument(p, "the model")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--output", default=None, metavar="OUT",
                   help="also write OUT.csv (path,label_1,prob_1,index_1,...) or OUT.jsonl, atomically")  # fmt: skip
    add_force_argument(p)


def _workers(text: str) -> int | None:
    return None if text == "auto" else number_in("workers")(text)


def run(args: argparse.Namespace) -> int:
    if args.output:
        output_format(args.output)  # a bad name is an error before any work
        inputs = [args.checkpoint, *([args.labels] if args.labels else []), *args.inputs]
        check_output_file(Path(args.output), inputs, force=args.force)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    check_runtime(args.runtime, device)

    def skip(path: str, reason: str) -> None:  # a name cannot forge a line or move the cursor
        print(f"repmlp: skipped {printable(path)}: {printable(reason)}", file=sys.stderr, flush=True)

    done, skipped = predict_paths(args.checkpoint, args.inputs, top_k=args.top_k, batch_size=args.batch_size,
                                  device=device, workers=args.workers, labels_file=args.labels, on_skip=skip,
                                  runtime=args.runtime)  # fmt: skip
    if args.output:
        write_results(args.output, done, args.top_k)
    if args.json:
        print(json.dumps([result_record(r) for r in done], indent=1))
    else:
        sys.stdout.write(render_table(done))
    if skipped:
        print(f"repmlp: {len(done)} images predicted, {len(skipped)} skipped", file=sys.stderr)
    return 1 if skipped else 0
