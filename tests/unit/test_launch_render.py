"""The sbatch script tools.launch renders: structure, fabric settings, errors."""

from __future__ import annotations

import re

import pytest

from core.errors import ConfigError
from launch.fabric_env import fabric_env
from launch.sbatch import slurm_time_seconds
from parallel.cluster import load_cluster
from tests.helpers.job_scripts import B200, render_job
from tests.helpers.runs import ROOT
from tools.launch import main as launch_main

SCALE_64 = ("parallel.world_size=512", "parallel.dp_replicate=8", "training.global_batch_size=512")

EFA_PROFILE = """
name = "p5_efa"
gpu = "H100"
nodes = 16
gpus_per_node = 8
nvlink_gbps = 3600
ib_gbps_per_gpu = 400
[topology]
nodes_per_leaf = 8
[nccl]
fabric = "efa"
[nccl.env]
FI_EFA_USE_DEVICE_RDMA = "1"
NCCL_SOCKET_IFNAME = "^lo,docker"
"""


def _sbatch(text: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, re.M):
        out[m.group(1)] = m.group(2) or ""
    return out


def _exports(text: str) -> dict[str, str]:
    return dict(re.findall(r"^export (\w+)=(\S+)", text, re.M))


def test_b200_8_nodes_structure():
    cluster = load_cluster("hgx_b200_ib")
    text, _ = render_job(B200, cluster, 8, time="04:00:00", partition="gpu")
    sb = _sbatch(text)
    assert sb["nodes"] == "8"
    assert sb["ntasks-per-node"] == "1"  # one torchrun per node
    assert sb["gpus-per-node"] == "8"
    assert sb["switches"] == "1@00:30:00"  # 8 nodes fit one 32-node leaf
    assert sb["signal"] == "B:USR1@600"
    assert "requeue" in sb and sb["open-mode"] == "append"
    assert sb["output"] == "/scratch/run/logs/%x-%j.out"
    assert sb["time"] == "04:00:00" and sb["partition"] == "gpu"
    # One process per GPU, static rendezvous with the topology-ordered node rank.
    assert "NPROC=8" in text
    assert '--node-rank="$TITANSCALE_NODE_RANK"' in text
    assert '--master-addr="$MASTER_ADDR"' in text
    assert 'export MASTER_ADDR=$(head -n 1 "$ORDER_FILE")' in text
    assert "-m tools.node_order" in text and "SLURM_TOPOLOGY_ADDR" in text
    # Requeue: trap, stop file, scontrol requeue; resume = same output folder.
    assert "trap on_time_limit USR1" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "--set job.output_dir=/scratch/run" in text
    assert "--module tools.preflight" in text


def test_ib_profile_exports_ib_settings_and_no_efa():
    cluster = load_cluster("hgx_b200_ib")
    text, _ = render_job(B200, cluster, 8)
    env = _exports(text)
    assert env["NCCL_IB_HCA"] == "mlx5"
    assert env["NCCL_CROSS_NIC"] == "0"
    assert env["NCCL_NVLS_ENABLE"] == "1"
    assert env["NCCL_NET_GDR_LEVEL"] == "PXB"
    assert env["NCCL_IB_DISABLE"] == "0"
    assert "NCCL_SOCKET_IFNAME" in env
    assert not [k for k in env if k.startswith(("FI_", "OFI_"))]
    assert "NCCL_PROTO" not in env
    # ... and inherited EFA settings are dropped.
    assert "FI_*|OFI_NCCL_*) unset" in text
    assert "unset NCCL_PROTO" in text


def test_efa_profile_exports_efa_settings(tmp_path):
    p = tmp_path / "p5_efa.toml"
    p.write_text(EFA_PROFILE)
    cluster = load_cluster(p)
    text, _ = render_job(
        ROOT / "recipes" / "llama3_70b_h100.toml", cluster, 8, overrides=("parallel.world_size=64",)
    )
    env = _exports(text)
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert "NCCL_IB_HCA" not in env and "NCCL_IB_DISABLE" not in env
    assert "unset" not in text.split("# ---- fabric")[1].split("# ----")[0]


