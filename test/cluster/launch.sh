#!/usr/bin/env bash
# Runs a program on the emulated cluster in DIR (test/cluster/up.sh) as a user would start it, then checks that the
# job left no process behind on the hosts:
#   bash test/cluster/launch.sh DIR LAUNCHER NODES RANKS -- PROGRAM ARGS...
# LAUNCHER:
#   srun     srun -N NODES -n RANKS --mpi=pmix PROGRAM, from the head host
#   salloc   salloc -N NODES -n RANKS mpirun PROGRAM, from the head host (Open MPI starts its daemons with srun)
#   sbatch   sbatch -N NODES -n RANKS with `mpirun PROGRAM` in the batch script; waits for the job, prints its output
#   mpirun   mpirun --host node1:K,node2:K,... --map-by node from node1, Open MPI's rsh agent entering the other hosts
# Exits with the program's status (the job's, under sbatch); 77 when the cluster could not be made (DIR/skip says why).
set -euo pipefail
dir=${1:?usage: launch.sh DIR LAUNCHER NODES RANKS -- PROGRAM ARGS...}
launcher=$2 nodes=$3 ranks=$4
shift 4
[ "${1:-}" = "--" ] && shift
if [ -f "$dir/skip" ]; then
  echo "volt cluster: skipped: $(cat "$dir/skip")"
  exit 77
fi
[ -f "$dir/env" ] || { echo "volt cluster: no cluster in $dir (test/cluster/up.sh makes one)" >&2; exit 1; }
. "$dir/env"
on="$dir/bin/on"
mpirun_args=(--allow-run-as-root --bind-to none --oversubscribe)
quoted=$(printf '%q ' "$@")

status=0
case "$launcher" in
  srun) "$on" head srun -N "$nodes" -n "$ranks" --mpi=pmix --kill-on-bad-exit=0 "$@" || status=$? ;;
  salloc) "$on" head salloc -N "$nodes" -n "$ranks" mpirun "${mpirun_args[@]}" "$@" || status=$? ;;
  sbatch)
    script="$dir/run/job.$$.sh" out="$dir/run/job.$$.out"
    printf '#!/bin/sh\nexec mpirun %s %s\n' "${mpirun_args[*]}" "$quoted" > "$script"
    job=$("$on" head sbatch --parsable -N "$nodes" -n "$ranks" -o "$out" "$script")
    state=""
    for _ in $(seq 1 600); do  # sbatch --wait polls every 32 s; ask every 0.2 s
      line=$("$on" head scontrol -o show job "$job")
      state=$(printf '%s' "$line" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
      case "$state" in
        COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|PREEMPTED|BOOT_FAIL|DEADLINE) break ;;
      esac
      sleep 0.2
    done
    cat "$out" 2>/dev/null || true
    code=$(printf '%s' "$line" | sed -n 's/.* ExitCode=\([0-9]*\):\([0-9]*\).*/\1/p')
    echo "volt cluster: job $job ended $state, exit code ${code:-?}"
    rm -f "$script" "$out"
    [ "$state" = COMPLETED ] || status=${code:-1}
    [ "$status" -ne 0 ] || [ "$state" = COMPLETED ] || status=1
    ;;
  mpirun)
    hosts=$(seq -s, -f "node%g:$((ranks / nodes))" 1 "$nodes")
    "$on" node1 mpirun "${mpirun_args[@]}" --host "$hosts" --map-by node --mca plm_rsh_agent "$dir/bin/agent" \
      "$@" || status=$?
    ;;
  *) echo "volt cluster: LAUNCHER=$launcher; allowed: srun, salloc, sbatch, mpirun" >&2; exit 2 ;;
esac
bash "$(dirname "$0")/left.sh" "$dir" || status=1
exit "$status"
