#!/usr/bin/env bash
# Runs a test driver that uses the emulated cluster in DIR itself (resume's requeue cases), then checks that the jobs
# left no process behind on the hosts:
#   bash test/cluster/with.sh DIR COMMAND...
# Exits with the command's status; 77 when the cluster could not be made (DIR/skip says why).
set -uo pipefail
dir=${1:?usage: with.sh DIR COMMAND...}
shift
if [ -f "$dir/skip" ]; then
  echo "volt cluster: skipped: $(cat "$dir/skip")"
  exit 77
fi
[ -f "$dir/env" ] || { echo "volt cluster: no cluster in $dir (test/cluster/up.sh makes one)" >&2; exit 1; }
status=0
"$@" || status=$?
bash "$(dirname "$0")/left.sh" "$dir" || status=1
exit "$status"
