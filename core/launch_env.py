"""The environment a launch hands a process, parsed and checked in one place (pure).

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_RESTART_COUNT; Slurm sets SLURM_JOB_ID, SLURM_RESTART_COUNT and
SLURMD_NODENAME; the job script sets TITANSCALE_NODE_RANK and TITANSCALE_STOP_CHECK_S.
Every module reads them through `launch_env()` (or `parse_launch_env(env)` in tests), so a
malformed value is one line naming the variable and what was expected (ConfigError, exit 2)
before any process group, never an `int()` traceback an hour into a run. Without WORLD_SIZE
the process is a 1-process job: a stray RANK=5 is refused, not trained as rank 5 of 1.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from core.errors import ConfigError, shown

# A torchft replica group's variables (launch.ft_local.group_vars sets them, the Slurm job
# script passes them to each group's step, runtime.fault_tolerance reads them).
REPLICA_ENV = "REPLICA_GROUP_ID"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"

# Larger than any job (about 100k GPUs today): a bound, so "WORLD_SIZE=10**30" is refused
# with a message instead of sizing meshes and buffers from it.
MAX_WORLD_SIZE = 2**20
MAX_RESTARTS = 10**6
# Plain ASCII digits: int() would also take " 3", "+3", "3_0" and other scripts' digits,
# which torch and the shell read differently.
_UINT = re.compile(r"[0-9]{1,12}")
# A host name or an IPv4/IPv6 address (RFC 1123 letters, digits, '-', '.', plus ':' '[' ']'
# '%' for IPv6 with a zone): it reaches sockets and the job script's node files.
_HOST = re.compile(r"[A-Za-z0-9_.:\[\]%-]{1,253}")
_CUDA_DEVICE = re.compile(r"-?[0-9]{1,4}|GPU-[0-9A-Fa-f-]{1,64}|MIG-[A-Za-z0-9/_-]{1,96}")

MULTI_PROCESS_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP_CHECK_ENV = "TITANSCALE_STOP_CHECK_S"
DEFAULT_STOP_CHECK_S = 10.0


def _err(name: str, expected: str, value: str) -> ConfigError:
    return ConfigError(f"expected {expected}, got {shown(value)}", file="environment", key=name)


def env_int(
    env: Mapping[str, str], name: str, default: int, *, lo: int, hi: int, expected: str
) -> int:
    """`name` as an integer in [lo, hi] (default when unset); ConfigError naming it otherwise."""
    raw = env.get(name)
    if raw is None:
        return default
    if not _UINT.fullmatch(raw) or not lo <= int(raw) <= hi:
        raise _err(name, expected, raw)
    return int(raw)


@dataclass(frozen=True)
class LaunchEnv:
    """What this process's launcher said about it (defaults: one process, no launcher)."""

    world_size: int = 1
    rank: int = 0
    local_world_size: int = 1
    local_rank: int = 0
    node_rank: int = 0  # GROUP_RANK (torchrun), else TITANSCALE_NODE_RANK (our job script)
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT
    slurm_restart_count: int = 0
    slurm_job_id: str = ""
    node_name: str | None = None  # SLURMD_NODENAME
    cuda_visible_devices: tuple[str, ...] | None = None  # None = unset (all devices)
    stop_check_s: float = DEFAULT_STOP_CHECK_S
    launched: bool = False  # WORLD_SIZE was set (torchrun or a launcher like it)

    @property
    def nodes(self) -> int:
        return math.ceil(self.world_size / self.local_world_size)


# torch's elastic logger calls logging.setLevel(os.environ["LOGLEVEL"]) at import: only
# these names work (not "info", not "10"); anything else is a ValueError inside torch.
_LOG_LEVELS = ("CRITICAL", "FATAL", "ERROR", "WARNING", "WARN", "INFO", "DEBUG", "NOTSET")


