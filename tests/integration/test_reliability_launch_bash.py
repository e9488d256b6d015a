"""Accepted free text in the job script, read back by bash itself: `bash -n` parses the whole
script, and bash runs its quoted lines (PY=, RUN_DIR=, the pre-flight and train commands,
the profile's exports) with `run_step` replaced by `printf '%s\\0'`, so every argument must
come back byte for byte and no `$(...)` or backtick in a value may run (a marker file).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.runs import ROOT
from tools.launch import main as launch_main
from tools.reliability_report import record_case

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

PROFILE = """
name = "cpu_hostile"
gpu = "cpu"
nodes = 1
gpus_per_node = 2
[nccl]
fabric = "none"
[nccl.env]
GLOO_SOCKET_IFNAME = "{value}"
"""


def values(marker: Path) -> list[str]:
    return [
        f"$(touch {marker})",
        f"`touch {marker}`; touch {marker}",
        'it\'s "quoted" \\ back\\slash',
        "${HOME} $HOME ~ * ? [a] {b,c} !x %j #not-a-comment",
        "-starts-with-dash --and=this",
        "é ünïcode ✓",
        "a" * 3000,
    ]


def render(tmp_path: Path, value: str, capsys) -> str:
    recipe = tmp_path / "my 'recipe' $(x).toml"
    recipe.write_text((ROOT / "recipes" / "debug.toml").read_text())
    profile = tmp_path / "p.toml"
    profile.write_text(PROFILE.replace("{value}", value.replace("\\", "\\\\").replace('"', '\\"')))
    rc = launch_main([
        "--recipe", str(recipe), "--cluster", str(profile), "--nodes", "1", "--dry-run",
        f"--python={value}", f"--set=job.description={value}", "--set", "training.steps=3",
        "--out", str(tmp_path / "run"),
    ])  # fmt: skip
    assert rc == 0
    return capsys.readouterr().out


def test_quoted_values_round_trip_through_bash(tmp_path, capsys):
    marker = tmp_path / "ran"
    for value in values(marker):
        text = render(tmp_path, value, capsys)
        script = tmp_path / "job.sbatch"
        script.write_text(text)
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert p.returncode == 0 and p.stderr == "", p.stderr
        lines = text.split("\n")
        wanted = [
            ln for ln in lines
            if ln.startswith(("PY=", "RUN_DIR=", "run_step ", "export GLOO_SOCKET_IFNAME="))
        ]  # fmt: skip
        probe = (
            "run_step() { shift; printf '%s\\0' \"$@\"; printf '\\1'; }\nPORT0=1\n"
            + "\n".join(wanted)
            + '\nprintf \'%s\\0\' "$PY" "$RUN_DIR" "$GLOO_SOCKET_IFNAME"\n'
        )
        out = subprocess.run(["bash", "-c", probe], capture_output=True, check=True).stdout
        preflight, train, tail = out.decode().split("\1")
        recipe = str(tmp_path / "my 'recipe' $(x).toml")
        assert train.split("\0")[:-1] == [
            str(ROOT / "train.py"), "--recipe", recipe, "--set", f"job.description={value}",
            "--set", "training.steps=3", "--set", f"job.output_dir={tmp_path / 'run'}",
        ]  # fmt: skip
        assert f"job.description={value}" in preflight.split("\0")
        assert tail.split("\0")[:-1] == [value, str(tmp_path / "run"), value]
        assert not marker.exists(), f"a value ran as a command: {value!r}"
        record_case("tools.launch", "shell injection (bash round trip)")
