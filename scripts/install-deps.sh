#!/usr/bin/env bash
# Installs what volt needs from Debian 12's packages, if it is missing. Runs as root without prompts
# (or through sudo when not root). `--tests` adds what only the test suite needs: Python's torch, which
# reads volt's checkpoints in one test, the reference BLAS, which one test runs a fit on, and SLURM with munge and
# iproute2, which the cluster tests run their emulated hosts on (test/cluster/). `--fuzz` adds clang and libFuzzer
# (scripts/fuzz.sh); `--ci` adds ccache (.ci/run).
#
# libopenblas0-openmp: Debian's libtorch-dev does its matrix products (linear layers, matmul, im2col convolutions)
# through the `libblas.so.3` alternative, which with nothing else installed is the reference BLAS (libblas3,
# unoptimised Fortran, 10-15x slower on an MLP's step). OpenBLAS registers itself as that alternative with a higher
# priority. Its OpenMP build runs on the same OpenMP runtime as LibTorch (libgomp), so a product called inside one of
# LibTorch's parallel regions does not start a second team of threads (the pthread build would oversubscribe).
# libcurl4-openssl-dev: the HTTP client of volt::MLFlowLogger (the volt::mlflow target; nothing else links it).
set -euo pipefail
packages=(g++ make cmake libtorch-dev libopenblas0-openmp libboost-mpi-dev openmpi-bin catch2 zlib1g-dev
          nlohmann-json3-dev libpng-dev libcurl4-openssl-dev dataset-fashion-mnist)
case "${1:-}" in
  # libblas3: a test forces the reference BLAS to see the notice; SLURM's daemons and commands, munge, iproute2 (ip
  # netns) and util-linux (unshare, nsenter): the cluster of emulated hosts
  --tests) packages+=(python3 python3-torch libblas3 slurmctld slurmd slurm-client munge iproute2 util-linux) ;;
  --fuzz) packages+=(clang libfuzzer-14-dev) ;;  # scripts/fuzz.sh: clang's libFuzzer and sanitizers
  --ci) packages+=(ccache) ;;  # .ci/run: the compiler cache every lane compiles through
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
