#!/usr/bin/env bash
# The CUDA check, for a machine with an NVIDIA GPU and this repo's dependencies already
# installed (it installs nothing). Runs the CUDA tests (`-m cuda`: the engine and the
# embedding model on the GPU against the CPU), a short throughput benchmark and the embedding
# batching benchmark on the GPU; the timeouts add up to under 8 minutes.
# Results go to $OUT (or ./gpu_check_out) as logs and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$out/gpu.txt"
rc=0
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/cuda_tests.log" || rc=1
for dtype in bfloat16 float32; do  # the CUDA default, then the CPU's format for comparison
    timeout 85 python benchmarks/throughput.py --device cuda --dtype $dtype --num-requests 64 --max-num-seqs 64 \
        --skip-hf-single --skip-hf-static --skip-hf-cb --skip-roofline --skip-llamacpp --profile \
        --json "$out/throughput_cuda_$dtype.json" 2>&1 | tee "$out/throughput_cuda_$dtype.log" || rc=1
done
timeout 90 python benchmarks/embeddings.py --device cuda --concurrency 1 16 64 --requests 128 \
    --json "$out/embeddings_cuda.json" 2>&1 | tee "$out/embeddings_cuda.log" || rc=1
exit $rc
