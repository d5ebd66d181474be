#!/usr/bin/env bash
# The CUDA check, for a machine with an NVIDIA GPU and this repo's dependencies already
# installed (it installs nothing; Triton comes with CUDA builds of torch). Runs the CUDA tests
# (`-m cuda`: the engine, the float16 format, swaps, torch_compile and the embedding model on the
# GPU against the CPU; the real model against transformers; the Triton paged-decode attention
# backend, compiled, against SDPA and a float64 reference, tests/models/test_triton_decode.py; the
# engine's tokens with it registered as CUDA's default, tests/engine/test_cuda.py), a short throughput
# benchmark (eager and torch_compile; SDPA, CUDA's default), the decode-attention microbenchmark (Triton against SDPA, benchmarks/paged_decode.py) and
# the embedding batching benchmark on the GPU; the timeouts add up to under 8 minutes (475 s).
#
#   scripts/gpu_check.sh [all|tests|bench]     (default: all)
#
# Results go to $OUT (or ./gpu_check_out) as logs and JSON. $PYTHON picks the interpreter
# (default: python, else python3). Only the test files that hold CUDA tests are collected, so
# the optional extras (server, Ray, Discord) need not be installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
stage="${1:-all}"
case "$stage" in all|tests|bench) ;; *) echo "usage: $0 [all|tests|bench] (got '$stage')" >&2; exit 2;; esac
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
py="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" \
    | tee -a "$out/gpu.txt"
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device here; nothing to check" >&2
    exit 1
fi
rc=0
if [[ $stage == all || $stage == tests ]]; then
    mapfile -t files < <(grep -rl "pytest.mark.cuda" tests --include='test_*.py' | sort)
    timeout 135 "$py" -m pytest -q -m cuda -p no:cacheprovider -rs "${files[@]}" 2>&1 | tee "$out/cuda_tests.log" \
        || rc=1
fi
if [[ $stage == all || $stage == bench ]]; then
    # The CUDA default (bfloat16), eager and with torch_compile=True side by side; then float32.
    timeout 160 "$py" benchmarks/throughput.py --device cuda --dtype bfloat16 --num-requests 64 --max-num-seqs 64 \
        --skip-hf-single --skip-hf-static --skip-hf-cb --skip-roofline --skip-llamacpp --profile --compile \
        --json "$out/throughput_cuda_bfloat16.json" 2>&1 | tee "$out/throughput_cuda_bfloat16.log" || rc=1
    timeout 85 "$py" benchmarks/throughput.py --device cuda --dtype float32 --num-requests 64 --max-num-seqs 64 \
        --skip-hf-single --skip-hf-static --skip-hf-cb --skip-roofline --skip-llamacpp --profile \
        --json "$out/throughput_cuda_float32.json" 2>&1 | tee "$out/throughput_cuda_float32.log" || rc=1
    timeout 25 "$py" benchmarks/paged_decode.py --device cuda --json "$out/paged_decode_cuda.json" 2>&1 \
        | tee "$out/paged_decode_cuda.log" || rc=1
    timeout 70 "$py" benchmarks/embeddings.py --device cuda --concurrency 1 16 64 --requests 128 \
        --json "$out/embeddings_cuda.json" 2>&1 | tee "$out/embeddings_cuda.log" || rc=1
fi
exit $rc
