#!/usr/bin/env bash
# Installs pip's torch (LibTorch 2.x with CUDA: headers, libraries, TorchConfig.cmake) into a virtual environment
# that later runs reuse, and prints the LibTorch folder to put on CMAKE_PREFIX_PATH.
#   bash scripts/install-torch.sh [VERSION]     VERSION: 2.11 (default) or a full pip version such as 2.11.0
# The environment lives in $VOLT_TORCH_VENV (default ~/.cache/volt/torch-VERSION). The wheel and its CUDA
# libraries are about 2.7 GB to download (4.6 GB installed). Building against it needs the CUDA toolkit
# (nvcc; /usr/local/cuda or CUDA_HOME), which its TorchConfig.cmake looks for; running needs no GPU.
set -euo pipefail
version=${1:-2.11}
[[ "$version" =~ ^[0-9]+\.[0-9]+$ ]] && version="$version.0"
venv=${VOLT_TORCH_VENV:-$HOME/.cache/volt/torch-$version}
torch_dir() { "$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null; }
have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$version" ]; then
  python=$(command -v python3 || true)
  [ -n "$python" ] || { echo "volt: python3 is needed to install pip's torch (apt-get install python3 python3-venv)" >&2; exit 1; }
  if [ ! -x "$venv/bin/python" ]; then
    mkdir -p "$(dirname "$venv")"
    if ! "$python" -m venv "$venv" >/dev/null 2>&1; then
      rm -rf "$venv"
      echo "volt: installing python3-venv" >&2
      sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
      $sudo apt-get update -qq >&2
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-venv >&2
      /usr/bin/python3 -m venv "$venv"
    fi
  fi
  echo "volt: installing torch==$version into $venv (about 2.7 GB to download)" >&2
  "$venv/bin/python" -m pip install --quiet --progress-bar off "torch==$version" >&2
fi
torch_dir
