#!/usr/bin/env bash
# One prepared check for a lent GPU: the main job on CUDA, the training-step benchmark
# (benchmarks/bench_gpu.py), the CUDA tier of the test suite and the paper's speed tables in fp32 and fp16,
# in that order. At most 8 minutes in all (GPU_CHECK_BUDGET seconds, default 470): every step runs under `timeout`, capped by what is left of the
# budget; every output goes under one folder; a summary comes last (also written to summary.md).
#
#   benchmarks/gpu_check.sh [--out DIR] [--device cuda|cpu] [--quick] [--only STEP[,STEP]] [--dry-run]
#
#   --out DIR    output folder (default: $OUT if set, else ./gpu-check-out)
#   --device D   cuda (default) or cpu: with --quick, a CPU run of the same steps, to try the script
#   --quick      small settings (main job on 256 images, speed tables --quick on the face rows)
#   --only S     run only these steps: main, data, torchrun, bench, tier, tables (comma-separated;
#                default: main,bench,tier,tables)
#   --dry-run    print the steps, their commands and time limits, run nothing
#
# Environment: REPMLP_FMNIST_DIR, the folder of the four Fashion-MNIST IDX files (default: Debian's
# /usr/share/datasets/fashion-mnist when present). Nothing is installed: the machine's python3 runs the
# source tree (PYTHONPATH=src). Exit status: 0 when every step that ran passed, 1 otherwise.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-./gpu-check-out}"
DEVICE=cuda
QUICK=0
DRY=0
ONLY="main,tier,tables,bench"
BUDGET=${GPU_CHECK_BUDGET:-470} # seconds for all steps: 8 minutes less room for the summary
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --device) DEVICE="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --only) ONLY="$2"; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$DEVICE" in cuda | cuda:* | cpu) ;; *) echo "gpu_check.sh: --device cuda or cpu" >&2; exit 2 ;; esac

if [ "$DRY" = 0 ]; then
    mkdir -p "$OUT_DIR" || { echo "gpu_check.sh: cannot create $OUT_DIR" >&2; exit 2; }
    OUT_DIR="$(cd "$OUT_DIR" && pwd)"
fi
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
PY=python3

DATA="${REPMLP_FMNIST_DIR:-}"
if [ -z "$DATA" ] && [ -d /usr/share/datasets/fashion-mnist ]; then DATA=/usr/share/datasets/fashion-mnist; fi

# The steps: name, time cap (s), command. --quick shrinks them for a CPU try of the script.
if [ "$QUICK" = 1 ]; then
    MAIN_EXTRA=(--train-limit 256 --val-limit 128 --epochs 1 --no-bench)
    TABLES_EXTRA=(--quick --rows RepMLP-FaceRes)
else
    MAIN_EXTRA=()
    TABLES_EXTRA=()
fi
MAIN_CMD=($PY -m repmlp train --device "$DEVICE" --data-dir "$DATA" --output "$OUT_DIR/main-job"
    ${MAIN_EXTRA[@]+"${MAIN_EXTRA[@]}"})
# The tier as TIER_SHARDS pytest processes side by side (benchmarks/pytest_shards.sh): its tests are mostly
# Python, subprocesses and compiles, which one process ran one after another (docs/gpu.md, run 2).
TIER_SHARDS=${GPU_CHECK_TIER_SHARDS:-8}
TIER_CMD=(bash benchmarks/pytest_shards.sh "$TIER_SHARDS" "$OUT_DIR/tier" -m cuda tests -p no:cacheprovider -v
    -rfE --durations=10)
TABLES_CMD=($PY -m repmlp tables --speed --device "$DEVICE" --precision fp32 fp16 --output "$OUT_DIR/speed-tables.md"
    ${TABLES_EXTRA[@]+"${TABLES_EXTRA[@]}"})
# The training step of ResNet-50, RepMLP-Res50 and Light (batch 128, 224x224, bf16 and fp32) and of the
# main job's model, as repmlp train runs them on one GPU (CUDA graphs); the deployed-model phase
# (--phase deploy, about 190 s of compiles) is run apart (docs/gpu.md).
BENCH_CMD=($PY benchmarks/bench_gpu.py --device "$DEVICE" --phase train --graphs-only --out "$OUT_DIR/bench"
    --budget-s 110 --build-s 60 --rounds 4 --round-s 0.15)
