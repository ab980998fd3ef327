#!/usr/bin/env bash
# Takes down the cluster of emulated hosts that up.sh made in DIR, and checks that nothing is left of it:
#   bash test/cluster/down.sh DIR
# Stops the daemons by the PIDs in their pid files, then every process left in the namespaces (jobs, steps, Open
# MPI's daemons), unmounts the hostnames' namespaces, deletes the network namespaces. Exits non-zero, saying what,
# if anything is left. Safe to run when nothing is up.
set -uo pipefail
dir=${1:?usage: down.sh DIR}
[ -d "$dir" ] || exit 0
dir=$(cd "$dir" && pwd)
prefix="vc$(printf '%s' "$dir" | md5sum | cut -c1-6)"
ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix" || true; }

stop_pid() {  # SIGTERM, up to 5 s, then SIGKILL
  local pid=$1
  kill -0 "$pid" 2>/dev/null || return 0
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
}
for f in "$dir"/run/slurmd.*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid"; do
  [ -f "$f" ] || continue
  stop_pid "$(cat "$f")"
  rm -f "$f"
done
for _ in 1 2 3; do  # what the jobs left: kill everything in our namespaces, by PID
  for ns in $(ours); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null
  done
  sleep 0.2
done
for f in "$dir"/uts/*; do
  [ -e "$f" ] || continue
  umount "$f" 2>/dev/null
  rm -f "$f"
done
for ns in $(ours); do ip netns del "$ns"; done
rm -f "$dir/env"

left=""
for ns in $(ours); do left+=" namespace $ns (pids: $(ip netns pids "$ns" | tr '\n' ' '))"; done
for f in "$dir"/uts/*; do [ -e "$f" ] && left+=" $f"; done
grep -q " $dir/uts/" /proc/self/mountinfo && left+=" mounts under $dir/uts"
if [ -n "$left" ]; then
  echo "volt cluster: left behind in $dir:$left" >&2
  exit 1
fi
echo "volt cluster: down, nothing left in $dir"
