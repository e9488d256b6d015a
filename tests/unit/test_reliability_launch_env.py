"""Environment variables a launch reads (core.launch_env): a malformed value is one line
naming the variable and what was expected, exit 2, before any process group.

Fuzzed with hypothesis (non-integers, signs, spaces, other scripts' digits, negatives,
rank >= world, huge, empty): every generated environment is either refused naming one of
its own variables, or accepted with values that equal Python's `int()` of the text and
satisfy torchrun's invariants (0 <= RANK < WORLD_SIZE, 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE
<= WORLD_SIZE, 1 <= MASTER_PORT <= 65535). Then named cases through `train.main` and
`tools.preflight`'s main in-process (the code paths of `python train.py`), where no metrics
file may appear: the run never started.
"""

from __future__ import annotations

import contextlib
import io
import os
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train
from core.errors import ConfigError
from core.launch_env import (
    MAX_WORLD_SIZE,
    LaunchEnv,
    check_visible_devices,
    parse_launch_env,
    worker_python,
)
from tools.preflight import main as preflight_main
from tools.reliability_report import record_case

INT_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "TITANSCALE_NODE_RANK",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT",
)  # fmt: skip
STR_VARS = ("MASTER_ADDR", "SLURMD_NODENAME", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES",
            "SLURM_TOPOLOGY_ADDR", "LOGLEVEL", "OMP_NUM_THREADS")  # fmt: skip
ALL_VARS = (*INT_VARS, *STR_VARS, "TITANSCALE_STOP_CHECK_S", "SLURM_TOPOLOGY_ADDR_PATTERN")

NUMBERS = st.one_of(
    st.integers(0, 8).map(str),
    st.integers(-3, 70000).map(str),
    st.sampled_from(["", " ", "x", "1.0", "+1", " 2", "2 ", "1_0", "0x10", "\u0661", "1e3",
                     "nan", "inf", "-0", "00", "2\n", str(10**30), str(MAX_WORLD_SIZE + 1)]),
    st.text(max_size=6),
)  # fmt: skip
WORDS = st.one_of(
    st.sampled_from(["node1", "10.0.0.1", "[::1]", "0,1", "GPU-1a2b", "-1", "", "a b",
                     "$(id)", "x\ny", "0,0", "123", "123_4"]),
    st.text(max_size=8),
)  # fmt: skip


def _is_uint(text: str) -> bool:
    return text != "" and all(c in string.digits for c in text)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    env=st.dictionaries(
        st.sampled_from(ALL_VARS),
        st.one_of(NUMBERS, WORDS),
        max_size=5,
    )
)
def test_fuzzed_launch_env_refused_or_consistent(env):
    try:
        got = parse_launch_env(env)
    except ConfigError as e:
        assert e.key in env and e.file == "environment", (e.key, env)
        assert "\n" not in str(e) and "expected" in str(e)
        record_case("train.py (env)", "launch variables (fuzzed)")
        return
    for var in INT_VARS:
        if var in env:  # accepted only as plain ASCII digits, read as int() reads them
            assert _is_uint(env[var]), (var, env[var])
    w = got.world_size
    assert 1 <= w <= MAX_WORLD_SIZE and 0 <= got.rank < w
    assert 1 <= got.local_world_size <= w and 0 <= got.local_rank < got.local_world_size
    assert 0 <= got.node_rank < got.nodes
    for var, field in (("WORLD_SIZE", w), ("RANK", got.rank), ("LOCAL_RANK", got.local_rank),
                       ("LOCAL_WORLD_SIZE", got.local_world_size),
                       ("MASTER_PORT", got.master_port),
                       ("TORCHELASTIC_RESTART_COUNT", got.restart_count)):  # fmt: skip
        if var in env:
            assert field == int(env[var])
    if got.master_port is not None:
        assert 1 <= got.master_port <= 65535
    if "WORLD_SIZE" not in env:  # a 1-process job: every rank is 0
        assert w == 1 and got.rank == 0 and got.local_rank == 0
    for var in ("MASTER_ADDR", "SLURMD_NODENAME"):
        v = env.get(var)
        if v:
            assert not set(v) & set(" \t\n\r'\"$`;|&<>()\\"), (var, v)
    record_case("train.py (env)", "launch variables (fuzzed, accepted)")


def test_visible_devices_per_process():
    check_visible_devices(LaunchEnv(world_size=8, local_world_size=8), 8)
    with pytest.raises(ConfigError) as e:
        check_visible_devices(
            LaunchEnv(world_size=8, local_world_size=8, cuda_visible_devices=("0", "1")), 2
        )
    assert e.value.key == "LOCAL_WORLD_SIZE" and "8 processes" in str(e.value)
    assert "2 visible GPUs" in str(e.value) and "0,1" in str(e.value)
    record_case("train.py (env)", "more processes than GPUs")