[ "$QUICK" = 1 ] && BENCH_CMD=($PY benchmarks/bench_gpu.py --device "$DEVICE" --phase train --quick
    --out "$OUT_DIR/bench" --rounds 2 --round-s 0.05)
# The image-folder pipeline (issue 43): an ImageNet-like JPEG folder written on every core, then the
# training and evaluation loaders on the device, decoded on the CPU (repmlp_res50's step beside it) and with
# nvJPEG (--gpu-decode, ResNet-50's step beside it); the steps as CUDA graphs come from `bench`.
FOLDER="${GPU_CHECK_FOLDER:-/tmp/gpu-check-imagenet-like}"
NPROC=$(getconf _NPROCESSORS_ONLN)
DATA_CMD=(bash -c "set -e; [ -d '$FOLDER/train' ] || $PY scripts/make_image_folder.py '$FOLDER' --train 2560 \
    --val 640 --jobs $NPROC; for v in cpu:repmlp_res50 gpu:resnet50; do extra=; [ \${v%%:*} = gpu ] && \
    extra=--gpu-decode; echo \"== decode on \${v%%:*}, \${v#*:}'s step\"; $PY benchmarks/bench_data.py '$FOLDER' \
    --device $DEVICE --model \${v#*:} --batch-size 128 --epochs 2 --steps 3 --limit 100 --quick \$extra; done")
[ "$QUICK" = 1 ] && DATA_CMD=(bash -c "set -e; $PY scripts/make_image_folder.py '$FOLDER' --train 64 --val 16 \
    --jobs 2; $PY benchmarks/bench_data.py '$FOLDER' --device $DEVICE --model resnet18 --img-size 32 \
    --batch-size 16 --epochs 1 --steps 1 --limit 8 --quick")
# torchrun with one process (NCCL on CUDA): a run stopped after 7 steps (checkpoints every 5) and resumed.
TR=($PY -m torch.distributed.run --standalone --nproc_per_node 1 -m repmlp train --device "$DEVICE"
    --data-dir "$DATA" --train-limit 2048 --val-limit 512 --epochs 2 --ckpt-every 5 --no-bench --no-export
    --output "$OUT_DIR/torchrun-run")
# The first run dies without cleanup after step 7 (tests/faults/sitecustomize.py: exit status 3, which
# torchrun reports in its failure summary before it exits 1); the second resumes it.
CRASH='PYTHONPATH="tests/faults:$PYTHONPATH" FAULT_STEP=7 "$@" 2>&1 | tee /dev/stderr | grep -q "exitcode *: 3"'
TORCHRUN_CMD=(bash -c "set -x; $CRASH || exit 1; \"\$@\" --resume" _ "${TR[@]}")
declare -A CAP=([main]=90 [data]=150 [torchrun]=90 [tier]=180 [tables]=240 [bench]=120)

declare -a NAMES STATUS TOOK
START=$(date +%s)

run_step() { # run_step NAME COMMAND...: under timeout, output to NAME.log; records status and seconds
    local name="$1"; shift
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=${CAP[$name]}
    [ "$left" -lt "$limit" ] && limit=$left
    NAMES+=("$name")
    if [ "$DRY" = 1 ]; then
        printf '%-7s timeout %4ss: %s\n' "$name" "${CAP[$name]}" "$*"
        STATUS+=("dry-run"); TOOK+=(0); return
    fi
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the ${BUDGET} s budget is spent" | tee "$OUT_DIR/$name.log"
        STATUS+=("skipped (no time left)"); TOOK+=(0); return
    fi
    echo "== $name (at most ${limit} s): $*"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    local took=$(($(date +%s) - t0))
    case $rc in
        0) STATUS+=("ok") ;;
        124 | 137) STATUS+=("TIMED OUT after ${limit} s") ;;
        *) STATUS+=("FAILED (exit $rc)") ;;
    esac
    TOOK+=("$took")
    echo "   ${STATUS[-1]}, ${took} s; log: $OUT_DIR/$name.log"
}

skip_step() { # skip_step NAME REASON
    NAMES+=("$1"); STATUS+=("skipped: $2"); TOOK+=(0)
    [ "$DRY" = 1 ] || echo "$2" >"$OUT_DIR/$1.log"
    echo "== $1: skipped: $2"
}

wanted() { [[ ",$ONLY," == *",$1,"* ]]; }

