#!/usr/bin/env bash
# Makes a cluster of emulated hosts on this machine, for the cluster tests:
#   bash test/cluster/up.sh DIR [NODES]      (NODES: 2 or 3, default 2)
# Each host is a network namespace plus a UTS namespace (its own hostname, node1..nodeN, and address 10.77.0.1N on
# eth0); a "head" namespace holds the bridge that joins them (10.77.0.1) and SLURM's controller. There is no route
# out of these namespaces: every address lives inside them. One munged (a path socket, reachable from every
# namespace), one slurmctld and one slurmd per host, with their configuration, state, spool, logs and TmpFS under
# DIR. Filesystem, users and process IDs stay shared, as on a cluster with a shared home.
#
# Written under DIR for the tests: env (SLURM_CONF, the namespace names), bin/on HOST CMD... (runs CMD on a host:
# node1.., or head), bin/agent (Open MPI's plm_rsh_agent), bin/check (exit 0 when the cluster is up), skip (why there
# is no cluster, when there cannot be one).
# Idempotent: a cluster already up in DIR is left as it is; a half-made one is taken down first (down.sh).
# Exits 77, with the reason in DIR/skip, where this machine cannot make one (not root, no `ip netns`, no SLURM).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:?usage: up.sh DIR [NODES]}
nodes=${2:-2}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
rm -f "$dir/skip"

skip() {
  echo "$*" > "$dir/skip"
  echo "volt cluster: $*; the cluster tests are skipped." >&2
  exit 77
}
[ "$(id -u)" -eq 0 ] || skip "making network namespaces needs root (running as uid $(id -u))"
command -v ip >/dev/null || skip "no \`ip\` command (Debian: iproute2)"
for tool in unshare nsenter munged slurmctld slurmd srun sbatch scontrol mpirun; do
  command -v "$tool" >/dev/null || skip "no \`$tool\` (bash scripts/install-deps.sh --tests installs SLURM and munge)"
done
case "$nodes" in 2|3) ;; *) echo "volt cluster: NODES=$nodes; allowed: 2 or 3" >&2; exit 2 ;; esac

# Namespace names carry a hash of DIR, so two clusters (two build trees) never share one.
tag=$(printf '%s' "$dir" | md5sum | cut -c1-6)
prefix="vc$tag"
if [ -f "$dir/env" ] && bash "$here/check.sh" "$dir" >/dev/null 2>&1; then
  echo "volt cluster: already up in $dir"
  exit 0
fi
bash "$here/down.sh" "$dir" >/dev/null 2>&1 || true
ip netns add "${prefix}probe" 2>/dev/null || skip "\`ip netns add\` failed: this machine cannot make network namespaces"
ip netns del "${prefix}probe"

rm -rf "$dir"/{bin,etc,log,run,munge,state}  # a fresh cluster: no jobs, nodes or keys of an earlier one
mkdir -p "$dir"/{bin,etc,log,run,uts,munge,state/ctld}
chmod 755 "$dir" "$dir/munge"
trap 'echo "volt cluster: setting up failed; taking it down" >&2; bash "$here/down.sh" "$dir" >&2 || true' ERR

# The network: a bridge in the head namespace, one veth pair per host (eth0 inside the host), no default route.
ip netns add "${prefix}h"
ip -n "${prefix}h" link add br0 type bridge
ip -n "${prefix}h" addr add 10.77.0.1/24 dev br0
ip -n "${prefix}h" link set br0 up
ip -n "${prefix}h" link set lo up
node_list=()
for i in $(seq 1 "$nodes"); do
  ns="${prefix}n$i"
  ip netns add "$ns"
  ip link add "${prefix}v$i" type veth peer name "${prefix}p$i"
  ip link set "${prefix}v$i" netns "$ns"
  ip link set "${prefix}p$i" netns "${prefix}h"
  ip -n "$ns" link set "${prefix}v$i" name eth0
  ip -n "$ns" addr add "10.77.0.1$i/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  ip -n "${prefix}h" link set "${prefix}p$i" master br0
  ip -n "${prefix}h" link set "${prefix}p$i" up
  for n in "$ns" "${prefix}h"; do
    ip netns exec "$n" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
  done
  : > "$dir/uts/node$i"
  unshare --uts="$dir/uts/node$i" hostname "node$i"
  node_list+=("node$i")
