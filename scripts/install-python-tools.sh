#!/usr/bin/env bash
# Installs the Python packages volt's tests and scripts read its files with, from PyPI, into a virtual environment
# that later runs reuse, and prints that environment's python:
#   tensorboard  reads TensorBoardLogger's event files back in the tests (it shares no code with volt)
#   matplotlib   draws a run's curves from its metrics.csv (scripts/plot_metrics.py)
# The environment lives in $VOLT_TOOLS_VENV (default ~/.cache/volt/python-tools); about 60 MB to download.
set -euo pipefail
source "$(dirname "$0")/python-venv.sh"
venv=${VOLT_TOOLS_VENV:-$HOME/.cache/volt/python-tools}
volt_venv "$venv"
if ! "$venv/bin/python" -c 'import tensorboard, matplotlib' 2>/dev/null; then
  echo "volt: installing tensorboard and matplotlib into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --progress-bar off tensorboard matplotlib >&2
fi
echo "$venv/bin/python"
