"""The rendered job script is valid bash (bash -n, a subprocess)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from parallel.cluster import load_cluster
from tests.helpers.job_scripts import B200, render_job


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_rendered_script_parses_cleanly(tmp_path):
    cluster = load_cluster("hgx_b200_ib")
    text, _ = render_job(B200, cluster, 8, time="1-00:00:00")
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    proc = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
