#!/usr/bin/env bash
# A cut link: the 2-rank sig-fit of test/resume.cpp (one rank on each of 2 emulated hosts, started by LAUNCHER) loses
# node2's link after a few steps. Every rank must end by itself within BOUND seconds of the cut, with volt's message
# naming the rank it lost; the link comes back afterwards, and the launcher must end and leave nothing behind.
#   bash test/cluster/cut.sh DIR LAUNCHER BOUND RESUME_EXE WORK_DIR
set -uo pipefail
dir=${1:?usage: cut.sh DIR LAUNCHER BOUND RESUME_EXE WORK_DIR} launcher=$2 bound=$3 resume=$4 work=$5
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$dir/skip" ]; then
  echo "volt cluster: skipped: $(cat "$dir/skip")"
  exit 77
fi
. "$dir/env"
rm -rf "$work"
mkdir -p "$work"
fail() { echo "MISMATCH: $*"; ip -n "${VOLT_CLUSTER_PREFIX}n2" link set eth0 up 2>/dev/null; exit 1; }
VOLT_TEST_NODES=2 bash "$here/launch.sh" "$dir" "$launcher" 2 2 -- \
  "$resume" sig-fit ddp "$work/run" "$work/out.ckpt" 300 > "$work/log" 2>&1 &
job=$!
for _ in $(seq 1 300); do
  [ "$(cat "$work/run/progress" 2>/dev/null || echo 0)" -ge 3 ] && break
  kill -0 "$job" 2>/dev/null || { cat "$work/log"; fail "the run ended before step 3"; }
  sleep 0.1
done
ranks="$(cat "$work/run/pid.0") $(cat "$work/run/pid.1")"
cut=$(date +%s.%N)
ip -n "${VOLT_CLUSTER_PREFIX}n2" link set eth0 down
echo "cut node2's link at step $(cat "$work/run/progress"); ranks' pids: $ranks"
ended=""
while [ -z "$ended" ]; do
  alive=""
  for pid in $ranks; do kill -0 "$pid" 2>/dev/null && alive="$alive $pid"; done
  took=$(echo "$(date +%s.%N) - $cut" | bc)
  [ -z "$alive" ] && ended=$took
  [ -z "$ended" ] && [ "$(echo "$took > $bound + 10" | bc)" = 1 ] && break
  sleep 0.1
done
ip -n "${VOLT_CLUSTER_PREFIX}n2" link set eth0 up
wait "$job"
status=$?
cat "$work/log"
[ -n "$ended" ] || fail "ranks$alive still running $took s after the cut"
echo "every rank ended $ended s after the cut (bound $bound s); the launcher ended with status $status"
[ "$(echo "$ended <= $bound" | bc)" = 1 ] || fail "the ranks ended $ended s after the cut, more than $bound s"
[ "$status" -ne 0 ] || fail "the launcher exited 0"
grep -q "has not been heard from" "$work/log" || fail "no rank said which rank it lost"
for _ in $(seq 1 300); do  # the cluster as it was before, for the next test
  bash "$here/check.sh" "$dir" >/dev/null 2>&1 && exit 0
  sleep 0.2
done
fail "the cluster did not come back after the link did: $(bash "$here/check.sh" "$dir")"
