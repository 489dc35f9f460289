#!/usr/bin/env bash
# The CUDA checks in one run, for a GPU host (CI has none), in a few minutes:
#   1. the decode-graph and Hugging Face reference tests with the engine on the GPU;
#   2. decode throughput beside transformers on a random-weight twin of the
#      default model (shape_twin.py), with CUDA graphs, without, and in bfloat16;
#   3. a live server on the GPU under `kvserve bench`, with and without graphs.
#
#   bash benchmarks/cuda_check.sh OUT_DIR      # PYTHON=... to pick the interpreter
#   CHECKS="decode server" bash benchmarks/cuda_check.sh OUT_DIR   # a subset
#
# Runs from a source checkout (PYTHONPATH=src) with whatever torch and
# transformers the host has; writes six files into OUT_DIR.
set -u
out=${1:?usage: cuda_check.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
twin=${TWIN:-/tmp/kvserve-twin}
checks=${CHECKS:-tests decode server}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

[ -f "$twin/model.safetensors" ] || $py benchmarks/shape_twin.py "$twin"

if [[ $checks == *tests* ]]; then
echo "== tests with the engine on CUDA"
KVSERVE_TEST_DEVICE=cuda timeout 300 $py -m pytest -p no:cacheprovider -x \
    tests/test_decode_graphs.py tests/test_model_reference.py -k "not smollm2" 2>&1 | tail -8
fi

if [[ $checks == *decode* ]]; then
echo "== decode throughput (random-weight twin of SmolLM2-135M)"
for variant in "graphs" "eager --enforce-eager" "bf16 --dtype bfloat16"; do
    set -- $variant
    name=$1; shift
    echo "-- $name $*"
    timeout 240 $py benchmarks/decode_throughput.py --model "$twin" --device cuda "$@" \
        --output "$out/decode_cuda_$name.json" 2>&1 | tail -11
done
fi

[[ $checks == *server* ]] || exit 0
echo "== live server under kvserve bench"
for variant in "graphs" "eager --enforce-eager"; do
    set -- $variant
    name=$1; shift
    spawn_args=(--spawn-arg=--model --spawn-arg="$twin" --spawn-arg=--kv-cache-memory --spawn-arg=4GiB)
    for arg in "$@"; do spawn_args+=(--spawn-arg="$arg"); done
    echo "-- $name $*"
    timeout 150 $py -m kvserve.cli bench --spawn "${spawn_args[@]}" --workload chat --rate 20 \
        --num-requests 200 --no-progress --out "/tmp/kvserve-bench-$name" 2>&1 | tail -25
    cp "/tmp/kvserve-bench-$name/report.json" "$out/bench_$name.json" 2>/dev/null
done
