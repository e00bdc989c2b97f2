#!/bin/bash
# Every benchmark of docs/benchmarks.md, one after the other, output as Markdown on stdout.
#   bash benchmarks/run_all.sh [--device cuda] > bench.md
# Run it on an otherwise idle machine: each script reports ratios measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
device_args=("$@")
echo "Produced by \`bash benchmarks/run_all.sh${*:+ $*}\` on $(date -u +%Y-%m-%d)."
echo
for script in bench_block bench_fc3 bench_conversion; do
    echo "### benchmarks/${script}.py"
    echo
    python3 "benchmarks/${script}.py" "${device_args[@]}"
    echo
done
echo "### repmlp bench: whole models, training-time vs deployed form (batch 8, 224x224)"
echo
python3 -m repmlp -q bench --model torchvision:resnet50 repmlp_res50 repmlp_res50_light --batch-size 8 \
    "${device_args[@]}"