done
: > "$dir/uts/head"
unshare --uts="$dir/uts/head" hostname head

cat > "$dir/env" <<EOF
export VOLT_CLUSTER_DIR='$dir'
export VOLT_CLUSTER_PREFIX='$prefix'
export VOLT_CLUSTER_NODES='$nodes'
export SLURM_CONF='$dir/etc/slurm.conf'
EOF
# bin/on HOST CMD...: runs CMD inside the host's namespaces (head, node1.., or one of their addresses).
cat > "$dir/bin/on" <<EOF
#!/bin/sh
host=\$1; shift
case "\$host" in
  head|10.77.0.1) ns=${prefix}h; uts=head ;;
  node[1-9]) ns=${prefix}n\${host#node}; uts=\$host ;;
  10.77.0.1[1-9]) ns=${prefix}n\${host#10.77.0.1}; uts=node\${host#10.77.0.1} ;;
  *) echo "volt cluster: no host \$host; allowed: head, node1..node$nodes" >&2; exit 2 ;;
esac
SLURM_CONF='$dir/etc/slurm.conf'; export SLURM_CONF
exec nsenter --net=/run/netns/\$ns --uts='$dir/uts/'\$uts -- "\$@"
EOF
# bin/agent HOST WORDS...: Open MPI's rsh agent; it quotes the remote command for a shell, so run it through one.
cat > "$dir/bin/agent" <<EOF
#!/bin/sh
host=\$1; shift
exec '$dir/bin/on' "\$host" sh -c "\$*"
EOF
# bin/check: whether the cluster is up (check.sh), for test drivers that only know DIR.
cat > "$dir/bin/check" <<EOF
#!/bin/sh
exec bash '$here/check.sh' '$dir' > /dev/null
EOF
chmod 755 "$dir/bin/on" "$dir/bin/agent" "$dir/bin/check"

# munge: one daemon, its own key and socket.
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --socket="$dir/munge/socket" --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.pid" \
       --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"

cat > "$dir/etc/slurm.conf" <<EOF
ClusterName=volt
SlurmctldHost=head(10.77.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state/ctld
SlurmdSpoolDir=$dir/state/%n/spool
TmpFS=$dir/state/%n/tmp
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
SlurmdTimeout=20
JobRequeue=1
KillOnBadExit=0
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName=node[1-$nodes] NodeAddr=10.77.0.[11-1$nodes] CPUs=2 State=UNKNOWN
PartitionName=main Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
for i in $(seq 1 "$nodes"); do mkdir -p "$dir/state/node$i/spool" "$dir/state/node$i/tmp"; done

"$dir/bin/on" head slurmctld -c -f "$dir/etc/slurm.conf"
for i in $(seq 1 "$nodes"); do "$dir/bin/on" "node$i" slurmd -f "$dir/etc/slurm.conf"; done

# Up when every node is idle.
for _ in $(seq 1 100); do
  if bash "$here/check.sh" "$dir" >/dev/null 2>&1; then
    # What runs in the namespaces now is the cluster's own (the daemons and their helpers, slurmctld's slurmscriptd):
    # left.sh counts anything else as a job's leftover.
    for ns in $(ip netns list | awk '{print $1}' | grep "^$prefix"); do ip netns pids "$ns"; done > "$dir/run/daemons"
    trap - ERR
    echo "volt cluster: ${node_list[*]} up in $dir (namespaces ${prefix}*)"
    exit 0
  fi
  sleep 0.2
done
echo "volt cluster: the nodes did not become idle in 20 s:" >&2
"$dir/bin/on" head sinfo -N >&2 || true
tail -n 20 "$dir"/log/*.log >&2 || true
false
