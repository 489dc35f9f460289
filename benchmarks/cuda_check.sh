#!/usr/bin/env bash
# The CUDA checks in one run, for a GPU host (CI has none), in a few minutes:
#   1. the decode-graph and Hugging Face reference tests with the engine on the GPU;
#   2. decode throughput beside transformers on a random-weight twin of the
#      default model (shape_twin.py), with CUDA graphs, without, and in bfloat16;
#   3. a live server on the GPU under `kvserve bench`, with and without graphs
#      (CHECKS containing "profile" also samples the server with py-spy);
#   4. optional A/B of the Triton decode attention against the torch path
#      (KVSERVE_TORCH_ATTENTION=1): "long" offline at 2,000-token contexts,
#      "attention" on the live server's chat workload.
#
#   bash benchmarks/cuda_check.sh OUT_DIR      # PYTHON=... to pick the interpreter
#   CHECKS="tests attention long" bash benchmarks/cuda_check.sh OUT_DIR   # a subset
#
# Runs from a source checkout (PYTHONPATH=src) with whatever torch and
# transformers the host has; writes at most eight files into OUT_DIR.
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
KVSERVE_TEST_DEVICE=cuda timeout 300 $py -m pytest -p no:cacheprovider -x tests/test_triton_attention.py \
    tests/test_decode_graphs.py tests/test_model_reference.py tests/test_structured_outputs.py -k "not smollm2" 2>&1 | tail -8
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

if [[ $checks == *long* ]]; then
echo "== decode at 2,000-token contexts: Triton attention vs the torch path"
for name in triton torch; do
    [ $name = torch ] && export KVSERVE_TORCH_ATTENTION=1
    timeout 120 $py benchmarks/decode_throughput.py --model "$twin" --device cuda --skip-hf \
        --prompt-tokens 2000 --new-tokens 32 --batches 1 16 64 --kv-cache-memory 8GiB \
        --output "$out/decode_long_$name.json" 2>&1 | grep -E "^\| [0-9]"
    unset KVSERVE_TORCH_ATTENTION
done
fi

echo "== live server under kvserve bench"
run_bench() {  # name, extra `kvserve serve` flags, then bench flags
    local name=$1 serve_flags=$2; shift 2
    local spawn_args=(--spawn-arg=--model --spawn-arg="$twin" --spawn-arg=--kv-cache-memory --spawn-arg=4GiB)
    for arg in $serve_flags; do spawn_args+=(--spawn-arg="$arg"); done
    echo "-- $name: serve $serve_flags; bench $*"
    timeout 150 $py -m kvserve.cli bench --spawn "${spawn_args[@]}" "$@" --no-progress \
        --out "/tmp/kvserve-bench-$name" 2>&1 | tail -14
    cp "/tmp/kvserve-bench-$name/report.json" "$out/bench_$name.json" 2>/dev/null
}
chat=(--workload chat --rate 20 --num-requests 200)
# Few prefills: 64 streams of long outputs, so nearly every step is decode-only.
decode=(--workload "prompt=fixed:64;output=fixed:384" --concurrency 64 --num-requests 128)
if [[ $checks == *attention* ]]; then
    run_bench chat_triton "" "${chat[@]}"
    export KVSERVE_TORCH_ATTENTION=1
    run_bench chat_torch "" "${chat[@]}"
    unset KVSERVE_TORCH_ATTENTION
fi
[[ $checks == *server* ]] || exit 0
if [[ $checks == *profile* ]] && command -v py-spy >/dev/null; then
    (   # the server's threads for 10 s, from about 5 s into the chat run
        for _ in $(seq 120); do pid=$(pgrep -f "kvserve.cli serve" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
        sleep 15
        py-spy record -p "$pid" -d 10 -r 100 --threads -f raw -o "$out/server_profile.txt" --nonblocking
    ) &
fi
run_bench graphs "" "${chat[@]}"
wait
run_bench eager "--enforce-eager" "${chat[@]}"
run_bench decode_graphs "" "${decode[@]}"
run_bench decode_eager "--enforce-eager" "${decode[@]}"
