#!/usr/bin/env bash
# Installs the Python packages volt's tests and scripts read its files with, from PyPI, into a virtual environment
# that later runs reuse, and prints that environment's python:
#   tensorboard  reads TensorBoardLogger's event files back in the tests (it shares no code with volt)
#   matplotlib   draws a run's curves from its metrics.csv (scripts/plot_metrics.py)
#   pyyaml       reads the loggers' hparams.yaml back in the tests
# The environment lives in $VOLT_TOOLS_VENV (default ~/.cache/volt/python-tools); about 60 MB to download.
#   --debian-torch: instead, an environment over Debian's /usr/bin/python3 that sees its packages (python3-torch)
#                   and has safetensors from PyPI, for the tests that read volt's files with Python's torch
#                   ($VOLT_DEBIAN_TORCH_VENV, default ~/.cache/volt/python-debian-torch); prints its python.
#   --mlflow:       instead, an environment with MLflow 3.17.2 (its tracking server and Python client: the MLflow
#                   logger's test starts one; $VOLT_MLFLOW_VENV, default ~/.cache/volt/python-mlflow, about 850 MB);
#                   prints its python, or nothing (and a line on stderr) where it cannot be installed.
set -euo pipefail
source "$(dirname "$0")/python-venv.sh"
if [ "${1:-}" = "--debian-torch" ]; then
  venv=${VOLT_DEBIAN_TORCH_VENV:-$HOME/.cache/volt/python-debian-torch}
  volt_venv "$venv" /usr/bin/python3 --system-site-packages
  if ! "$venv/bin/python" -c 'import safetensors' 2>/dev/null; then
    echo "volt: installing safetensors into $venv" >&2
    "$venv/bin/python" -m pip install --quiet --progress-bar off safetensors >&2
  fi
  echo "$venv/bin/python"
  exit 0
fi
if [ "${1:-}" = "--mlflow" ]; then
  venv=${VOLT_MLFLOW_VENV:-$HOME/.cache/volt/python-mlflow}
  volt_venv "$venv"
  if ! "$venv/bin/python" -c 'import mlflow, yaml; assert mlflow.__version__ == "3.17.2"' 2>/dev/null; then
    echo "volt: installing mlflow 3.17.2 into $venv" >&2
    if ! "$venv/bin/python" -m pip install --quiet --progress-bar off mlflow==3.17.2 pyyaml >&2; then
      echo "volt: mlflow could not be installed; the MLflow logger's test will be skipped" >&2
      exit 0
    fi
  fi
  echo "$venv/bin/python"
  exit 0
fi
venv=${VOLT_TOOLS_VENV:-$HOME/.cache/volt/python-tools}
volt_venv "$venv"
if ! "$venv/bin/python" -c 'import tensorboard, matplotlib, yaml' 2>/dev/null; then
  echo "volt: installing tensorboard, matplotlib and pyyaml into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --progress-bar off tensorboard matplotlib pyyaml >&2
fi
echo "$venv/bin/python"