def check_torch_env(env: Mapping[str, str]) -> None:
    """Variables torch itself reads at import or start, which torchrun's parent reads too:
    LOGLEVEL (a traceback at import otherwise) and OMP_NUM_THREADS (OpenMP silently ignores
    a malformed value and uses every core in every process)."""
    level = env.get("LOGLEVEL")
    if level is not None and level not in _LOG_LEVELS:
        raise _err("LOGLEVEL", "one of " + ", ".join(_LOG_LEVELS), level)
    omp = env.get("OMP_NUM_THREADS")
    if omp is not None and not re.fullmatch(r"0*[1-9][0-9]{0,5}(,[0-9]{1,6}){0,7}", omp):
        raise _err("OMP_NUM_THREADS", "a positive thread count (or OpenMP's list, e.g. 4,2)", omp)


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """Check every launch variable in `env`; ConfigError (file "environment", key = the
    variable) on the first bad one."""
    check_torch_env(env)
    launched = "WORLD_SIZE" in env
    world = env_int(
        env, "WORLD_SIZE", 1, lo=1, hi=MAX_WORLD_SIZE,
        expected=f"a process count from 1 to {MAX_WORLD_SIZE}",
    )  # fmt: skip
    # Unset WORLD_SIZE = a 1-process job; then every rank must be 0.
    of = f"WORLD_SIZE={world}" if launched else "WORLD_SIZE unset: 1 process"
    rank = env_int(
        env, "RANK", 0, lo=0, hi=world - 1, expected=f"a rank from 0 to {world - 1} ({of})"
    )
    # torchrun always sets LOCAL_WORLD_SIZE; without it (another launcher) assume one node.
    lws = env_int(
        env, "LOCAL_WORLD_SIZE", world, lo=1, hi=world,
        expected=f"processes on this node, from 1 to {world} ({of})",
    )  # fmt: skip
    local = env_int(
        env, "LOCAL_RANK", 0, lo=0, hi=lws - 1,
        expected=f"a local rank from 0 to {lws - 1} (LOCAL_WORLD_SIZE {lws})",
    )  # fmt: skip
    nodes = math.ceil(world / lws)
    node_var = "GROUP_RANK" if "GROUP_RANK" in env else "TITANSCALE_NODE_RANK"
    node_rank = env_int(
        env, node_var, 0, lo=0, hi=nodes - 1,
        expected=f"a node rank from 0 to {nodes - 1} ({world} processes, {lws} per node)",
    )  # fmt: skip
    addr = env.get("MASTER_ADDR")
    if addr is not None and not _HOST.fullmatch(addr):
        raise _err("MASTER_ADDR", "a host name or IP address", addr)
    port = None
    if "MASTER_PORT" in env:
        port = env_int(env, "MASTER_PORT", 0, lo=1, hi=65535, expected="a TCP port, 1 to 65535")
    restarts = env_int(
        env, "TORCHELASTIC_RESTART_COUNT", 0, lo=0, hi=MAX_RESTARTS,
        expected="a restart count (a non-negative integer)",
    )  # fmt: skip
    slurm_restarts = env_int(
        env, "SLURM_RESTART_COUNT", 0, lo=0, hi=MAX_RESTARTS,
        expected="a restart count (a non-negative integer)",
    )  # fmt: skip
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id and not re.fullmatch(r"[0-9]{1,20}(_[0-9]{1,10})?", job_id):
        raise _err("SLURM_JOB_ID", "a Slurm job id (digits)", job_id)
    node_name = env.get("SLURMD_NODENAME") or None
    if node_name is not None and not _HOST.fullmatch(node_name):
        raise _err("SLURMD_NODENAME", "a host name", node_name)
    if env.get("SLURM_TOPOLOGY_ADDR"):  # read by the startup placement check, after init
        parse_topology_addr(env["SLURM_TOPOLOGY_ADDR"], env.get("SLURM_TOPOLOGY_ADDR_PATTERN", ""))
    cvd = _cuda_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    stop_check = DEFAULT_STOP_CHECK_S
    raw = env.get(STOP_CHECK_ENV)
    if raw is not None:
        try:
            stop_check = float(raw)
        except ValueError:
            stop_check = -1.0
        if not (re.fullmatch(r"[0-9.eE+-]{1,32}", raw) and 0 < stop_check <= 86400):
            raise _err(STOP_CHECK_ENV, "seconds between stop-file checks, >0 and <= 86400", raw)
    return LaunchEnv(
        world_size=world,
        rank=rank,
        local_world_size=lws,
        local_rank=local,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        restart_count=restarts,
        slurm_restart_count=slurm_restarts,
        slurm_job_id=job_id,
        node_name=node_name,
        cuda_visible_devices=cvd,
        stop_check_s=stop_check,
        launched=launched,
    )


