"""tools.torchrun's decisions without processes: which failures are bad input (exit 2), the
exit code a shell would report, the one-line summaries, and the hand-over of a rank's
message (core.errors.exit_on_config_error) that lets the wrapper print it once.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from core.errors import HANDOVER_DIR_ENV, HANDOVER_PID_ENV, ConfigError, exit_on_config_error
from tools.reliability_report import record_case
from tools.torchrun import exit_code, failure_lines, is_bad_input, read_messages

TERM = -int(signal.SIGTERM)


@pytest.mark.parametrize(
    "codes,bad",
    [
        ({0: 2, 1: 2}, True),
        ({1: 2, 0: TERM}, True),  # rank 0 stopped by the agent after rank 1's exit 2
        ({0: TERM, 1: TERM}, False),  # nobody reported bad input: signals from outside
        ({0: 2, 1: 1}, False),  # a real crash beside the bad input: not hidden
        ({0: 2, 1: -9}, False),
        ({0: 1}, False),
    ],
)
def test_bad_input_only_when_every_failure_is_exit_2(codes, bad):
    assert is_bad_input(codes) is bad
    record_case("torchrun", "failure classes")


def test_exit_codes_as_a_shell_reports_them():
    assert exit_code(3) == 3 and exit_code(-9) == 137 and exit_code(TERM) == 143


def test_failure_lines_one_per_rank_without_traceback_text():
    f = {
        1: SimpleNamespace(local_rank=1, exitcode=3, error_file="/tmp/e.json",
                           message="RuntimeError: boom\n  more"),
        0: SimpleNamespace(local_rank=0, exitcode=TERM, error_file="<N/A>",
                           message="Signal 15 (SIGTERM) received by PID 7"),
    }  # fmt: skip
    lines = failure_lines(f, "node7")
    assert lines == [
        "torchrun: rank 0 (local rank 0) on node7 stopped by torchrun (SIGTERM) after another "
        "rank failed",
        "torchrun: rank 1 (local rank 1) on node7 exit 3: RuntimeError: boom (error file "
        "/tmp/e.json)",
    ]
    killed = failure_lines({0: SimpleNamespace(local_rank=0, exitcode=-9, error_file="<N/A>",
                                               message="Signal 9 (SIGKILL) received")})  # fmt: skip
    assert killed == ["torchrun: rank 0 (local rank 0) killed by SIGKILL"]


@exit_on_config_error
def _bad() -> None:
    raise ConfigError("expected x", file="r.toml", key="a.b")


def test_rank_hands_its_line_over_only_to_its_own_wrapper(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(HANDOVER_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(HANDOVER_PID_ENV, str(os.getppid()))  # we are its child
    with pytest.raises(SystemExit) as e:
        _bad()
    assert e.value.code == 2 and capsys.readouterr().err == ""
    assert read_messages(tmp_path) == ["error: r.toml: a.b: expected x"]
    monkeypatch.setenv(HANDOVER_PID_ENV, "1")  # inherited by a grandchild: print it
    with pytest.raises(SystemExit):
        _bad()
    assert capsys.readouterr().err == "error: r.toml: a.b: expected x\n"
    record_case("torchrun", "message hand-over")


@exit_on_config_error
def _broken_collective() -> None:
    raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer")


def test_a_rank_failing_after_another_reported_stays_quiet(tmp_path, monkeypatch, capsys):
    """A rank whose collective broke because a peer exited with its one line (an RL reward
    failing on one rank only) exits 2 without a traceback; with no such line it raises."""
    monkeypatch.setenv(HANDOVER_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(HANDOVER_PID_ENV, str(os.getppid()))
    monkeypatch.setattr("core.errors.reported_elsewhere.__defaults__", (0.0,))
    with pytest.raises(RuntimeError):  # nobody reported: this rank's own error, as it is
        _broken_collective()
    (tmp_path / "rank-0-999999.txt").write_text("error: r.toml: rl.reward: returned nan\n")
    with pytest.raises(SystemExit) as e:
        _broken_collective()
    assert e.value.code == 2 and capsys.readouterr().err == ""
    assert read_messages(tmp_path) == ["error: r.toml: rl.reward: returned nan"]
    monkeypatch.setenv(HANDOVER_PID_ENV, "1")  # not under our wrapper: the traceback stands
    with pytest.raises(RuntimeError):
        _broken_collective()
    record_case("torchrun", "a rank failing after another rank's one line")


TORCHRUN_BAD = [
    (["--nproc_per_node=x"], "--nproc-per-node"),  # was ValueError from torch
    (["--nproc_per_node=0"], "--nproc-per-node"),  # was a bare AssertionError
    (["--nproc_per_node=-1"], "--nproc-per-node"),
    (["--nproc_per_node=100000"], "--nproc-per-node"),  # would fork 100000 processes
    (["--nnodes=abc"], "--nnodes"),  # was int() ValueError
    (["--nnodes=0"], "--nnodes"),
    (["--nnodes=3:2"], "--nnodes"),
    (["--nnodes=2", "--node-rank=2"], "--node-rank"),
    (["--nnodes=2", "--rdzv-endpoint=$(id):1"], "--rdzv-endpoint"),
    (["--master-addr=a;b"], "--master-addr"),
    (["--master-port=70000"], "--master-port"),
    (["--max-restarts=-1"], "--max-restarts"),
]


@pytest.mark.parametrize("opts,key", TORCHRUN_BAD, ids=[" ".join(o) for o, _ in TORCHRUN_BAD])
def test_torchrun_options_refused_before_anything_starts(opts, key, tmp_path):
    from torch.distributed.run import parse_args

    from tools.torchrun import check_torchrun_args

    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError) as e:
        check_torchrun_args(parse_args([*opts, str(script)]))
    assert e.value.key == key and "\n" not in str(e.value)
    record_case("torchrun", "launcher options")


def test_torchrun_missing_script_and_good_options(tmp_path):
    from torch.distributed.run import parse_args

    from tools.torchrun import check_torchrun_args

    with pytest.raises(ConfigError) as e:
        check_torchrun_args(parse_args(["--nproc_per_node=2", str(tmp_path / "none.py")]))
    assert e.value.key == "training_script"
    script = tmp_path / "s.py"
    script.write_text("")
    for ok in (["--nproc_per_node=2"], ["--nproc_per_node=cpu", "--nnodes=1:4"],
               ["--nnodes=2", "--node-rank=1", "--master-addr=node-1.cluster"]):  # fmt: skip
        check_torchrun_args(parse_args([*ok, str(script)]))
    check_torchrun_args(parse_args(["-m", "tools.plan"]))  # a module: not a file
    record_case("torchrun", "launcher options")


def test_torchrun_gpu_count_without_gpus(tmp_path):
    import torch
    from torch.distributed.run import parse_args

    from tools.torchrun import check_torchrun_args

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --nproc-per-node=gpu is valid here")
    with pytest.raises(ConfigError, match="Cuda is not available") as e:
        check_torchrun_args(parse_args(["--nproc_per_node=gpu", "-m", "tools.plan"]))
    assert e.value.key == "--nproc-per-node"
    record_case("torchrun", "launcher options")
