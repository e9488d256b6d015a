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

A `[fault_tolerance]` recipe gets torchft replica groups instead of one torchrun over all
nodes (launch/ft_groups.sh): the lighthouse as a job step on the first node in topology
order (tools.lighthouse), then one `srun` job step per replica group on its own run of
consecutive nodes of that order (launch.topology.replica_group_nodes: a group stays under
its own leaf switches), each node running torchrun with the group's variables
(launch.ft_local.group_vars, as `tools.launch --local` gives them). A group's step that
exits non-zero is re-launched alone, up to `max_group_restarts` times, while the other
steps run on; the script ends when every group's step has.
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
from core.safe_text import (
    SBATCH_PATH,
    SBATCH_PATH_ALLOWED,
    bad_char,
    check_name,
    check_path,
    check_text,
    check_word,
)
from launch.fabric_env import FabricEnv, fabric_env
from launch.ft_local import group_vars
from launch.topology import leaf_switches_needed
from recipe.loader import (
    check_recipe,
    check_trainable_fault_tolerance,
    replica_group_recipe,
    replica_groups,
)
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
    qos: str = ""
    job_name: str = ""  # "" = recipe job.name
    python: str = field(default_factory=lambda: sys.executable)
    workdir: str = str(REPO_ROOT)
    preflight: bool = True
    signal_seconds: int = DEFAULT_SIGNAL_SECONDS
    switch_wait: str = DEFAULT_SWITCH_WAIT
    extra_sbatch: tuple[str, ...] = ()  # raw "#SBATCH" options, e.g. "--qos=high"
    master_port_base: int = 20000
    # A model resource instead of a training run: tools.serve's options (tools.launch
    # --serve); None: train.py.
    serve_args: tuple[str, ...] | None = None
    # [fault_tolerance] runs: re-launches of each replica group's job step before that
    # group is given up (the others train on without it).
    max_group_restarts: int = 3


_TIME = re.compile(r"(?:([0-9]{1,6})-)?([0-9]{1,9})(?::([0-9]{1,9}))?(?::([0-9]{1,9}))?")


