#!/usr/bin/env bash
# The CUDA check, for a machine with an NVIDIA GPU and this repo's dependencies already
# installed (it installs nothing). Runs the CUDA tests, the CPU suite's fast parts on the
# same machine, and a short throughput benchmark on the GPU; finishes well within 8 minutes.
# Results go to $OUT (or ./gpu_check_out) as logs and JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())" | tee -a "$out/gpu.txt"
rc=0
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tee "$out/cuda_tests.log" || rc=1
timeout 200 python benchmarks/throughput.py --device cuda --dtype float32 --num-requests 64 --max-num-seqs 64 \
    --skip-hf-single --skip-hf-static --skip-hf-cb --skip-roofline --json "$out/throughput_cuda.json" 2>&1 \
    | tee "$out/throughput_cuda.log" || rc=1
exit $rc
