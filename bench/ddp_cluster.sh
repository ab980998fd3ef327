#!/usr/bin/env bash
# DDP across 2 emulated hosts (test/cluster/up.sh: network namespaces on a kernel bridge, SLURM), one rank per host:
#  - volt (`ddp two-rank --nodes 2` under srun --mpi=pmix) against torch DDP over gloo (ddp_vs_torch.py, one process
#    started on each host), interleaved rounds: steps per second and their ratio (> 1: volt is faster);
#  - volt::Mpi's all-reduce, reduce-scatter and all-gather against Open MPI's own blocking ones of the same bytes on
#    the same hosts (`ddp collectives`), at 2 and 4 ranks: bus bandwidth and ratio, for 4 MiB and 64 MiB.
# The link is a kernel bridge, not a wire: only the ratios mean anything. Prints each run's JSON line and a summary.
#   bash bench/ddp_cluster.sh CLUSTER_DIR BUILD_DIR [ROUNDS] [STEPS]     (the cluster up: test/cluster/up.sh DIR)
set -euo pipefail
cluster=$(cd "${1:?usage: ddp_cluster.sh CLUSTER_DIR BUILD_DIR [ROUNDS] [STEPS]}" && pwd)
build=$(cd "${2:?usage: ddp_cluster.sh CLUSTER_DIR BUILD_DIR [ROUNDS] [STEPS]}" && pwd)
rounds=${3:-5}
steps=${4:-150}
here=$(cd "$(dirname "$0")" && pwd)
launch="$here/../test/cluster/launch.sh"
bash "$here/../test/cluster/check.sh" "$cluster" >/dev/null || { echo "no cluster up in $cluster" >&2; exit 1; }
/usr/bin/python3 -c "import torch.distributed" 2>/dev/null || { echo "needs Debian's python3-torch" >&2; exit 1; }
on="$cluster/bin/on"
lines=$(mktemp)
trap 'rm -f "$lines"' EXIT
for ((r = 1; r <= rounds; r++)); do
  bash "$launch" "$cluster" srun 2 2 -- "$build/bench/ddp" two-rank --steps "$steps" --nodes 2 |
    grep '"impl":"volt"' | tee -a "$lines"
  master="10.77.0.11:$((20000 + ($$ % 1000) * 10 + r))"  # rank 0 listens there (a port of this run); rank 1 follows
  torch_rank() {
    GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 timeout 120 "$on" "node$(($1 + 1))" /usr/bin/python3 \
      "$here/ddp_vs_torch.py" "$steps" --rank "$1" --world 2 --master "$master"
  }
  torch_rank 0 > "$lines.torch" &
  sleep 2
  # gloo's rendezvous between the namespaces sometimes never completes (both processes idle): such a round is
  # dropped after 120 s, and said so
  torch_rank 1 > /dev/null || echo "torch round $r did not complete in 120 s; left out" >&2
  wait || true
  grep torch_ddp_gloo "$lines.torch" | tee -a "$lines" || true
done
rm -f "$lines.torch"
# 2 ranks (one a host) and 4 (two a host). Where the ranks outnumber the cores, Open MPI must be told to yield while
# it polls (mpirun does so by itself when it sees the oversubscription; under srun it cannot): otherwise the spinning
# ranks starve the threads that would move the bytes, volt's collective thread and Open MPI's own alike.
for ranks in 2 4; do
  yield=0
  [ "$ranks" -gt "$(nproc)" ] && yield=1
  for mb in 4 64; do
    OMPI_MCA_mpi_yield_when_idle=$yield bash "$launch" "$cluster" srun 2 "$ranks" -- "$build/bench/ddp" collectives \
      --rounds 7 --mb "$mb" | grep ddp_collective_vs_mpi
  done
done
/usr/bin/python3 - "$lines" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
v = [r["steps_per_s"] for r in runs if r["impl"] == "volt"]
t = [r["steps_per_s"] for r in runs if r["impl"] == "torch_ddp_gloo"]
print(json.dumps({"bench": "ddp_two_hosts_vs_torch_gloo", "rounds": len(v), "hosts": 2,
                  "volt_steps_per_s": statistics.median(v), "torch_steps_per_s": statistics.median(t),
                  "ratio": statistics.median(v) / statistics.median(t),
                  "median_round_ratio": statistics.median([a / b for a, b in zip(v, t)])}))
PY
