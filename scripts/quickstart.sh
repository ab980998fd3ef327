#!/usr/bin/env bash
# Installs what is missing, builds the quick-start example and trains it on Fashion-MNIST.
# Arguments go to the program: `bash scripts/quickstart.sh --trainer.max_epochs=1` (`--help` lists them all).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j2 --target quickstart
# Debian's LibTorch 1.13 counts the cores low on some virtual machines and would run one thread: run as many as this
# process may use, the count volt's own notice advises, unless the caller chose one.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
./build/examples/quickstart "$@"