# (environment, the variable the one line must name)
CASES = [
    ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE"),  # the case: a traceback in metrics
    ({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "-1"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": str(10**30)}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
    ({"RANK": "3"}, "RANK"),  # no WORLD_SIZE: a 1-process job, not rank 3 of 1
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK"),
    ({"LOCAL_RANK": "x"}, "LOCAL_RANK"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2"}, "GROUP_RANK"),
    ({"TITANSCALE_NODE_RANK": "1"}, "TITANSCALE_NODE_RANK"),
    ({"MASTER_PORT": "x"}, "MASTER_PORT"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
    ({"MASTER_ADDR": "host; rm -rf /"}, "MASTER_ADDR"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR"),
    ({"TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT"),
    ({"SLURM_RESTART_COUNT": "-1"}, "SLURM_RESTART_COUNT"),
    ({"SLURM_JOB_ID": "12$(id)"}, "SLURM_JOB_ID"),
    ({"SLURMD_NODENAME": "n1\nn2"}, "SLURMD_NODENAME"),
    ({"CUDA_VISIBLE_DEVICES": "x"}, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "0,,1"}, "CUDA_VISIBLE_DEVICES"),
    ({"CUDA_VISIBLE_DEVICES": "0,0"}, "CUDA_VISIBLE_DEVICES"),
    ({"TITANSCALE_STOP_CHECK_S": "x"}, "TITANSCALE_STOP_CHECK_S"),
    ({"TITANSCALE_STOP_CHECK_S": "0"}, "TITANSCALE_STOP_CHECK_S"),
    ({"TITANSCALE_STOP_CHECK_S": "nan"}, "TITANSCALE_STOP_CHECK_S"),
    ({"TITANSCALE_STOP_CHECK_S": "-inf"}, "TITANSCALE_STOP_CHECK_S"),
    ({"OMP_NUM_THREADS": "x"}, "OMP_NUM_THREADS"),  # OpenMP would ignore it: all cores
    ({"OMP_NUM_THREADS": "0"}, "OMP_NUM_THREADS"),
    ({"LOGLEVEL": "x"}, "LOGLEVEL"),  # a ValueError inside torch's import
    ({"LOGLEVEL": "info"}, "LOGLEVEL"),
    ({"SLURM_TOPOLOGY_ADDR": "spine.leaf."}, "SLURM_TOPOLOGY_ADDR"),  # read after init
    ({"SLURM_TOPOLOGY_ADDR": "s.$(id)"}, "SLURM_TOPOLOGY_ADDR"),
    (
        {"SLURM_TOPOLOGY_ADDR": "s.l.n", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.node"},
        "SLURM_TOPOLOGY_ADDR",
    ),
]


@pytest.fixture
def clean_env():
    saved = dict(os.environ)
    for k in (*ALL_VARS, "MASTER_ADDR"):
        os.environ.pop(k, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def _one_line_exit_2(main, argv, var: str, *, after_torch: bool = False) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(argv)
    lines = err.getvalue().strip("\n").split("\n")
    assert e.value.code == 2 and "Traceback" not in err.getvalue(), err.getvalue()
    if after_torch:  # torch's own import-time warnings may precede it (not ours to count)
        lines = [ln for ln in lines if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(f"error: environment: {var}: expected"), lines


def _ids(cases):
    return [" ".join(f"{k}={x!r}" for k, x in e.items()) for e, _ in cases]


@pytest.mark.parametrize("env,var", CASES, ids=_ids(CASES))
def test_bad_launch_variable_through_train_main(clean_env, tmp_path, env, var):
    clean_env.update(env)
    out = tmp_path / "run"
    _one_line_exit_2(train.main, ["--set", f"job.output_dir={out}"], var)
    assert not (out / "metrics.jsonl").exists()
    record_case("train.py (env)", "launch variables")


@pytest.mark.parametrize("env,var", CASES[:8], ids=_ids(CASES[:8]))
def test_bad_launch_variable_through_preflight(clean_env, tmp_path, env, var):
    clean_env.update(env)
    _one_line_exit_2(preflight_main, ["--out", str(tmp_path / "pf")], var)
    record_case("tools.preflight", "launch variables")


# WORLD_SIZE > 1 without what torchrun sets with it: refused after the recipe checks, before
# the process group (was torchtitan's "LOCAL_RANK must be set" / torch's MASTER_ADDR error).
LATE = [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "LOCAL_RANK"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "MASTER_ADDR"),
    (
        {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost"},
        "MASTER_PORT",
    ),
]


@pytest.mark.parametrize("env,var", LATE, ids=_ids(LATE))
def test_partial_multi_process_launch_through_train_main(clean_env, tmp_path, env, var):
    clean_env.update(env)
    out = tmp_path / "run"
    _one_line_exit_2(train.main, ["--set", f"job.output_dir={out}"], var, after_torch=True)
    assert not (out / "metrics.jsonl").exists()
    record_case("train.py (env)", "launch variables")


@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(env=st.dictionaries(st.sampled_from(ALL_VARS), st.one_of(NUMBERS, WORDS), max_size=4))
def test_launch_tools_do_not_read_the_launch_variables(clean_env, tmp_path, env):
    """tools.launch renders the script on the login node and tools.node_order orders the
    gathered file: neither reads these variables, so hostile values change nothing (the job
    script's own `$SLURM_*` uses are bash's, on the nodes)."""
    from tools.launch import main as launch_main
    from tools.node_order import main as node_order_main

    argv = ["--recipe", "debug", "--cluster", "local_cpu", "--nodes", "1", "--dry-run"]
    gathered = tmp_path / "g.txt"
    gathered.write_text("n2 s.l1.n2\nn1 s.l0.n1\n")

    def both() -> list[str]:
        outs = []
        for main, args in ((launch_main, argv), (node_order_main, [str(gathered)])):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
                assert main(args) == 0
            outs.append(buf.getvalue())
        return outs

    before = both()
    clean_env.update({k: v.replace("\0", "") for k, v in env.items()})
    assert both() == before
    record_case("tools.launch", "launch variables (not read)")
    record_case("tools.node_order", "launch variables (not read)")


def test_worker_python_is_python_exec_where_set(monkeypatch):
    """The launchers' workers (tools.dryrun's ranks, tools.launch --local's groups) take
    $PYTHON_EXEC as torchrun's do, else this interpreter; an empty value is unset."""
    import sys

    assert worker_python({"PYTHON_EXEC": "/opt/py/bin/python"}) == "/opt/py/bin/python"
    assert worker_python({"PYTHON_EXEC": ""}) == sys.executable
    assert worker_python({}) == sys.executable
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python")
    assert worker_python() == "/opt/py/bin/python"
