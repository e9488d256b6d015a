"""Render the sbatch script for a recipe on a cluster (pure: no Slurm, no torch).

    layout, warnings = check_launch(recipe, cluster, opts)
    text = render_sbatch(recipe, cluster, layout, opts)

The script runs one Slurm task per node; each task runs torchrun with one process per GPU
(per configured CPU process on a `gpu = "cpu"` profile). Node ranks follow the switch tree:
the script gathers every node's SLURM_TOPOLOGY_ADDR, orders the nodes as the planner
places them (tools.node_order -> parallel.placement.node_order), and starts
torchrun's static rendezvous with ``--node-rank=<index in that order>`` and the first node
in that order as master, so global ranks r*G..r*G+G-1 sit on the r-th node in topology order
and nodes under one leaf switch hold consecutive ranks. A SIGUSR1 some minutes before the
time limit asks the run to checkpoint and stop, then requeues the job; on restart train.py
resumes from the latest checkpoint in the same output folder.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from core.axes import Layout
from core.errors import ConfigError
from launch.fabric_env import FabricEnv, fabric_env
from launch.topology import leaf_switches_needed
from recipe.loader import check_recipe
from recipe.schema import Recipe

if TYPE_CHECKING:  # the profile schema lives in parallel.cluster
    from parallel.cluster import Cluster

REPO_ROOT = Path(__file__).resolve().parent.parent

# Default warning before the time limit. A full 70B training state is ~1.1 TB (bf16 weights,
# fp32 master + Adam = 16 B/parameter); at a few GB/s of aggregate filesystem bandwidth
# that is minutes, plus the step in flight. Slurm delivers the signal within about a minute
# of the requested time (its controller checks periodically).
DEFAULT_SIGNAL_SECONDS = 600
# How long `--switches` may hold the job pending waiting for the fewest leaf switches;
# Slurm caps it at SchedulerParameters=max_switch_wait (300 s by default).
DEFAULT_SWITCH_WAIT = "00:30:00"


@dataclass(frozen=True)
class LaunchOptions:
    nodes: int
    output_dir: str  # absolute run folder: logs, the script, metrics, checkpoints
    recipe_path: str  # absolute path of the recipe file
    cluster_path: str  # absolute path of the cluster profile
    overrides: tuple[str, ...] = ()  # --set for train.py (job.output_dir is added)
    partition: str = ""
    time: str = ""  # Slurm time limit ("HH:MM:SS", "D-HH:MM" ...); "" = the partition's
    account: str = ""
    job_name: str = ""  # "" = recipe job.name
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = str(REPO_ROOT)
    preflight: bool = True
    signal_seconds: int = DEFAULT_SIGNAL_SECONDS
    switch_wait: str = DEFAULT_SWITCH_WAIT
    extra_sbatch: tuple[str, ...] = ()  # raw "#SBATCH" options, e.g. "--qos=high"
    master_port_base: int = 20000


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def slurm_time_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit; None for UNLIMITED/INFINITE; ValueError if malformed.

    Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
    """
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(t)
    if not m:
        raise ValueError(f"not a Slurm time: {text!r}")
    d, a, b, c = m.groups()
    if d is not None:  # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return int(d) * 86400 + h * 3600 + mi * 60 + s
    if b is None:  # M
        return int(a) * 60
    if c is None:  # M:S
        return int(a) * 60 + int(b)
    return int(a) * 3600 + int(b) * 60 + int(c)  # H:M:S


