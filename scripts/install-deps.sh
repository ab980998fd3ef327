#!/usr/bin/env bash
# Installs what volt needs from Debian 12's packages, if it is missing. Runs as root without prompts
# (or through sudo when not root). `--tests` adds what only the test suite needs: Python's torch, which
# reads volt's checkpoints in one test. `--fuzz` adds clang and libFuzzer (scripts/fuzz.sh).
set -euo pipefail
packages=(g++ make cmake libtorch-dev libboost-mpi-dev openmpi-bin catch2 zlib1g-dev libpng-dev dataset-fashion-mnist)
case "${1:-}" in
  --tests) packages+=(python3 python3-torch) ;;
  --fuzz) packages+=(clang libfuzzer-14-dev) ;;  # scripts/fuzz.sh: clang's libFuzzer and sanitizers
esac
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "volt: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq "${missing[@]}"