def test_efa_setting_on_ib_profile_is_a_config_error(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(
        f'base = "{ROOT / "clusters" / "hgx_h100_ib.toml"}"\n[nccl.env]\nFI_PROVIDER = "efa"\n'
    )
    with pytest.raises(ConfigError) as e:
        fabric_env("infiniband", load_cluster(p).nccl.env, file=str(p))
    assert e.value.key == "nccl.env.FI_PROVIDER" and "EFA" in str(e.value)
    with pytest.raises(ConfigError):
        fabric_env("infiniband", {"NCCL_PROTO": "Simple"})


def test_64_nodes_ask_for_two_leaves():
    cluster = load_cluster("hgx_b200_ib")
    text, _ = render_job(B200, cluster, 64, overrides=SCALE_64)
    assert _sbatch(text)["switches"] == "2@00:30:00"
    assert "layout dp_replicate8 x dp_shard64" in text


def test_cpu_profile_runs_processes_not_gpus():
    cluster = load_cluster(ROOT / "clusters" / "slurmlab_cpu.toml")
    text, warnings = render_job(ROOT / "recipes" / "debug.toml", cluster, 4)
    sb = _sbatch(text)
    assert "gpus-per-node" not in sb
    assert "NPROC=2" in text and "OMP_NUM_THREADS" in text
    assert sb["switches"] == "2@00:30:00"
    assert not [k for k in _exports(text) if k.startswith("NCCL_")]
    assert any("checkpoint.interval = 0" in w for w in warnings)


def test_bad_launch_input():
    cluster = load_cluster("hgx_b200_ib")
    with pytest.raises(ConfigError) as e:  # the recipe declares 64 processes
        render_job(B200, cluster, 16)
    assert e.value.key == "parallel.world_size"
    with pytest.raises(ConfigError) as e:
        render_job(B200, cluster, 8, time="00:05:00")  # signal 600 s before a 300 s limit
    assert e.value.key == "--signal-seconds"
    with pytest.raises(ConfigError) as e:
        render_job(B200, cluster, 8, time="4 hours")
    assert e.value.key == "--time"
    with pytest.raises(ConfigError) as e:
        render_job(B200, cluster, 65, overrides=SCALE_64)
    assert e.value.key == "nodes"


def test_slurm_time_formats():
    assert slurm_time_seconds("90") == 5400
    assert slurm_time_seconds("10:30") == 630
    assert slurm_time_seconds("04:00:00") == 14400
    assert slurm_time_seconds("2-12") == 2 * 86400 + 12 * 3600
    assert slurm_time_seconds("1-00:30:00") == 86400 + 1800
    assert slurm_time_seconds("UNLIMITED") is None
    with pytest.raises(ValueError):
        slurm_time_seconds("1h")


def test_cli_dry_run_and_bad_input(capsys):
    rc = launch_main(
        ["--recipe", str(B200), "--cluster", "hgx_b200_ib", "--nodes", "8", "--dry-run"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("#!/bin/bash") and "#SBATCH --nodes=8" in out
    with pytest.raises(SystemExit) as e:
        launch_main(
            ["--recipe", str(B200), "--cluster", "hgx_b200_ib", "--nodes", "3", "--dry-run"]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "parallel.world_size" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        launch_main(["--recipe", str(B200), "--cluster", "hgx_b20_ib", "--nodes", "8", "--dry-run"])
    assert e.value.code == 2 and "did you mean 'hgx_b200_ib'" in capsys.readouterr().err


def test_nvl72_asks_for_whole_nvlink_domains():
    cluster = load_cluster("gb200_nvl72")
    recipe = ROOT / "recipes" / "llama3_70b.toml"
    # torchtitan's TP 8 layout (the shipped recipe's pp 4 x cp 2 x tp 4 does not divide 144)
    scale = ("parallel.dp_shard=-1", "training.global_batch_size=-1", "parallel.pp=1",
             "parallel.cp=1", "parallel.tp=8", "parallel.pp_microbatches=0")  # fmt: skip
    text, _ = render_job(recipe, cluster, 36, overrides=("parallel.world_size=144", *scale))
    sb = _sbatch(text)
    assert sb["segment"] == "18" and sb["switches"] == "2@00:30:00"
    assert sb["gpus-per-node"] == "4"
    _, warnings = render_job(recipe, cluster, 32, overrides=("parallel.world_size=128", *scale))
    assert any("not a multiple of the 18-node NVLink domain" in w for w in warnings)


def test_docs_examples_match_the_launcher(capsys):
    """docs/launch.md shows the real --dry-run output for 8 and 64 B200 nodes."""
    doc = (ROOT / "docs" / "launch.md").read_text()
    for nodes, sets in ((8, ()), (64, SCALE_64)):
        block = doc.split(f"<!-- dry-run: {nodes} -->\n```bash\n", 1)[1].split("```", 1)[0]
        args = [
            "--recipe", str(B200), "--cluster", "hgx_b200_ib", "--nodes", str(nodes),
            "--partition", "gpu", "--account", "llm", "--time", "2-00:00:00",
            "--workdir", "/shared/titanscale", "--python", "/shared/titanscale/.venv/bin/python",
            "--out", f"/shared/runs/llama3_70b_b200_{nodes}n", "--dry-run",
        ]  # fmt: skip
        for o in sets:
            args += ["--set", o]
        assert launch_main(args) == 0
        assert capsys.readouterr().out == block, f"docs/launch.md {nodes}-node example is stale"


def test_layout_that_leaves_nvlink_is_refused_before_submitting():
    cluster = load_cluster(ROOT / "clusters" / "slurmlab_cpu.toml")
    with pytest.raises(ConfigError) as e:  # tp 4 on 2-process nodes
        render_job(ROOT / "recipes" / "debug.toml", cluster, 4, overrides=("parallel.tp=4",))
    assert e.value.key == "parallel.tp"


def test_template_placeholders_are_all_filled():
    """The job script comes from launch/job.sbatch: every placeholder is filled for every
    shipped GPU profile, and a placeholder nobody fills is an error, not a silent blank."""
    from launch.sbatch import TEMPLATE, fill_template

    for name in ("hgx_h100_ib", "hgx_h200_ib", "hgx_b200_ib"):
        text, _ = render_job(B200, load_cluster(name), 8)
        assert "{{" not in text and "}}" not in text, name
        assert text.startswith("#!/bin/bash\n") and text.endswith("exit $rc\n")
    with pytest.raises(KeyError):
        fill_template(TEMPLATE.read_text(), {})
    assert fill_template("a\n{{b}}\nc {{d}}", {"b": [], "d": "x"}) == "a\nc x\n"
    assert fill_template("{{b}}", {"b": ["1", "2"]}) == "1\n2\n"
