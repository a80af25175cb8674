#!/usr/bin/env bash
# The GPU checklist in one command, on a machine with one CUDA GPU: every figure of docs/gpu.md.
#
#   bench/gpu.sh OUT_DIR [CORPUS_DIR]     (GPU_BUDGET_S: seconds for all of it, default 570)
#
# CORPUS_DIR is a directory of text files (one document each) that both the GPU runs and a CPU
# reference run train on, so their validation losses can be compared (the embedded default trains on
# the Python standard library, which differs between Python versions). Each part runs under its own time
# limit and logs to OUT_DIR/log.txt; a part that fails or runs out of time does not stop the others, and
# no part starts past the budget. Runs from the repository root without installing megascale
# (PYTHONPATH), so it also serves a machine whose torch is older than pyproject's. docs/gpu.md holds
# what it measured.
set -u
out=${1:?usage: bench/gpu.sh OUT_DIR [CORPUS]}
corpus=${2:+$(realpath "$2")}
mkdir -p "$out"
budget=${GPU_BUDGET_S:-570}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="$out/log.txt"
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, its output into the log
    local name=$1 seconds=$2
    shift 2
    local left=$((budget - SECONDS - 5))
    if [ "$left" -lt 15 ]; then
        echo "=== $name: skipped, out of time" >>"$log"
        return
    fi
    [ "$seconds" -gt "$left" ] && seconds=$left
    echo "=== $name: $*" >>"$log"
    local started=$SECONDS
    timeout -k 10 "$seconds" "$@" >>"$log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - started)) s" >>"$log"
}

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} >>"$log" 2>&1

# 1. `megascale train` with no flags: device, backend and precision chosen by megascale; then on CORPUS in
#    float32 (the CPU reference's settings), bfloat16, and bfloat16 compiled.
part train-default 120 python3 -m megascale.cli train --training.run_dir="$runs/default" --metrics.progress=false
train_on_corpus() {  # train_on_corpus NAME OVERRIDES...
    local name=$1
    shift
    part "train-corpus-$name" 100 python3 -m megascale.cli train --data.source="$corpus" \
        --training.run_dir="$runs/$name" --metrics.progress=false "$@"
}
if [ -n "$corpus" ]; then
    train_on_corpus fp32
    train_on_corpus bf16-compile --training.dtype=bfloat16 --training.compile=true
fi

# 2. MFU of a ~1B Llama against Hugging Face's, side by side, compiled, bf16.
part throughput 200 python3 bench/throughput.py --device cuda --compile --hf-fused --models 1b --dtypes bfloat16 \
    --steps 10 --warmup 3 ${corpus:+--set data.source="$corpus"} --out "$out/throughput.json"

# 5. The MoE layer's grouped GEMM on the GPU.
part moe 60 python3 bench/moe.py --device cuda --dtype bfloat16 --repeats 20 --out "$out/moe.json"
part kernel-efficiency 60 python3 bench/kernel_efficiency.py --device cuda --repeats 10 --out "$out/kernel_efficiency.json"

# 4. The timeline's cost with device events.
part timeline 80 python3 bench/observe_overhead.py --device cuda --ranks 1 --parts timeline \
    --timeline-blocks 20 --out "$out/observe.json"

# 3. Two-stage checkpoint: stage-1 stall against a synchronous DCP save, and recovery after a kill.
part checkpoint 120 python3 bench/checkpoint.py --device cuda --layout 1x1 --parts stall,recovery \
    --gib 1 --rounds 3 --out "$out/checkpoint.json"

# 5. Float8 (needs torchao, which the GPU image lacks: carry its wheel and put it on PYTHONPATH): GEMMs and
#    linear layers against bfloat16, then the 1B Llama's step with float8 linear layers.
part fp8-linear 150 python3 bench/fp8_linear.py --device cuda --out "$out/fp8_linear.json"
part throughput-fp8 200 python3 bench/throughput.py --device cuda --compile --hf-fused --models 1b --dtypes bfloat16 \
    --steps 8 --warmup 3 --set training.fp8=tensorwise --out "$out/throughput_fp8.json"

# 1, continued: bfloat16 without compiling.
[ -n "$corpus" ] && train_on_corpus bf16 --training.dtype=bfloat16
