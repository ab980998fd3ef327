#!/usr/bin/env bash
# After a job: waits up to 15 s for every process the job started on the emulated hosts to end (the daemons aside);
# what is still there then is named, killed by its PID, and the exit status is 1.
#   bash test/cluster/left.sh DIR
set -uo pipefail
dir=$(cd "${1:?usage: left.sh DIR}" && pwd)
. "$dir/env"
daemons=" $(cat "$dir/run/daemons" 2>/dev/null | tr '\n' ' ') "
stray() {
  local ns pid
  for ns in $(ip netns list | awk '{print $1}' | grep "^$VOLT_CLUSTER_PREFIX"); do
    for pid in $(ip netns pids "$ns"); do
      case "$daemons" in *" $pid "*) ;; *) echo "$pid" ;; esac
    done
  done
}
for _ in $(seq 1 75); do
  [ -z "$(stray)" ] && exit 0
  sleep 0.2
done
pids=$(stray)
[ -z "$pids" ] && exit 0
echo "volt cluster: the job left processes on the hosts:" >&2
for pid in $pids; do echo "  $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" >&2; done
kill -9 $pids 2>/dev/null
exit 1
