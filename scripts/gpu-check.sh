#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds everything with CUDA and NCCL against pip's torch (the python3 on PATH
# must import a CUDA build of torch), runs the whole test suite (the gpu-labelled tests included) and the GPU
# benchmarks and the quick start on the GPU, and prints a one-screen summary. Exits non-zero if anything failed.
#
#   bash scripts/gpu-check.sh [--deps DIR] [--data-dir DIR] [--build DIR] [--jobs N] [--label L] [--with-compile-fail]
#
# --deps DIR      .deb files of Boost.MPI/Serialization 1.74 and Catch2 2.13 for a host that lacks them (fetch them
#                 on a Debian 12 machine with `apt-get download libboost-mpi1.74.0 libboost-mpi1.74-dev
#                 libboost-serialization1.74.0 libboost-serialization1.74-dev libboost1.74-dev catch2
#                 nlohmann-json3-dev`); unpacked into /opt/volt-deps, never into /, so that the host's own Open
#                 MPI stays in charge.
# --data-dir DIR  the four Fashion-MNIST *-ubyte.gz files (default /usr/share/datasets/fashion-mnist); without
#                 them the quick start is skipped.
# --label L       run only the tests labelled L (gpu: those that need the device; the whole suite takes longer than
#                 one 10-minute call there)
# --with-compile-fail  also run the compile-fail tests (compiler checks, already run on every CPU lane).
set -uo pipefail
cd "$(dirname "$0")/.."
deps="" data=/usr/share/datasets/fashion-mnist build=build-gpu jobs=$(nproc) compile_fail=0 label=""
while [ $# -gt 0 ]; do
  case "$1" in
    --deps) deps=$2; shift 2 ;;
    --data-dir) data=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --label) label=$2; shift 2 ;;
    --with-compile-fail) compile_fail=1; shift ;;
    *) echo "usage: see the top of scripts/gpu-check.sh" >&2; exit 2 ;;
  esac
done
log=$build/gpu-check-logs
mkdir -p "$log"
data=$(cd "$data" 2>/dev/null && pwd || echo "$data")

torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) || {
  echo "gpu-check: python3 cannot import torch; run it where pip's torch (with CUDA) is installed" >&2; exit 1; }
torch_info=$(python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>/dev/null)
prefix="$torch_dir"
args=(-DCMAKE_BUILD_TYPE=Release -DVOLT_FASHION_MNIST_DIR="$data")
if [ -n "$deps" ]; then
  mkdir -p /opt/volt-deps
  for f in "$deps"/*.deb; do dpkg -x "$f" /opt/volt-deps; done
  prefix="$prefix;/opt/volt-deps/usr"
  args+=(-DBoost_ROOT=/opt/volt-deps/usr -DBoost_NO_SYSTEM_PATHS=ON
         -DBoost_DIR=/opt/volt-deps/usr/lib/x86_64-linux-gnu/cmake/Boost-1.74.0)
  export LD_LIBRARY_PATH=/opt/volt-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# Ninja when there is one, for a new build folder (an existing one keeps its generator).
command -v ninja >/dev/null && [ ! -f "$build/CMakeCache.txt" ] && args+=(-G Ninja)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

t0=$(date +%s)
cmake -S . -B "$build" "${args[@]}" -DCMAKE_PREFIX_PATH="$prefix" > "$log/configure.txt" 2>&1 || {
  tail -30 "$log/configure.txt"; echo "gpu-check: configure FAILED" >&2; exit 1; }
cmake --build "$build" -j"$jobs" > "$log/build.txt" 2>&1 || {
  grep -E "error|Error" "$log/build.txt" | head -30; echo "gpu-check: build FAILED" >&2; exit 1; }
t_build=$(( $(date +%s) - t0 ))

ctest_filter=()
[ "$compile_fail" = 1 ] || ctest_filter=(-LE compile_fail)
[ -z "$label" ] || ctest_filter+=(-L "$label")
t1=$(date +%s)
ctest --test-dir "$build" -j6 --output-on-failure "${ctest_filter[@]}" > "$log/ctest.txt" 2>&1
ctest_rc=$?
t_test=$(( $(date +%s) - t1 ))

bench_rc=0
"$build/bench/trainer_vs_raw" --device cuda > "$log/bench_trainer_vs_raw.jsonl" 2> "$log/bench_trainer_vs_raw.err" || bench_rc=1
"$build/bench/optim" --device cuda > "$log/bench_optim.jsonl" 2> "$log/bench_optim.err" || bench_rc=1
"$build/bench/graph" > "$log/bench_graph.jsonl" 2> "$log/bench_graph.err" || bench_rc=1
"$build/bench/graph" --workload cnn --cudnn-benchmark --channels-last >> "$log/bench_graph.jsonl" 2>> "$log/bench_graph.err" || bench_rc=1
quick_rc=0
"$build/examples/quickstart" --run.device=cuda --data.dir="$data" --trainer.default_root_dir="$build/quickstart_gpu" > "$log/quickstart.txt" 2>&1 || quick_rc=$?

echo
echo "================ volt GPU check ================"
echo "host:     $(hostname), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
echo "torch:    $torch_info ($torch_dir)"
echo "NCCL:     $(grep -E '^VOLT_NCCL_LIBRARY:' "$build/CMakeCache.txt" | cut -d= -f2)"
echo "build:    ${t_build} s; tests: ${t_test} s"
grep -E "tests passed|tests failed" "$log/ctest.txt"
grep -E "\*\*\*(Failed|Exception|Timeout)|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Not Run|\*\*\*Skipped" "$log/ctest.txt" | sed 's/^ */  /'
echo "gpu-labelled tests:"
grep -E "Test +#[0-9]+: (gpu|gpu\.[a-z_]+) " "$log/ctest.txt" | sed 's/^ */  /'
echo "trainer_vs_raw --device cuda (median step times, ratio = volt / hand-written):"
sed 's/^/  /' "$log/bench_trainer_vs_raw.jsonl"
echo "optim --device cuda (median steps/s, ratio = volt::optim / torch::optim):"
sed 's/^/  /' "$log/bench_optim.jsonl"
echo "graph (median steps/s of hand-written and volt loops, eager, fused and graphed; the ratios the goals name; the CNN again with cuDNN's autotuner and channels-last):"
sed 's/^/  /' "$log/bench_graph.jsonl"
[ $bench_rc = 0 ] || { echo "  FAILED:"; tail -5 "$log/bench_trainer_vs_raw.err" "$log/bench_optim.err" "$log/bench_graph.err"; }
echo "quick start --run.device=cuda:"
if [ $quick_rc = 77 ]; then echo "  skipped: no Fashion-MNIST in $data (pass --data-dir)"; else
  grep -E "^device|training took|test accuracy" "$log/quickstart.txt" | sed 's/^/  /'
  [ $quick_rc = 0 ] || { echo "  FAILED (exit $quick_rc):"; tail -5 "$log/quickstart.txt"; }
fi
echo "logs:     $log"
status=0
[ $ctest_rc = 0 ] && [ $bench_rc = 0 ] && { [ $quick_rc = 0 ] || [ $quick_rc = 77 ]; } || status=1
[ $status = 0 ] && echo "RESULT: no failure" || echo "RESULT: FAILURES (see above)"
exit $status
