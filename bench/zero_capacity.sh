#!/usr/bin/env bash
# What FSDP is for: the largest model each strategy trains when every rank may hold at most LIMIT MiB. Each rank of
# `zero --fit-once` joins a memory cgroup of its own (cgroup v1's memory controller, memory.limit_in_bytes; made
# under this shell's cgroup here and removed at the end), so what it allocates after start counts against LIMIT; a rank
# over it is killed by the kernel and the fit fails. For DDP, ZeRO<2> and FSDP (each layer a unit) on NP ranks, MLPs of
# WIDTH with more and more hidden layers are trained for a few Adam steps until one fails; JSON lines: each fit that
# trained, then per strategy the largest (parameters, and DDP's model state for it: 16 bytes a parameter).
#   bash bench/zero_capacity.sh [BUILD_DIR] [LIMIT_MIB]   (NP=4 WIDTH=1024 STEPS=3 STRATEGIES="ddp zero2 fsdp")
set -euo pipefail
build=$(cd "${1:-build}" && pwd)
limit_mib=${2:-640}
np=${NP:-4}
width=${WIDTH:-1024}
steps=${STEPS:-3}
base=/sys/fs/cgroup/memory$(awk -F: '$2 == "memory" {print $3}' /proc/self/cgroup)
if [ ! -w "$base" ]; then
  echo "zero_capacity: no writable cgroup v1 memory controller at $base (run as root)" >&2
  exit 77
fi
parent="$base/volt_capacity_$$"
out=$(mktemp)
cleanup() {  # a killed job's last rank may still be leaving its cgroup: try for a few seconds
  rm -f "$out"
  for ((try = 0; try < 50; try++)); do
    for d in "$parent"/rank*; do [ -d "$d" ] && rmdir "$d" 2>/dev/null; done
    [ -d "$parent" ] && rmdir "$parent" 2>/dev/null
    [ -d "$parent" ] || return 0
    sleep 0.2
  done
  echo "zero_capacity: could not remove $parent" >&2
  return 1
}
trap cleanup EXIT
mkdir "$parent"
for ((r = 0; r < np; r++)); do
  mkdir "$parent/rank$r"
  echo $((limit_mib << 20)) > "$parent/rank$r/memory.limit_in_bytes"
done
for strategy in ${STRATEGIES:-ddp zero2 fsdp}; do
  largest=0 params=0
  for hidden in 1 2 4 8 12 16 20 24 28 32 36 40 44 48 52 56 60 64 72 80 96; do
    if OMP_NUM_THREADS=1 timeout 600 mpirun --allow-run-as-root --oversubscribe -np "$np" -x VOLT_BENCH_CGROUP="$parent" \
        "$build/bench/zero" --fit-once "$strategy" --width "$width" --hidden "$hidden" --steps "$steps" --warmup 1 \
        > "$out" 2>&1; then
      line=$(grep '"bench":"zero_fit_once"' "$out")
      echo "$line"
      largest=$hidden
      params=$(sed 's/.*"parameters":\([0-9]*\).*/\1/' <<< "$line")
    else
      echo "{\"bench\":\"zero_fit_once\",\"strategy\":\"$strategy\",\"hidden\":$hidden,\"failed\":\"$(grep -m1 -o 'Killed\|killed\|signal [0-9]*\|exited on signal[^\"]*' "$out" | head -1)\"}"
      break
    fi
  done
  echo "{\"bench\":\"zero_capacity\",\"strategy\":\"$strategy\",\"world_size\":$np,\"limit_mib\":$limit_mib,\"width\":$width,\"largest_hidden\":$largest,\"largest_parameters\":$params,\"ddp_model_state_mib\":$((params * 16 >> 20))}"
done
