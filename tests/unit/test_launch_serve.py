"""tools.launch --serve: the job script runs a model resource (tools.serve on every GPU of
every node under tools.torchrun) with its storage in the run folder, after the resource's
plan and tools.serve's own checks passed (bad input: one line, exit 2, nothing submitted)."""

from __future__ import annotations

import pytest

from tools.launch import main as launch_main

SERVE_70B = ["--recipe", "recipes/serve_llama3_70b.toml", "--cluster", "hgx_h100_ib"]


def test_serve_job_script_runs_tools_serve_on_every_gpu(capsys, tmp_path):
    rc = launch_main([*SERVE_70B, "--nodes", "1", "--serve", "--out", str(tmp_path / "run"),
                      "--serve-arg=--host=0.0.0.0", "--serve-arg=--api-key-file=/shared/keys",
                      "--set", "checkpoint.load_from=/shared/base/step-0", "--dry-run"])  # fmt: skip
    text = capsys.readouterr().out
    assert rc == 0
    step = next(x for x in text.splitlines() if x.startswith("run_step $((PORT0 + 1))"))
    assert "--module tools.serve --recipe" in step and "train.py" not in step
    assert f"--storage {tmp_path / 'run' / 'service'}" in step
    assert "--host=0.0.0.0 --api-key-file=/shared/keys" in step
    assert "--set checkpoint.load_from=/shared/base/step-0" in step
    assert '--nproc-per-node="$NPROC"' in text and "NPROC=8" in text
    assert "tools.preflight" not in text  # it checks a training layout


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--recipe", "recipes/serve_llama3_405b.toml", "--cluster", "hgx_h100_ib",
          "--nodes", "1"], ["model.flavor", "cannot hold this base"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--generators=2"], ["--generators"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--host=0.0.0.0"], ["--api-key-file"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--storage=/x"], ["--serve-arg"]),
        # abbreviations of the launcher's own options, and control characters (#41)
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--rec=x.toml"], ["--serve-arg", "--recipe"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--stor=/x"], ["--serve-arg", "--storage"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--se=a=1"], ["--serve-arg"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--host=a\nb"], ["--serve-arg", "control"]),
        ([*SERVE_70B, "--nodes", "1", "--serve-arg=--port=1\x1b"], ["--serve-arg", "control"]),
        ([*SERVE_70B, "--nodes", "1", "--dry-run-rank", "0"], ["--dry-run-rank", "--serve"]),
    ],
)  # fmt: skip
def test_bad_serve_launch_is_one_line_before_submitting(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        launch_main([*argv, "--serve", "--dry-run"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert all(w in err for w in words) and "Traceback" not in err


def test_serve_arg_without_serve_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        launch_main([*SERVE_70B, "--nodes", "1", "--serve-arg=--port=8000", "--dry-run"])
    assert e.value.code == 2 and "--serve-arg needs --serve" in capsys.readouterr().err
