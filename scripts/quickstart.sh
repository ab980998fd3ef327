#!/usr/bin/env bash
# Installs what is missing, builds the quick-start example and trains it on Fashion-MNIST.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2 --target quickstart
./build/examples/quickstart "$@"