def slurm_time_seconds(text: str) -> int | None:
    """Seconds in a Slurm time limit; None for UNLIMITED/INFINITE; ValueError if malformed.

    Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
    """
    # Exact: the text is written as is into an #SBATCH line (no stray space or newline).
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.fullmatch(text)
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
    check_shell_values(opts)
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
    if opts.serve_args is None:
        check_trainable_fault_tolerance(recipe)  # refused here, not after the queue wait
        if recipe.fault_tolerance.enabled:
            warnings += check_replica_groups(recipe, cluster, opts)
    if not 1 <= opts.signal_seconds <= 65535:  # sbatch --signal's limit
        raise ConfigError(
            f"expected seconds from 1 to 65535, got {opts.signal_seconds}", key="--signal-seconds"
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
    if recipe.checkpoint.interval == 0 and opts.serve_args is None:
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
    if not recipe.checkpoint.resume and opts.serve_args is None:
        warnings.append("checkpoint.resume = false: a requeued job will not resume")
    return layout, warnings


def check_replica_groups(recipe: Recipe, cluster: Cluster, opts: LaunchOptions) -> list[str]:
    """A [fault_tolerance] job: whole nodes per replica group (one job step each), each
    group's recipe valid on its share (what train.py checks in every group); warnings."""
    groups = replica_groups(recipe)
    if opts.nodes % groups:
        raise ConfigError(
            f"{opts.nodes} nodes do not split into {groups} replica groups of whole nodes "
            "(each group is its own job step on its own nodes)",
            file=recipe.source,
            key="fault_tolerance.replica_groups",
        )
    if opts.max_group_restarts < 0:
        raise ConfigError(
            f"expected an integer >= 0, got {opts.max_group_restarts}", key="--max-group-restarts"
        )
    per_group = opts.nodes // groups
    group_world = per_group * procs_per_node(cluster)
    check_recipe(replica_group_recipe(recipe), group_world, replica_group=True)
    npl = cluster.topology.nodes_per_leaf
    if npl and npl % per_group and per_group % npl:
        return [
            f"replica groups of {per_group} nodes do not tile leaf switches of {npl} nodes: "
            "some group spans one leaf switch more than it needs"
        ]
    return []


def has_replica_groups(recipe: Recipe, opts: LaunchOptions) -> bool:
    """The job trains torchft replica groups (launch/ft_groups.sh), not one training step."""
    return opts.serve_args is None and recipe.fault_tolerance.enabled


def ports_per_incarnation(recipe: Recipe, opts: LaunchOptions) -> int:
    """Ports one incarnation of the job uses from PORT0: pre-flight, then the training step's
    rendezvous or, with replica groups, the lighthouse and one rendezvous per group and
    attempt (a re-launched step gets a fresh port: emulated nodes share one port space)."""
    if not has_replica_groups(recipe, opts):
        return 2
    return 2 + replica_groups(recipe) * (opts.max_group_restarts + 1)


# Slurm partition (a comma list), account and QOS names: sbatch reads #SBATCH lines itself
# (whitespace splits, quotes and '#' are special), so only plain words reach them.
_SLURM_WORD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_PARTITIONS = re.compile(rf"{_SLURM_WORD.pattern}(?:,{_SLURM_WORD.pattern}){{0,31}}")
_SLURM_WORD_ALLOWED = "a Slurm name: letters, digits, '_', '.' or '-', not starting with '-'"
# --sbatch-arg: one option, `--name=value` or `-x`, value without whitespace, quotes, '#',
# '$', ';' or backticks; Slurm's own '%' file patterns are allowed.
_SBATCH_ARG = re.compile(
    r"-[A-Za-z]|--[A-Za-z][A-Za-z0-9-]{0,63}(?:=[A-Za-z0-9_.,:@/+=~%-]{1,1024})?"
)


def check_shell_values(opts: LaunchOptions) -> None:
    """Every string that reaches the job script or an #SBATCH line: a word from its field's
    character set, or one printable line that `render_sbatch` quotes (core.safe_text)."""
    if opts.partition:
        check_word(
            opts.partition, _PARTITIONS, _SLURM_WORD_ALLOWED + " (a comma list)", key="--partition"
        )
    for key, v in (("--account", opts.account), ("--qos", opts.qos)):
        if v:
            check_word(v, _SLURM_WORD, _SLURM_WORD_ALLOWED, key=key)
    if opts.job_name:  # job.name, the profile's name and [nccl.env] are checked at load
        check_name(opts.job_name, key="--job-name")
    # Paths in #SBATCH --output / --chdir lines (the output folder holds the log pattern).
    check_word(opts.output_dir, SBATCH_PATH, SBATCH_PATH_ALLOWED, key="--out")
    check_word(opts.workdir, SBATCH_PATH, SBATCH_PATH_ALLOWED, key="--workdir")
    for key, v in (
        ("--recipe", opts.recipe_path),
        ("--cluster", opts.cluster_path),
        ("--python", opts.python),
    ):
        check_path(v, key=key)
    for o in opts.overrides:
        check_text(o, key="--set", what="SECTION.KEY=VALUE")
    for a in opts.extra_sbatch:
        check_word(
            a, _SBATCH_ARG, "one option, --name=value or -x, the value of letters, digits and "
            "_ . , : @ / + = ~ % -", key="--sbatch-arg",
        )  # fmt: skip


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
    (the same folder on every requeue is what makes the restart find its checkpoint). A
    model resource: `tools.serve` (every rank of every node; rank 0 serves) with its
    checkpoints in <run folder>/service, the same folder on every requeue."""
    if opts.serve_args is not None:
        args = ["--module", "tools.serve", "--recipe", opts.recipe_path]
        args += ["--storage", str(Path(opts.output_dir) / "service"), *opts.serve_args]
        for o in opts.overrides:
            args += ["--set", o]
        return args
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


TEMPLATE = Path(__file__).with_name("job.sbatch")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")


def fill_template(template: str, values: dict[str, str | list[str]]) -> str:
    """`{{name}}` -> value. A placeholder alone on its line takes a block (a list of lines;
    an empty block leaves no line); elsewhere a string. Every placeholder must be given."""
    out: list[str] = []
    for line in template.splitlines():
        whole = _PLACEHOLDER.fullmatch(line.strip())
        if whole and isinstance(values.get(whole.group(1)), list):
            out.extend(_one_line(whole.group(1), v) for v in values[whole.group(1)])
            continue

        def value(m: re.Match[str]) -> str:
            v = values[m.group(1)]  # KeyError: a placeholder nobody fills
            if isinstance(v, list):
                raise ValueError(f"block {{{{{m.group(1)}}}}} must stand alone on its line")
            return _one_line(m.group(1), v)

        out.append(_PLACEHOLDER.sub(value, line))
    return "\n".join(out) + "\n"


def _one_line(name: str, text: str) -> str:
    """The renderer's invariant: a value is one line (check_shell_values refuses the rest, so
    this firing is a bug in a check, not bad input)."""
    ch = bad_char(text)
    if ch is not None or "\n" in text:
        raise ValueError(f"{{{{{name}}}}} holds U+{ord(ch or chr(10)):04X}: {text!r}")
    return text


def _header(recipe: Recipe, cluster: Cluster, layout: Layout, opts: LaunchOptions) -> list[str]:
    nproc = procs_per_node(cluster)
    switches = switches_needed(cluster, opts.nodes)
    npl = cluster.topology.nodes_per_leaf
    lines = [f"#   recipe:  {_q(opts.recipe_path)}"]
    if opts.overrides:
        lines.append(f"#   --set:   {_cmd(list(opts.overrides))}")
    lines += [
        f"#   cluster: {cluster.name} ({cluster.gpu} x {nproc} per node, fabric "
        f"{cluster.nccl.fabric})",
        f"#   world:   {opts.nodes} nodes x {nproc} = {opts.nodes * nproc} processes; layout "
        f"{layout.describe()}",
        f"#   leaves:  {switches} leaf switch{'es' if switches != 1 else ''} "
        f"({npl or 'all'} nodes per leaf in the profile)",
    ]
    return lines


def _sbatch_options(recipe: Recipe, cluster: Cluster, opts: LaunchOptions) -> list[str]:
    opt = [f"--job-name={opts.job_name or recipe.job.name}", f"--nodes={opts.nodes}"]
    opt.append("--ntasks-per-node=1")
    if cluster.gpu != "cpu":
        opt.append(f"--gpus-per-node={cluster.gpus_per_node}")
    opt += ["--exclusive", "--mem=0"]
    for flag, v in (
        ("partition", opts.partition),
        ("account", opts.account),
        ("qos", opts.qos),
        ("time", opts.time),
    ):
        if v:
            opt.append(f"--{flag}={v}")
    opt.append(f"--switches={switches_needed(cluster, opts.nodes)}@{opts.switch_wait}")
    lines = [f"#SBATCH {o}" for o in opt]
    seg = segment_size(cluster, opts.nodes)
    if seg:
        # Multi-node NVLink domains (NVL72): whole domains per segment (topology/block,
        # Slurm >= 23.11; older sbatch rejects the option).
        lines.append(f"#SBATCH --segment={seg}")
    log_dir = Path(opts.output_dir) / "logs"
    rest = [f"--signal=B:USR1@{opts.signal_seconds}", "--requeue", "--open-mode=append"]
    rest += [f"--output={log_dir}/%x-%j.out", f"--chdir={opts.workdir}", *opts.extra_sbatch]
    return lines + [f"#SBATCH {o}" for o in rest]


def _fabric_lines(cluster: Cluster) -> list[str]:
    env: FabricEnv = fabric_env(cluster.nccl.fabric, cluster.nccl.env, file=cluster.source)
    lines = []
    if env.unset_prefixes or env.unset_names:
        pats = "|".join(f"{p}*" for p in env.unset_prefixes)
        lines.append(
            "# No AWS EFA / libfabric settings on this fabric, even if the environment has them."
        )
        if pats:
            lines.append(f'for v in $(compgen -e); do case $v in {pats}) unset "$v" ;; esac; done')
        if env.unset_names:
            lines.append(f"unset {' '.join(env.unset_names)}")
    for k, v, origin in env.exports:
        note = "" if origin == "profile" else "  # titanscale default"
        lines.append(f"export {k}={_q(v)}{note}")
    if cluster.gpu == "cpu":
        lines.append("# CPU processes: one thread each (several processes share a node's cores).")
        lines.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    return lines


def _preflight_lines(opts: LaunchOptions) -> list[str]:
    if not opts.preflight:
        return []
    return [
        "# ---- pre-flight: a collective on every mesh group, placement.json ----",
        f"run_step $PORT0 {_cmd(preflight_args(opts))}",
        "rc=$?",
        'if [ $rc -ne 0 ]; then echo "[titanscale] pre-flight failed (exit $rc); not training"; '
        "exit $rc; fi",
    ]


FT_TEMPLATE = Path(__file__).with_name("ft_groups.sh")


def _main_lines(recipe: Recipe, opts: LaunchOptions) -> list[str]:
    """The job's main part: one training step over every node, or the replica groups."""
    if not has_replica_groups(recipe, opts):
        return [f"run_step $((PORT0 + 1)) {_cmd(train_args(opts))}", "rc=$?"]
    groups = replica_groups(recipe)
    steps = []
    for g in range(groups):
        # Double quotes: the lighthouse's address is the shell's $LIGHTHOUSE.
        env = " ".join(f'"{k}={v}"' for k, v in group_vars(g, "$LIGHTHOUSE").items())
        steps.append(f"run_group {g} {env} -- {_cmd(train_args(opts))} &")
        steps.append(f"GROUP_PIDS[{g}]=$!")
    text = fill_template(
        FT_TEMPLATE.read_text(),
        {
            "groups": str(groups),
            "group_nodes": str(opts.nodes // groups),
            "max_restarts": str(opts.max_group_restarts),
            "min_replicas": str(recipe.fault_tolerance.min_replicas),
            "group_steps": steps,
        },
    )
    lines = text.splitlines()  # from the fragment's first section line (not its own header)
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("# ----")) :]


