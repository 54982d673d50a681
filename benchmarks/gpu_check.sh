#!/usr/bin/env bash
# The GPU device check for plait's kernels: one command, under 8 minutes on one GPU.
# Runs the `gpu` kernel tests, times every kernel against its torch reference, reports decode
# attention bandwidth against device copy bandwidth at 32k contexts, and an end-to-end decode
# benchmark with CUDA graphs on and off. Prints tables; writes JSON (default
# bench-results/gpu_check.json). Extra arguments go to gpu_check.py (--out, --budget-s,
# --skip-tests, --skip-e2e, --dry-run). Sections that would start past --budget-s (360 s) are
# skipped, and the JSON is rewritten after every section, so a run cut short keeps its results.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
else
  py=python3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$py" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
exec timeout 470 "$py" -m plait.benchmarks.gpu_check "$@"
