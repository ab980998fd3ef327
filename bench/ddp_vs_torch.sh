#!/usr/bin/env bash
# 2-rank DDP on CPU: volt (mpirun -np 2 ./ddp two-rank) against torch DDP over gloo (ddp_vs_torch.py), in
# interleaved rounds; prints each run's JSON line and a summary line with the medians and volt/torch ratio
# of steps per second (> 1: volt is faster).
#   bash bench/ddp_vs_torch.sh BUILD_DIR [ROUNDS] [STEPS]
set -euo pipefail
build=${1:?usage: ddp_vs_torch.sh BUILD_DIR [ROUNDS] [STEPS]}
rounds=${2:-5}
steps=${3:-150}
here=$(cd "$(dirname "$0")" && pwd)
if ! /usr/bin/python3 -c "import torch.distributed" 2>/dev/null; then
  echo "installing python3-torch (Debian) for the comparison"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3-torch
fi
lines=$(mktemp)
trap 'rm -f "$lines"' EXIT
for ((r = 1; r <= rounds; r++)); do
  mpirun --allow-run-as-root --oversubscribe -np 2 "$build/bench/ddp" two-rank --steps "$steps" | grep '"impl":"volt"' | tee -a "$lines"
  OMP_NUM_THREADS=1 /usr/bin/python3 "$here/ddp_vs_torch.py" "$steps" | grep torch_ddp_gloo | tee -a "$lines"
done
/usr/bin/python3 - "$lines" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
v = [r["steps_per_s"] for r in runs if r["impl"] == "volt"]
t = [r["steps_per_s"] for r in runs if r["impl"] == "torch_ddp_gloo"]
ratios = [a / b for a, b in zip(v, t)]
print(json.dumps({"bench": "ddp_two_rank_vs_torch_gloo", "rounds": len(v),
                  "volt_steps_per_s": statistics.median(v), "torch_steps_per_s": statistics.median(t),
                  "ratio": statistics.median(v) / statistics.median(t),
                  "median_round_ratio": statistics.median(ratios)}))
PY
