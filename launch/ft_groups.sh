#!/bin/bash
# The torchft part of launch/job.sbatch (launch/sbatch.py renders it in place of the single
# training step for a [fault_tolerance] recipe; not a script of its own).
# ---- torchft replica groups: the lighthouse on the first node in topology order, then one
# job step per group on its own nodes, each re-launched alone when it fails ----
FT_GROUPS={{groups}}
GROUP_NODES={{group_nodes}}
MAX_GROUP_RESTARTS={{max_restarts}}
FIRST=$(head -n 1 "$ORDER_FILE")
LH_PORT=$((PORT0 + 1))
LH_LOG="$LOG_DIR/lighthouse-$SLURM_JOB_ID.out"
LH_READY="$LOG_DIR/lighthouse-$SLURM_JOB_ID-$RESTART.ready"
rm -f "$LH_READY"
# --overlap: the lighthouse shares the first node's CPUs with that node's group step (a
# step without it would wait for CPUs the group holds).
srun --overlap --nodes=1 --ntasks=1 --nodelist="$FIRST" "$PY" -m tools.lighthouse --port "$LH_PORT" --min-replicas {{min_replicas}} --ready "$LH_READY" >>"$LH_LOG" 2>&1 &
LH_PID=$!
for _ in $(seq 240); do [ -e "$LH_READY" ] && break; kill -0 "$LH_PID" 2>/dev/null || break; sleep 0.5; done
if [ ! -e "$LH_READY" ]; then
  echo "[titanscale] $(date -Is) the lighthouse did not start (log: $LH_LOG)"
  kill "$LH_PID" 2>/dev/null; exit 1
fi
LIGHTHOUSE="http://$FIRST:$LH_PORT"
echo "[titanscale] $(date -Is) lighthouse $LIGHTHOUSE; $FT_GROUPS replica groups of $GROUP_NODES nodes"

run_group() { # run_group G VAR=VALUE... -- ARGS...: group G's job step on its nodes, re-launched alone on failure
  local g=$1 attempt=0 rc nodes master file="$GROUP_PREFIX-$1.txt" vars=(); shift
  while [ "$1" != -- ]; do vars+=("$1"); shift; done; shift
  nodes=$(paste -sd, "$file"); master=$(head -n 1 "$file")
  while true; do
    echo "[titanscale] $(date -Is) replica group $g: job step on $nodes (attempt $((attempt + 1)))"
    # The step's environment is srun's (set here: `srun --export=ALL,X=v` does not replace
    # a variable the batch shell already exports). A fresh rendezvous port per attempt: the
    # killed attempt's may still be held.
    env "${vars[@]}" TITANSCALE_NODE_ORDER="$file" MASTER_ADDR="$master" \
      MASTER_PORT=$((PORT0 + 2 + g + FT_GROUPS * attempt)) \
      srun --nodes="$GROUP_NODES" --ntasks="$GROUP_NODES" --ntasks-per-node=1 --nodelist="$nodes" \
      --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" --kill-on-bad-exit=1 bash "$NODE_SCRIPT" "$@"
    rc=$?
    if [ $rc -eq 0 ]; then echo "[titanscale] $(date -Is) replica group $g finished"; return 0; fi
    # Exit 2 is bad input (a re-launch repeats it); after a stop request the run is ending.
    if [ $rc -eq 2 ] || [ -e "$TITANSCALE_STOP_FILE" ]; then
      echo "[titanscale] $(date -Is) replica group $g exited $rc; not re-launched"; return $rc
    fi
    if [ $attempt -ge "$MAX_GROUP_RESTARTS" ]; then
      echo "[titanscale] $(date -Is) replica group $g exited $rc; no re-launches left ($MAX_GROUP_RESTARTS)"
      return $rc
    fi
    attempt=$((attempt + 1))
    echo "[titanscale] $(date -Is) replica group $g exited $rc; re-launching its step alone ($attempt of $MAX_GROUP_RESTARTS)"
  done
}

declare -a GROUP_PIDS
{{group_steps}}
rc=0
for pid in "${GROUP_PIDS[@]}"; do
  # `wait` returns early (>128) when a trapped signal arrives; the group keeps running.
  while true; do wait "$pid"; r=$?; [ $r -gt 128 ] && kill -0 "$pid" 2>/dev/null || break; done
  [ $rc -eq 0 ] && rc=$r
done
kill "$LH_PID" 2>/dev/null
wait "$LH_PID" 2>/dev/null
