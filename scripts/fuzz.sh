#!/usr/bin/env bash
# Fuzzes what reads checkpoints for a fixed time: builds test/fuzz/checkpoint_fuzz.cpp with clang, libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer against pip's LibTorch 2.11 (Debian's 1.13 headers do not build
# with clang in C++20), in build-fuzz/; writes a seed corpus of real checkpoints,
# replays every kept finding (test/fuzz/regressions/<mode>/), then fuzzes each mode for the given time.
#   bash scripts/fuzz.sh [--seconds N] [--runs N]   (per mode: at most N seconds, default 60, and N inputs)
# Ends non-zero on a finding; libFuzzer leaves the input that shows it in build-fuzz/fuzz-work/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=60
runs_cap=
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --seconds=*) seconds=${1#--seconds=}; shift ;;
    --runs) runs_cap=$2; shift 2 ;;
    *) echo "volt: scripts/fuzz.sh takes --seconds N and --runs N; got '$1'." >&2; exit 2 ;;
  esac
done
bash scripts/install-deps.sh --tests
bash scripts/install-deps.sh --fuzz
if ! command -v nvcc >/dev/null && [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
  echo "volt: scripts/fuzz.sh builds against pip's LibTorch 2.11, whose CMake files need the CUDA toolkit (nvcc);" \
       "none was found on PATH or in ${CUDA_HOME:-/usr/local/cuda}." >&2
  exit 1
fi
torch_dir=$(bash scripts/install-torch.sh 2.11)
build=build-fuzz
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ -DVOLT_FUZZ=ON \
      -DVOLT_BUILD_BENCH=OFF -DVOLT_BUILD_EXAMPLES=OFF -DCMAKE_PREFIX_PATH="$torch_dir" >/dev/null
cmake --build "$build" -j2 --target fuzz_checkpoint
fuzz=$PWD/$build/test/fuzz/fuzz_checkpoint
work=$PWD/$build/fuzz-work
rm -rf "$work"
mkdir -p "$work/seeds" "$work/bytes" "$work/fields" "$work/safetensors"
# LibTorch keeps allocations for the process's life; leaks are not what this looks for.
# (protect_shadow_gap=0: the CUDA libraries LibTorch loads map memory there.)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:protect_shadow_gap=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
VOLT_FUZZ_WRITE_SEEDS="$work/seeds" "$fuzz"
cp "$work/seeds"/*.ckpt "$work/bytes/"
cp "$work/seeds"/*.safetensors "$work/safetensors/"
export VOLT_FUZZ_SEEDS="$work/seeds"
for mode in bytes fields safetensors; do
  kept=(test/fuzz/regressions/$mode/*)
  if [ -e "${kept[0]}" ]; then
    echo "volt: replaying ${#kept[@]} kept $mode inputs"
    if ! VOLT_FUZZ_MODE=$mode "$fuzz" "${kept[@]}" >"$work/replay-$mode.log" 2>&1; then
      tail -n 40 "$work/replay-$mode.log" >&2
      echo "volt: a kept $mode input (test/fuzz/regressions/$mode/) faults again." >&2
      exit 1
    fi
  fi
done
summary=()
for mode in bytes fields safetensors; do
  log=$work/$mode.log
  status=0
  # A fixed seed: the inputs are the same sequence on every run, so a CI run repeats what was fuzzed before it
  # (up to --runs, when given) instead of drawing new ones.
  (cd "$work" && VOLT_FUZZ_MODE=$mode "$fuzz" -seed=1 -max_total_time="$seconds" ${runs_cap:+-runs=$runs_cap} \
      -print_final_stats=1 -rss_limit_mb=4096 "$mode") >"$log" 2>&1 || status=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ "$status" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "volt: fuzzing the $mode mode found a fault after ${runs:-?} inputs (log: $log; input: $work/crash-*)." >&2
    exit 1
  fi
  summary+=("$mode: ${runs:-?} inputs, corpus $(ls "$work/$mode" | wc -l) files")
done
echo "volt: fuzzed at most ${seconds} s${runs_cap:+ or $runs_cap inputs} per mode, no finding: ${summary[*]}"
