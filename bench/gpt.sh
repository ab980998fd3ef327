#!/usr/bin/env bash
# The GPT benchmark: the GPT example's model and recipe trained for STEPS steps on the CPU by volt
# (build/bench/gpt_bench) and by PyTorch 2.11 (bench/gpt_torch.py: eager, torch.utils.checkpoint, Lightning) from the
# same initial weights on the same batches, in interleaved rounds, one process per run. Prints each run's JSON line,
# then a summary line with the medians and ratios: tokens/s volt / PyTorch eager and volt / Lightning (> 1: volt is
# faster), with activation checkpointing volt / PyTorch's torch.utils.checkpoint, what checkpointing every block costs
# in step time and saves in activation memory, and the validation losses after STEPS steps.
# Activation memory: a last round of 12 steps per run with glibc's mmap threshold fixed at 64 KiB, so that every
# tensor's buffer is mapped when made and unmapped when freed and resident memory follows live memory (with glibc's
# default, freed buffers mostly stay resident, as train_rss_rise_mib shows); its figure is the peak of resident memory
# during steps 2-12 above the memory after step 1 (weights, gradients, the optimizer's state): the activations' peak.
#   bash bench/gpt.sh BUILD_DIR [ROUNDS] [STEPS]     (BUILD_DIR: a LibTorch 2.11 build, e.g. build-torch2.11)
set -euo pipefail
build=${1:?usage: gpt.sh BUILD_DIR [ROUNDS] [STEPS]}
rounds=${2:-3}
steps=${3:-60}
# A build whose benchmarks compile at another level than the build type's (VOLT_EXAMPLES_OPTIMIZATION, which CI's 2.11
# lane sets to -Og and which stays in its CMakeCache.txt) would time that code.
level=$(sed -n 's/^VOLT_EXAMPLES_OPTIMIZATION:STRING=//p' "$build/CMakeCache.txt" 2>/dev/null || true)
if [ -n "$level" ]; then
  echo "gpt.sh: $build compiles the benchmarks at $level (VOLT_EXAMPLES_OPTIMIZATION); reconfigure it with" \
       "-DVOLT_EXAMPLES_OPTIMIZATION= (the build type's -O3) and rebuild gpt_bench before timing it." >&2
  exit 1
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
text=$(bash "$root/scripts/install-text.sh")
torch_dir=$(bash "$root/scripts/install-torch.sh" 2.11)
python=$(cd "$torch_dir/../../../.." && pwd)/bin/python
if ! "$python" -c "import lightning" 2>/dev/null; then
  echo "installing lightning into $python's environment" >&2
  "$python" -m pip install --quiet --progress-bar off lightning >&2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/bench/gpt_bench" export "$work/init.pt" --text "$text"
for ((r = 1; r <= rounds; r++)); do
  for k in 0 1; do
    "$build/bench/gpt_bench" run --checkpointing "$k" --steps "$steps" --text "$text" | tee -a "$work/lines"
    impl=$([ "$k" = 1 ] && echo checkpoint || echo eager)
    "$python" "$here/gpt_torch.py" --impl "$impl" --init "$work/init.pt" --text "$text" --steps "$steps" \
      | tee -a "$work/lines"
  done
  "$python" "$here/gpt_torch.py" --impl lightning --init "$work/init.pt" --text "$text" --steps "$steps" \
    | grep '^{' | tee -a "$work/lines"
done
for k in 0 1; do
  MALLOC_MMAP_THRESHOLD_=65536 "$build/bench/gpt_bench" run --checkpointing "$k" --steps 12 --text "$text" \
    | tee -a "$work/memory"
  impl=$([ "$k" = 1 ] && echo checkpoint || echo eager)
  MALLOC_MMAP_THRESHOLD_=65536 "$python" "$here/gpt_torch.py" --impl "$impl" --init "$work/init.pt" --text "$text" \
    --steps 12 | tee -a "$work/memory"
done
"$python" - "$work/lines" "$work/memory" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
memory = {(r["impl"], r["checkpointing"]): r["step_rss_rise_mib"] for r in map(json.loads, open(sys.argv[2]))}
def med(impl, key, k=None):
    return statistics.median(r[key] for r in runs if r["impl"] == impl and (k is None or r["checkpointing"] == k))
volt0, volt1 = med("volt", "tokens_per_s", 0), med("volt", "tokens_per_s", 1)
print(json.dumps({
    "bench": "gpt_summary", "rounds": len([r for r in runs if r["impl"] == "volt"]) // 2,
    "tokens_per_s": {"volt": volt0, "torch_eager": med("torch_eager", "tokens_per_s"),
                     "lightning": med("torch_lightning", "tokens_per_s"), "volt_checkpointing": volt1,
                     "torch_checkpoint": med("torch_checkpoint", "tokens_per_s")},
    "ratio_volt_over_torch_eager": volt0 / med("torch_eager", "tokens_per_s"),
    "ratio_volt_over_lightning": volt0 / med("torch_lightning", "tokens_per_s"),
    "ratio_volt_over_torch_checkpointing": volt1 / med("torch_checkpoint", "tokens_per_s"),
    "volt_checkpointing_step_time_ratio": volt0 / volt1,
    "train_rss_rise_mib": {"volt": med("volt", "train_rss_rise_mib", 0),
                           "volt_checkpointing": med("volt", "train_rss_rise_mib", 1),
                           "torch_eager": med("torch_eager", "train_rss_rise_mib"),
                           "torch_checkpoint": med("torch_checkpoint", "train_rss_rise_mib")},
    "activation_mib": {"volt": memory["volt", 0], "volt_checkpointing": memory["volt", 1],
                       "torch_eager": memory["torch_eager", 0], "torch_checkpoint": memory["torch_checkpoint", 1]},
    "volt_checkpointing_activation_ratio": memory["volt", 1] / memory["volt", 0],
    "val_loss": {"volt": med("volt", "val_loss", 0), "volt_checkpointing": med("volt", "val_loss", 1),
                 "torch_eager": med("torch_eager", "val_loss"), "torch_checkpoint": med("torch_checkpoint", "val_loss"),
                 "lightning": med("torch_lightning", "val_loss")}}))
PY
