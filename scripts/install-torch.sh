#!/usr/bin/env bash
# Installs pip's torch (LibTorch 2.x with CUDA: headers, libraries, TorchConfig.cmake) into a virtual environment
# that later runs reuse, with safetensors and NumPy (the tests read volt's weights files with them), and prints the
# LibTorch folder to put on CMAKE_PREFIX_PATH.
#   bash scripts/install-torch.sh [VERSION]     VERSION: 2.11 (default) or a full pip version such as 2.11.0
# The environment lives in $VOLT_TORCH_VENV (default ~/.cache/volt/torch-VERSION). The wheel and its CUDA
# libraries are about 2.7 GB to download (4.6 GB installed). Building against it needs the CUDA toolkit
# (nvcc; /usr/local/cuda or CUDA_HOME), which its TorchConfig.cmake looks for; running needs no GPU.
set -euo pipefail
source "$(dirname "$0")/python-venv.sh"
version=${1:-2.11}
[[ "$version" =~ ^[0-9]+\.[0-9]+$ ]] && version="$version.0"
venv=${VOLT_TORCH_VENV:-$HOME/.cache/volt/torch-$version}
torch_dir() { "$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null; }
have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$version" ]; then
  volt_venv "$venv"
  echo "volt: installing torch==$version into $venv (about 2.7 GB to download)" >&2
  "$venv/bin/python" -m pip install --quiet --progress-bar off "torch==$version" >&2
fi
# safetensors' torch writer (save_file) goes through NumPy since safetensors 0.8, and pip's torch does not bring it.
if ! "$venv/bin/python" -c 'import safetensors, numpy' 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet --progress-bar off safetensors numpy >&2
fi
# transformers, the GPT-2 test's independent side (test/gpt2_check.py): pinned, so a new release cannot change a landing.
if [ "$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)" != "5.24.0" ]; then
  "$venv/bin/python" -m pip install --quiet --progress-bar off "transformers==5.24.0" >&2
fi
torch_dir
