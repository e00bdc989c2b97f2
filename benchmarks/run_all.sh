#!/bin/bash
# Every benchmark of docs/benchmarks.md, one after the other, output as Markdown on stdout.
#   bash benchmarks/run_all.sh [--device cuda] > bench.md
# Run it on an otherwise idle machine: each script reports ratios measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
device_args=("$@")
echo "Produced by \`bash benchmarks/run_all.sh${*:+ $*}\` on $(date -u +%Y-%m-%d)."
echo
for script in bench_block bench_conversion; do
    echo "### benchmarks/${script}.py"
    echo
    python3 "benchmarks/${script}.py" "${device_args[@]}"
    echo
done
echo "### repmlp bench: whole models, training-time vs deployed form (batch 8, 224x224)"
echo
python3 -m repmlp -q bench --model torchvision:resnet50 repmlp_res50 repmlp_res50_light --batch-size 8 \
    "${device_args[@]}"
echo
echo "### benchmarks/bench_deploy.py: deployed models vs ResNet-50 per treatment and batch size"
echo
python3 benchmarks/bench_deploy.py  # CPU only; every treatment, batches 1, 8, 32
echo
for model in repmlp_res50_light repmlp_res50; do
    echo "### benchmarks/profile_deploy.py --model ${model}: where the time goes"
    echo
    python3 benchmarks/profile_deploy.py --model "${model}"
    echo
done
echo "### benchmarks/bench_runtimes.py: deployed models vs ResNet-50 in PyTorch, ONNX Runtime and OpenVINO"
echo
python3 benchmarks/bench_runtimes.py --profile  # CPU only; OpenVINO rows need pip install 'repmlp[openvino]'
echo
echo "### benchmarks/bench_train.py: the training step before and after issue 19's work"
echo
python3 benchmarks/bench_train.py --profile
echo
echo "### benchmarks/bench_forms.py: the training form against the plain model"
echo
python3 benchmarks/bench_forms.py
echo
echo "### benchmarks/bench_allocator.py: a training step under three settings of glibc's malloc"
echo
python3 benchmarks/bench_allocator.py  # CPU only
echo
echo "### benchmarks/bench_deploy.py with glibc malloc keeping freed memory (no page faults per call)"
echo
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
    python3 benchmarks/bench_deploy.py --treatments eager channels_last --batch-sizes 8
if [ -f runs/fmnist/model.safetensors ]; then
    echo
    echo "### benchmarks/bench_precision.py: reduced-precision deployment of runs/fmnist"
    echo
    python3 benchmarks/bench_precision.py --run runs/fmnist  # CPU only
fi