if [ "$DRY" = 0 ]; then
    {
        echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
        echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
        command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        $PY -c 'import sys, torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN",
            torch.backends.cudnn.version(), "Python", sys.version.split()[0], "GPU:", torch.cuda.is_available())' 2>&1
        echo "CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2 | sed 's/^ //'), $(getconf _NPROCESSORS_ONLN) cores"
    } >"$OUT_DIR/environment.txt" 2>&1
fi

if wanted main; then
    if [ -z "$DATA" ]; then skip_step main "no Fashion-MNIST: set REPMLP_FMNIST_DIR to the folder of its four IDX files"
    else run_step main "${MAIN_CMD[@]}"; fi
fi
if wanted data; then run_step data "${DATA_CMD[@]}"; fi
if wanted torchrun; then
    if [ -z "$DATA" ]; then skip_step torchrun "no Fashion-MNIST: set REPMLP_FMNIST_DIR"
    else run_step torchrun "${TORCHRUN_CMD[@]}"; fi
fi
if wanted bench; then run_step bench "${BENCH_CMD[@]}"; fi
if wanted tier; then
    if [ "$DEVICE" = cpu ]; then
        # On a CPU the tier's tests skip (no CUDA device): this only tries the step.
        run_step tier "${TIER_CMD[@]}"
    else
        REPMLP_FMNIST_DIR="$DATA" run_step tier "${TIER_CMD[@]}"
    fi
fi
if wanted tables; then run_step tables "${TABLES_CMD[@]}"; fi

[ "$DRY" = 1 ] && { echo "dry run: nothing ran; outputs would go to $OUT_DIR"; exit 0; }

# ---------------------------------------------------------------------------------------------- summary
{
    echo "# gpu_check summary ($(($(date +%s) - START)) s in all, budget ${BUDGET} s)"
    echo
    sed 's/^/    /' "$OUT_DIR/environment.txt"
    echo
    echo "| step | status | seconds |"
    echo "|---|---|---:|"
    for i in "${!NAMES[@]}"; do echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${TOOK[$i]} |"; done
    if [ -f "$OUT_DIR/main.log" ]; then
        echo; echo "## main job ($OUT_DIR/main-job)"; echo
        grep -E "^epoch [0-9]+/|\(training-time\) vs|run folder|error" "$OUT_DIR/main.log" | tail -n 8 | sed 's/^/    /'
    fi
    if [ -f "$OUT_DIR/tier.log" ]; then
        echo; echo "## CUDA tier"; echo
        for f in "$OUT_DIR"/tier-*.log; do
            [ -f "$f" ] || continue
            # A shard's result line, or what it had reported when the step was cut.
            last=$(grep -E "^=+ .*(passed|failed|skipped|error|no tests ran).* =+$" "$f" | tail -n 1)
            [ -n "$last" ] || last="cut: $(grep -c " PASSED" "$f") passed, $(grep -c " FAILED" "$f") failed so far"
            echo "    $(basename "$f" .log): $last"
            grep -E "^(FAILED|ERROR) " "$f" | sed 's/^/        /'
        done
    fi
    if [ -f "$OUT_DIR/speed-tables.md" ]; then
        echo; echo "## speed tables ($OUT_DIR/speed-tables.md)"; echo
        cat "$OUT_DIR/speed-tables.md"
    elif [ -f "$OUT_DIR/tables.log" ]; then
        echo; echo "## speed tables: rows measured before the step ended (tables.log)"; echo
        grep -E "^\[[0-9]+/[0-9]+\]|error" "$OUT_DIR/tables.log" | sed 's/^/    /'
    fi
    if [ -f "$OUT_DIR/data.log" ]; then
        echo; echo "## image-folder pipeline"; echo
        grep -E "^==|loader|step|bound|cores usable" "$OUT_DIR/data.log" | sed 's/^/    /'
    fi
    if [ -f "$OUT_DIR/torchrun.log" ]; then
        echo; echo "## torchrun, one process"; echo
        grep -E "^\+|epoch [0-9]+/|resum|stopp|error|Error" "$OUT_DIR/torchrun.log" | tail -n 12 | sed 's/^/    /'
    fi
    if [ -f "$OUT_DIR/bench.log" ]; then
        echo; echo "## training-step benchmark"; echo
        tail -n 25 "$OUT_DIR/bench.log" | sed 's/^/    /'
    fi
} >"$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"
for s in "${STATUS[@]}"; do
    case "$s" in ok | skipped*) ;; *) exit 1 ;; esac
done
exit 0
