#!/bin/bash
# Tear down what up.sh started: cancel jobs, stop the slurmd's, slurmctld and munged (only
# the pids up.sh recorded), undo the /etc/hosts line and /etc/slurm links, remove the state
# folder. Safe to run when nothing is up. `down.sh --purge` also removes the packages.
set -uo pipefail
BASE=${SLURMLAB_BASE:-/tmp/titanscale-slurmlab}
MARK="# titanscale-slurmlab"
export SLURM_CONF=$BASE/etc/slurm.conf

alive() { [ -n "$1" ] && [ -d "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }
stop_pid() { # stop_pid PID NAME
  local p=$1 i
  alive "$p" || return 0
  kill -TERM "$p" 2>/dev/null
  for i in $(seq 50); do alive "$p" || return 0; sleep 0.1; done
  echo "slurmlab/down.sh: $2 ($p) ignored TERM, sending KILL" >&2
  kill -KILL "$p" 2>/dev/null
}

if [ -f "$BASE/run/slurmctld.bgpid" ] && alive "$(cat "$BASE/run/slurmctld.bgpid")"; then
  # Cancel jobs first so their slurmstepd's and processes go before the slurmd's do.
  scancel --full --quiet --user=root 2>/dev/null || true
  for _ in $(seq 60); do # <= 30 s
    [ -z "$(squeue -h -t R,CG,PD,S,CF -o %i 2>/dev/null)" ] && break
    sleep 0.5
  done
fi
for f in "$BASE"/run/slurmd-*.bgpid; do [ -f "$f" ] && stop_pid "$(cat "$f")" "$(basename "$f" .bgpid)"; done
[ -f "$BASE/run/slurmctld.bgpid" ] && stop_pid "$(cat "$BASE/run/slurmctld.bgpid")" slurmctld
[ -f "$BASE/run/munged.pid" ] && stop_pid "$(cat "$BASE/run/munged.pid")" munged

# Undo the system edits: only the links we made, only our marked hosts line.
if [ -f "$BASE/run/etc-links" ]; then
  while read -r l; do [ -L "$l" ] && rm -f "$l"; done <"$BASE/run/etc-links"
  [ -f "$BASE/run/etc-dir-created" ] && rmdir /etc/slurm 2>/dev/null
fi
if grep -q "$MARK\$" /etc/hosts 2>/dev/null; then
  # Rewrite in place (not mv): /etc/hosts may be a bind mount.
  tmp=$(grep -v "$MARK\$" /etc/hosts); printf '%s\n' "$tmp" >/etc/hosts
fi
rm -rf "$BASE"

if [ "${1:-}" = "--purge" ]; then
  DEBIAN_FRONTEND=noninteractive apt-get purge -y slurmctld slurmd slurm-client munge \
    slurm-wlm-basic-plugins libmunge2 >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get autoremove -y --purge >/dev/null 2>&1
fi
echo "slurmlab/down.sh: done"
