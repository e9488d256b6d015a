#!/bin/bash
# Bring up a real Slurm cluster on this one machine, for tests and for trying the launcher:
# Debian's Slurm packages (installed with apt-get if missing), our own munged (own key and
# socket), one slurmctld and N slurmd's that emulate nodes node1..nodeN (all on 127.0.0.1,
# distinct ports), TopologyPlugin=topology/tree with leaf switches of SLURMLAB_NODES_PER_LEAF
# nodes under one spine. No systemd. Must run as root (it edits /etc/hosts and /etc/slurm;
# down.sh undoes both).
#
#   tools/slurmlab/up.sh && source /tmp/titanscale-slurmlab/env.sh
#   sbatch -N4 job.sbatch          # each node sees SLURM_TOPOLOGY_ADDR=spine.leafL.nodeN
#   tools/slurmlab/down.sh
#
# Knobs (environment):
#   SLURMLAB_BASE            state/config folder              (/tmp/titanscale-slurmlab)
#   SLURMLAB_NODES           emulated nodes                   (4)
#   SLURMLAB_NODES_PER_LEAF  nodes under each leaf switch     (2)
#   SLURMLAB_LEAF_LAYOUT     contiguous | interleaved         (contiguous: node1-2 on leaf1)
#   SLURMLAB_CPUS            CPUs advertised per node         (2; may exceed the real CPUs)
#   SLURMLAB_ETC=0           don't link /etc/slurm/slurm.conf (then export SLURM_CONF)
#   SLURMLAB_HOSTS=0         don't add "127.0.0.1 node1..N" to /etc/hosts
# Every node shares this machine's kernel, hostname, /tmp and port space: jobs must use
# SLURMD_NODENAME (not `hostname`) and ports that differ per job.
set -euo pipefail
T0=$(date +%s.%N)
BASE=${SLURMLAB_BASE:-/tmp/titanscale-slurmlab}
NN=${SLURMLAB_NODES:-4}
PER_LEAF=${SLURMLAB_NODES_PER_LEAF:-2}
CPUS=${SLURMLAB_CPUS:-2}
MARK="# titanscale-slurmlab"
HOST=$(hostname -s)
say() { echo "slurmlab/up.sh: $*" >&2; }
[ "$(id -u)" = 0 ] || { say "must run as root (installs packages, edits /etc/hosts)"; exit 1; }
if [ -f "$BASE/run/slurmctld.bgpid" ] && kill -0 "$(cat "$BASE/run/slurmctld.bgpid")" 2>/dev/null; then
  say "already running under $BASE (run tools/slurmlab/down.sh first)"; exit 1
fi
# Only one Slurm can own the controller port on a machine.
if command -v ss >/dev/null && ss -ltn 2>/dev/null | awk '{print $4}' | grep -q ':6817$'; then
  say "port 6817 is in use: another slurmctld is running on this machine"; exit 1
fi

# ---- 1. packages -------------------------------------------------------------------------
PKGS="slurmctld slurmd slurm-client munge"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
   ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  APTLOG=${TMPDIR:-/tmp}/titanscale-slurmlab-apt.log
  say "installing $PKGS with apt-get (log: $APTLOG)"
  # Keep the packages' postinst from starting their own services (the machine may have no
  # init system, and our daemons use their own configuration).
  PRC_CREATED=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; PRC_CREATED=1
  fi
  ok=1
  apt-get install -y --no-install-recommends $PKGS >"$APTLOG" 2>&1 || {
    # A fresh machine has empty package lists.
    apt-get update >>"$APTLOG" 2>&1 && apt-get install -y --no-install-recommends $PKGS >>"$APTLOG" 2>&1; } || ok=0
  [ $PRC_CREATED = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ $ok = 1 ] || { say "apt-get failed:"; tail -n 20 "$APTLOG" >&2; exit 1; }
fi
T1=$(date +%s.%N)

# ---- 2. layout ---------------------------------------------------------------------------
mkdir -p "$BASE"/{etc,state,log,run,munge}
for i in $(seq 1 "$NN"); do mkdir -p "$BASE/spool/node$i"; done
chmod 700 "$BASE/munge"

# ---- 3. munge: own key and socket, so a system munged (if any) is left alone --------------
KEY=$BASE/munge/munge.key
[ -s "$KEY" ] || dd if=/dev/urandom of="$KEY" bs=1 count=1024 status=none
chmod 400 "$KEY"
SOCK=$BASE/munge/munge.socket
/usr/sbin/munged --force --key-file="$KEY" --socket="$SOCK" \
  --pid-file="$BASE/run/munged.pid" --log-file="$BASE/log/munged.log" \
  --seed-file="$BASE/munge/munged.seed"
for _ in $(seq 50); do [ -S "$SOCK" ] && break; sleep 0.1; done
munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null