def _cuda_visible_devices(raw: str | None) -> tuple[str, ...] | None:
    """CUDA's list: indices, GPU-<uuid> or MIG-<id>, comma-separated; '' or -1 = no GPUs.

    CUDA silently stops at the first entry it cannot read, so "x" or "0,,1" would hide GPUs
    without a word (a GPU job training on CPU); refuse them instead."""
    if raw is None:
        return None
    if raw.strip() == "":
        return ()
    items = raw.split(",")
    bad = [i for i in items if not _CUDA_DEVICE.fullmatch(i.strip())]
    if bad or len({i.strip() for i in items}) != len(items):
        raise _err(
            "CUDA_VISIBLE_DEVICES",
            "distinct comma-separated GPU indices, GPU-<uuid> or MIG-<id> ('' = none)",
            raw,
        )
    return tuple(i.strip() for i in items)


def parse_topology_addr(addr: str, pattern: str = "") -> tuple[tuple[str, ...], str]:
    """`SLURM_TOPOLOGY_ADDR` ("spine.leaf1.node1") -> (("spine", "leaf1"), "node1").

    With `SLURM_TOPOLOGY_ADDR_PATTERN` ("switch.switch.node") the fields are checked.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,1024}", addr):
        raise _err("SLURM_TOPOLOGY_ADDR", "dot-separated switch and node names", addr)
    parts = addr.split(".")
    if pattern:
        kinds = pattern.split(".")
        if len(kinds) != len(parts) or kinds[-1] != "node":
            raise _err(
                "SLURM_TOPOLOGY_ADDR",
                f"the fields of its pattern (SLURM_TOPOLOGY_ADDR_PATTERN {shown(pattern)})",
                addr,
            )
    if not parts[-1]:
        raise _err("SLURM_TOPOLOGY_ADDR", "a node name after the last '.' (empty)", addr)
    return tuple(parts[:-1]), parts[-1]


def require_launch_vars(env: Mapping[str, str] | None = None) -> None:
    """WORLD_SIZE > 1 is a multi-process launch: torch's env:// rendezvous and torchtitan's
    device choice need RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun sets them all;
    without, a ValueError inside torch). Called last before the process group, after the
    recipe checks, which say more about a job that could not run anyway."""
    env = os.environ if env is None else env
    world = launch_env(env).world_size
    for var in MULTI_PROCESS_VARS if world > 1 else ():
        if var not in env:
            raise ConfigError(
                f"expected it to be set: WORLD_SIZE={world} is a multi-process launch, which "
                "sets it (python -m tools.torchrun ...)",
                file="environment",
                key=var,
            )


def worker_python(env: Mapping[str, str] | None = None) -> str:
    """The interpreter for the Python processes a launcher starts: $PYTHON_EXEC where set (the
    variable torchrun reads for its workers), else this process's own."""
    import sys

    return (os.environ if env is None else env).get("PYTHON_EXEC") or sys.executable


def fill_single_process(environ: MutableMapping[str, str]) -> None:
    """A 1-process job (`python train.py`, `WORLD_SIZE=1`): give torch's env:// rendezvous and
    torchtitan what torchrun would (rank 0, a free local port); keeps what is already set.
    Not pure: it binds a socket to find the port."""
    if launch_env(environ).world_size != 1:
        return
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                 ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):  # fmt: skip
        environ.setdefault(k, v)
    if "MASTER_PORT" not in environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            environ["MASTER_PORT"] = str(s.getsockname()[1])


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment of this process (os.environ by default), checked."""
    return parse_launch_env(os.environ if env is None else env)


def check_visible_devices(env: LaunchEnv, device_count: int) -> None:
    """On GPUs: every local process needs its own visible device (LOCAL_RANK picks one;
    more processes than devices would put two on one GPU and run out of memory later)."""
    if env.local_world_size > device_count:
        cvd = env.cuda_visible_devices
        seen = "unset" if cvd is None else ",".join(cvd) or "''"
        raise ConfigError(
            f"{env.local_world_size} processes on this node but {device_count} visible GPUs "
            f"(CUDA_VISIBLE_DEVICES {seen}): lower --nproc-per-node or show more GPUs",
            file="environment",
            key="LOCAL_WORLD_SIZE",
        )