def render_sbatch(recipe: Recipe, cluster: Cluster, layout: Layout, opts: LaunchOptions) -> str:
    """The sbatch script text, from launch/job.sbatch. Call `check_launch` first (it validates
    what this renders)."""
    span = ports_per_incarnation(recipe, opts)
    ft = has_replica_groups(recipe, opts)
    return fill_template(
        TEMPLATE.read_text(),
        {
            "header": _header(recipe, cluster, layout, opts),
            "sbatch": _sbatch_options(recipe, cluster, opts),
            "run_dir": _q(opts.output_dir),
            "log_dir": _q(str(Path(opts.output_dir) / "logs")),
            "python": _q(opts.python),
            "nproc": str(procs_per_node(cluster)),
            "fabric": cluster.nccl.fabric,
            "fabric_env": _fabric_lines(cluster),
            "node_order_args": _cmd(node_order_args(opts)),
            "master_port_base": str(opts.master_port_base),
            "signal_seconds": str(opts.signal_seconds),
            "grace": str(max(30, opts.signal_seconds - 60)),
            "preflight": _preflight_lines(opts),
            "main_comment": (
                []  # the replica groups' part has its own
                if ft
                else ["# ---- train (resumes from the latest checkpoint in the run folder) ----"]
                if opts.serve_args is None
                else [
                    "# ---- serve: tools.serve over every GPU (rank 0 serves HTTP; a requeue "
                    "serves the same storage) ----"
                ]  # fmt: skip
            ),
            "main": _main_lines(recipe, opts),
            # Ports one incarnation uses, twice that per job id (room for a restart).
            "port_offset": f"SLURM_JOB_ID * {2 * span} + RESTART * {span}",
            "group_prefix": (
                ['GROUP_PREFIX="$LOG_DIR/group-$SLURM_JOB_ID-$RESTART"'] if ft else []
            ),
            "group_files": (
                f' --replica-groups {replica_groups(recipe)} --group-files "$GROUP_PREFIX"'
                if ft
                else ""
            ),
        },
    )