# ---- 4. configuration --------------------------------------------------------------------
# slurmd looks its host up, and jobs resolve node names (e.g. a master address): one
# /etc/hosts line, marked so down.sh removes exactly it.
if [ "${SLURMLAB_HOSTS:-1}" = 1 ] && ! grep -q "$MARK\$" /etc/hosts; then
  names=""; for i in $(seq 1 "$NN"); do names="$names node$i"; done
  getent hosts "$HOST" >/dev/null || names="$names $HOST"
  echo "127.0.0.1$names $MARK" >>/etc/hosts
fi
NODES=$([ "$NN" -gt 1 ] && echo "node[1-$NN]" || echo node1)
PORTS=$([ "$NN" -gt 1 ] && echo "[17001-$((17000 + NN))]" || echo 17001)
cat >"$BASE/etc/slurm.conf" <<CONF
ClusterName=titanscale
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
TopologyPlugin=topology/tree
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldPort=6817
SlurmdPort=6818
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldDebug=info
SlurmdDebug=info
InactiveLimit=0
KillWait=5
MinJobAge=600
NodeName=$NODES NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$PORTS CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
# Leaf switches of PER_LEAF nodes under one spine. "interleaved" puts node i under leaf
# ((i-1) mod leaves)+1, so node-name order and switch order differ (what the launcher's
# topology ordering must cope with on real clusters, where names rarely follow cabling).
leaves=$(( (NN + PER_LEAF - 1) / PER_LEAF ))
: >"$BASE/etc/topology.conf"
for l in $(seq 1 "$leaves"); do
  members=""
  for i in $(seq 1 "$NN"); do
    if [ "${SLURMLAB_LEAF_LAYOUT:-contiguous}" = interleaved ]; then
      [ $(( (i - 1) % leaves + 1 )) = "$l" ] || continue
    else
      [ $(( (i - 1) / PER_LEAF + 1 )) = "$l" ] || continue
    fi
    members="$members,$i"
  done
  members=${members#,}
  case $members in *,*) nodes="node[$members]" ;; *) nodes="node$members" ;; esac
  echo "SwitchName=leaf$l Nodes=$nodes" >>"$BASE/etc/topology.conf"
done
if [ "$leaves" -gt 1 ]; then echo "SwitchName=spine Switches=leaf[1-$leaves]" >>"$BASE/etc/topology.conf"; fi
export SLURM_CONF=$BASE/etc/slurm.conf
echo "export SLURM_CONF=$SLURM_CONF" >"$BASE/env.sh"
: >"$BASE/run/etc-links"
if [ "${SLURMLAB_ETC:-1}" = 1 ]; then
  [ -d /etc/slurm ] || { mkdir -p /etc/slurm && touch "$BASE/run/etc-dir-created"; }
  for f in slurm.conf topology.conf; do
    if [ ! -e "/etc/slurm/$f" ]; then ln -s "$BASE/etc/$f" "/etc/slurm/$f"; echo "/etc/slurm/$f" >>"$BASE/run/etc-links"; fi
  done
fi

# ---- 5. daemons (setsid: their own session, so a test runner's signals don't reach them;
#         down.sh stops exactly the pids recorded here) ---------------------------------------
setsid /usr/sbin/slurmctld -D -f "$SLURM_CONF" >"$BASE/log/slurmctld.out" 2>&1 </dev/null &
echo $! >"$BASE/run/slurmctld.bgpid"
for i in $(seq 1 "$NN"); do
  setsid /usr/sbin/slurmd -D -f "$SLURM_CONF" -N "node$i" >"$BASE/log/slurmd-node$i.out" 2>&1 </dev/null &
  echo $! >"$BASE/run/slurmd-node$i.bgpid"
done

# ---- 6. wait until every node is plainly idle (not idle* = not responding) ------------------
ok=0
for _ in $(seq 160); do   # <= 40 s
  n=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2=="idle"{print $1}' | sort -u | wc -l || true)
  [ "$n" = "$NN" ] && { ok=1; break; }
  sleep 0.25
done
if [ $ok != 1 ]; then
  say "nodes not idle after 40 s"; sinfo -N >&2 || true
  tail -n 20 "$BASE"/log/*.out >&2 || true; exit 1
fi
T2=$(date +%s.%N)
timeout 60 srun -N "$NN" -n "$NN" true
T3=$(date +%s.%N)
awk -v n="$NN" -v l="$leaves" -v a="$T0" -v b="$T1" -v c="$T2" -v d="$T3" 'BEGIN{printf "slurmlab/up.sh: OK  %s nodes on %s leaf switches idle; install %.1fs, daemons %.1fs, smoke srun %.1fs, total %.1fs\n", n, l, b-a, c-b, d-c, d-a}'
echo "slurmlab/up.sh: source $BASE/env.sh   # SLURM_CONF=$SLURM_CONF"