def node_path(path: Path, workdir: str) -> str:
    """`path` as the nodes see it: inside this checkout -> under `workdir`, else absolute."""
    p = path.resolve()
    try:
        return str(Path(workdir) / p.relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def procs_per_node(cluster: Cluster) -> int:
    """torchrun processes per node: one per GPU (a CPU profile's gpus_per_node = processes)."""
    return cluster.gpus_per_node


def check_launch(recipe: Recipe, cluster: Cluster, opts: LaunchOptions) -> tuple[Layout, list[str]]:
    """Validate the launch (ConfigError naming the key); return the layout and warnings."""
    warnings: list[str] = []
    if opts.nodes < 1:
        raise ConfigError(f"expected a positive node count, got {opts.nodes}", key="--nodes")
    if opts.nodes > cluster.nodes:
        raise ConfigError(
            f"{opts.nodes} nodes requested but the profile describes {cluster.nodes}",
            file=cluster.source,
            key="nodes",
        )
    world = opts.nodes * procs_per_node(cluster)
    layout = check_recipe(recipe, world)
    if opts.signal_seconds < 1:
        raise ConfigError(
            f"expected a positive number, got {opts.signal_seconds}", key="--signal-seconds"
        )
    if opts.time:
        try:
            limit = slurm_time_seconds(opts.time)
        except ValueError as e:
            raise ConfigError(str(e), key="--time") from None
        if limit is not None and opts.signal_seconds >= limit:
            raise ConfigError(
                f"the checkpoint signal comes {opts.signal_seconds}s before the limit, but the "
                f"limit is only {limit}s",
                key="--signal-seconds",
            )
    try:
        slurm_time_seconds(opts.switch_wait)
    except ValueError as e:
        raise ConfigError(str(e), key="--switch-wait") from None
    fabric_env(cluster.nccl.fabric, cluster.nccl.env, file=cluster.source)  # raises on EFA mix
    # The planner's placement of this layout on the profile's hosts: the job's node-order
    # step repeats it on the real allocation; failing here costs no queue wait.
    from parallel.placement import PlacementError, planned_rank_order

    try:
        planned_rank_order(layout, cluster.with_nodes(opts.nodes).fabric())
    except PlacementError as e:
        raise ConfigError(str(e), file=recipe.source, key="parallel.tp") from None
    if recipe.checkpoint.interval == 0:
        warnings.append(
            "checkpoint.interval = 0: a requeued job restarts from step 0 unless the run "
            "saves on the stop request (set checkpoint.interval)"
        )
    npd = cluster.nodes_per_domain
    if npd > 1 and opts.nodes % npd:
        warnings.append(
            f"{opts.nodes} nodes is not a multiple of the {npd}-node NVLink domain: one domain "
            "is shared with other jobs (no --segment)"
        )
    if not recipe.checkpoint.resume:
        warnings.append("checkpoint.resume = false: a requeued job will not resume")
    return layout, warnings


def switches_needed(cluster: Cluster, nodes: int) -> int:
    """Leaf switches for `nodes` nodes: ceil(nodes / nodes_per_leaf) (0 = one leaf holds all)."""
    t = cluster.topology
    if t.switches:
        # Explicit switch list: the smallest leaf decides the worst case we ask for.
        fab = cluster.fabric()
        sizes = sorted(
            (sum(1 for h in fab.hosts if h.leaf == leaf) for leaf in {h.leaf for h in fab.hosts}),
            reverse=True,
        )
        need, have = 0, 0
        for s in sizes:
            if have >= nodes:
                break
            have += s
            need += 1
        return max(need, 1)
    return leaf_switches_needed(nodes, t.nodes_per_leaf or max(cluster.nodes, nodes))


def segment_size(cluster: Cluster, nodes: int) -> int:
    """`sbatch --segment` for profiles whose NVLink domain spans nodes (0 = none)."""
    npd = cluster.nodes_per_domain
    return npd if npd > 1 and nodes % npd == 0 else 0


def _q(s: str) -> str:
    return shlex.quote(str(s))


def _cmd(args: list[str]) -> str:
    return " ".join(_q(a) for a in args)


def train_args(opts: LaunchOptions) -> list[str]:
    """train.py's arguments: the recipe, the user's overrides, and the fixed output folder
    (the same folder on every requeue is what makes the restart find its checkpoint)."""
    args = [str(Path(opts.workdir) / "train.py"), "--recipe", opts.recipe_path]
    for o in (*opts.overrides, f"job.output_dir={opts.output_dir}"):
        args += ["--set", o]
    return args


def node_order_args(opts: LaunchOptions) -> list[str]:
    """The planner places the recipe's layout on the profile (and refuses one whose tp x cp
    groups would leave an NVLink domain)."""
    args = ["--cluster", opts.cluster_path, "--recipe", opts.recipe_path]
    for o in opts.overrides:
        args += ["--set", o]
    return args


def preflight_args(opts: LaunchOptions) -> list[str]:
    args = ["--module", "tools.preflight", "--recipe", opts.recipe_path]
    args += ["--cluster", opts.cluster_path, "--out", str(Path(opts.output_dir) / "preflight")]
    for o in opts.overrides:
        args += ["--set", o]
    return args


def render_sbatch(recipe: Recipe, cluster: Cluster, layout: Layout, opts: LaunchOptions) -> str:
    """The sbatch script text. Call `check_launch` first (it validates what this renders)."""
    env: FabricEnv = fabric_env(cluster.nccl.fabric, cluster.nccl.env, file=cluster.source)
    nproc = procs_per_node(cluster)
    world = opts.nodes * nproc
    name = opts.job_name or recipe.job.name
    switches = switches_needed(cluster, opts.nodes)
    run_dir = opts.output_dir
    log_dir = str(Path(run_dir) / "logs")
    gpu = cluster.gpu != "cpu"
    grace = max(30, opts.signal_seconds - 60)
    L: list[str] = []
    a = L.append
    a("#!/bin/bash")
    a("# Generated by `python -m tools.launch` (titanscale). Change the recipe or the cluster")
    a("# profile and launch again rather than editing this file.")
    a(f"#   recipe:  {opts.recipe_path}")
    if opts.overrides:
        a(f"#   --set:   {' '.join(opts.overrides)}")
    a(
        f"#   cluster: {cluster.name} ({cluster.gpu} x {nproc} per node, fabric {cluster.nccl.fabric})"
    )
    a(f"#   world:   {opts.nodes} nodes x {nproc} = {world} processes; layout {layout.describe()}")
    npl = cluster.topology.nodes_per_leaf
    a(
        f"#   leaves:  {switches} leaf switch{'es' if switches != 1 else ''} "
        f"({npl or 'all'} nodes per leaf in the profile)"
    )
    a(f"#SBATCH --job-name={name}")
    a(f"#SBATCH --nodes={opts.nodes}")
    a("#SBATCH --ntasks-per-node=1")
    if gpu:
        a(f"#SBATCH --gpus-per-node={cluster.gpus_per_node}")
    a("#SBATCH --exclusive")
    a("#SBATCH --mem=0")
    if opts.partition:
        a(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        a(f"#SBATCH --account={opts.account}")
    if opts.time:
        a(f"#SBATCH --time={opts.time}")
    a(f"#SBATCH --switches={switches}@{opts.switch_wait}")
    seg = segment_size(cluster, opts.nodes)
    if seg:
        # Multi-node NVLink domains (NVL72): whole domains per segment (topology/block,
        # Slurm >= 23.11; older sbatch rejects the option).
        a(f"#SBATCH --segment={seg}")
    a(f"#SBATCH --signal=B:USR1@{opts.signal_seconds}")
    a("#SBATCH --requeue")
    a("#SBATCH --open-mode=append")
    a(f"#SBATCH --output={log_dir}/%x-%j.out")
    a(f"#SBATCH --chdir={opts.workdir}")
    for extra in opts.extra_sbatch:
        a(f"#SBATCH {extra}")
    a("")
    a("# No `set -e`: the script must reach its requeue logic after a failed step.")
    a("set -uo pipefail")
    a(f"RUN_DIR={_q(run_dir)}")
    a(f"LOG_DIR={_q(log_dir)}")
    a(f"PY={_q(opts.python)}")
    a(f"NPROC={nproc}")
    a("RESTART=${SLURM_RESTART_COUNT:-0}")
    a('mkdir -p "$LOG_DIR"')
    a("export RUN_DIR LOG_DIR PY NPROC")
    a(
        'echo "[titanscale] $(date -Is) job $SLURM_JOB_ID restart $RESTART: '
        '$SLURM_JOB_NUM_NODES nodes ($SLURM_JOB_NODELIST)"'
    )
    a("")
    a(f"# ---- fabric: {cluster.nccl.fabric} (cluster profile [nccl]) ----")
    if env.unset_prefixes or env.unset_names:
        pats = "|".join(f"{p}*" for p in env.unset_prefixes)
        a("# No AWS EFA / libfabric settings on this fabric, even if the environment has them.")
        if pats:
            a(f'for v in $(compgen -e); do case $v in {pats}) unset "$v" ;; esac; done')
        if env.unset_names:
            a(f"unset {' '.join(env.unset_names)}")
    for k, v, origin in env.exports:
        note = "" if origin == "profile" else "  # titanscale default"
        a(f"export {k}={_q(v)}{note}")
    if not gpu:
        a("# CPU processes: one thread each (several processes share a node's cores).")
        a("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    a("export PYTHONUNBUFFERED=1")
    a("")
    a("# ---- node order: sort the allocation by switch path (spine.leaf.node) ----")
    a('NODES_FILE="$LOG_DIR/nodes-$SLURM_JOB_ID-$RESTART.txt"')
    a('ORDER_FILE="$LOG_DIR/node_order-$SLURM_JOB_ID-$RESTART.txt"')
    a('TOPO_FILE="$LOG_DIR/topology-$SLURM_JOB_ID-$RESTART.txt"')
    a(
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 '
        'bash -c \'echo "$SLURMD_NODENAME ${SLURM_TOPOLOGY_ADDR:-}"\' >"$NODES_FILE" || exit 1'
    )
    a('scontrol show topology >"$TOPO_FILE" 2>/dev/null || true')
    a(
        '"$PY" -m tools.node_order "$NODES_FILE" --scontrol-topology "$TOPO_FILE" '
        f'{_cmd(node_order_args(opts))} >"$ORDER_FILE" || exit 1'
    )
    a('export TITANSCALE_NODE_ORDER="$ORDER_FILE"')
    a('export MASTER_ADDR=$(head -n 1 "$ORDER_FILE")')
    a("# A port per job and restart: emulated nodes may share one host's port space.")
    a(f"PORT0=$(( {opts.master_port_base} + (SLURM_JOB_ID * 4 + RESTART * 2) % 20000 ))")
    a("")
    a("# ---- per node: node rank = position in the topology order; torchrun static rendezvous")
    a('NODE_SCRIPT="$LOG_DIR/node-$SLURM_JOB_ID-$RESTART.sh"')
    a("cat >\"$NODE_SCRIPT\" <<'NODE'")
    a("set -uo pipefail")
    a('NODE_RANK=$(grep -n -x -F "$SLURMD_NODENAME" "$TITANSCALE_NODE_ORDER" | cut -d: -f1)')
    a(
        '[ -n "$NODE_RANK" ] || { echo "node $SLURMD_NODENAME is not in $TITANSCALE_NODE_ORDER" >&2; exit 1; }'
    )
    a("export TITANSCALE_NODE_RANK=$((NODE_RANK - 1))")
    a('exec >>"$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID-$SLURMD_NODENAME.out" 2>&1')
    a(
        'echo "[titanscale] $(date -Is) $SLURMD_NODENAME (${SLURM_TOPOLOGY_ADDR:-no switch path}) '
        'node_rank $TITANSCALE_NODE_RANK of $SLURM_JOB_NUM_NODES, master $MASTER_ADDR:$MASTER_PORT: $*"'
    )
    a(
        'exec "$PY" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" '
        '--nproc-per-node="$NPROC" --node-rank="$TITANSCALE_NODE_RANK" '
        '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" --max-restarts=0 "$@"'
    )
    a("NODE")
    a("")
    a("run_step() { # run_step PORT ARGS...: one task per node, all of the node's CPUs")
    a("  local port=$1 pid rc; shift")
    a(
        '  MASTER_PORT=$port srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
        '--cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" --kill-on-bad-exit=1 '
        'bash "$NODE_SCRIPT" "$@" &'
    )
    a("  pid=$!")
    a("  # `wait` returns early (>128) when a trapped signal arrives; the step keeps running.")
    a(
        '  while true; do wait "$pid"; rc=$?; [ $rc -gt 128 ] && kill -0 "$pid" 2>/dev/null || break; done'
    )
    a("  return $rc")
    a("}")
    a("")
    a(
        f"# ---- time limit: SIGUSR1 {opts.signal_seconds}s before it -> checkpoint, stop, requeue ----"
    )
    a('export TITANSCALE_STOP_FILE="$RUN_DIR/stop-request-$SLURM_JOB_ID"')
    a('rm -f "$TITANSCALE_STOP_FILE" "$TITANSCALE_STOP_FILE.saved"')
    a("GUARD_PID=")
    a("on_time_limit() {")
    a(
        '  echo "[titanscale] $(date -Is) SIGUSR1: time limit near; asking the run to '
        'checkpoint and stop"'
    )
    a('  touch "$TITANSCALE_STOP_FILE"')
    a(f"  # If the run has not stopped {grace}s from now (it may not watch the stop file), requeue")
    a("  # anyway: the time limit would end it regardless; it resumes from its last checkpoint.")
    a(
        f'  ( sleep {grace}; echo "[titanscale] run still going after {grace}s; requeueing"; '
        'scontrol requeue "$SLURM_JOB_ID" ) &'
    )
    a("  GUARD_PID=$!")
    a("}")
    a("trap on_time_limit USR1")
    a("")
    a("rc=0")
    if opts.preflight:
        a("# ---- pre-flight: a collective on every mesh group, placement.json ----")
        a(f"run_step $PORT0 {_cmd(preflight_args(opts))}")
        a("rc=$?")
        a(
            'if [ $rc -ne 0 ]; then echo "[titanscale] pre-flight failed (exit $rc); not training"; exit $rc; fi'
        )
    a("# ---- train (resumes from the latest checkpoint in the run folder) ----")
    a(f"run_step $((PORT0 + 1)) {_cmd(train_args(opts))}")
    a("rc=$?")
    a("trap - USR1")
    a('[ -n "$GUARD_PID" ] && kill "$GUARD_PID" 2>/dev/null')
    a(
        'if [ -e "$TITANSCALE_STOP_FILE" ] && { [ -e "$TITANSCALE_STOP_FILE.saved" ] || [ $rc -ne 0 ]; }; then'
    )
    a('  echo "[titanscale] $(date -Is) stopped for the time limit (exit $rc); requeueing"')
    a('  scontrol requeue "$SLURM_JOB_ID"')
    a("fi")
    a('echo "[titanscale] $(date -Is) job $SLURM_JOB_ID restart $RESTART: exit $rc"')
    a("exit $rc")
    return "\n".join(L) + "\n"
