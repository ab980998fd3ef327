#!/usr/bin/env bash
# Whether the cluster in DIR is up: munged, slurmctld and every slurmd running, and every node idle.
#   bash test/cluster/check.sh DIR      (exit 0: up; otherwise says what is not)
set -euo pipefail
dir=$(cd "${1:?usage: check.sh DIR}" && pwd)
[ -f "$dir/env" ] || { echo "no cluster in $dir"; exit 1; }
. "$dir/env"
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
alive "$dir/run/munged.pid" || { echo "munged is not running"; exit 1; }
alive "$dir/run/slurmctld.pid" || { echo "slurmctld is not running"; exit 1; }
for i in $(seq 1 "$VOLT_CLUSTER_NODES"); do
  alive "$dir/run/slurmd.node$i.pid" || { echo "slurmd of node$i is not running"; exit 1; }
done
states=$("$dir/bin/on" head sinfo -h -N -o '%N %t' 2>&1) || { echo "sinfo failed: $states"; exit 1; }
idle=$(printf '%s\n' "$states" | grep -c ' idle$' || true)
[ "$idle" -eq "$VOLT_CLUSTER_NODES" ] || { echo "not every node is idle: $states"; exit 1; }
echo "up: $VOLT_CLUSTER_NODES nodes idle"
