"""The Slurm job script for torchft replica groups (launch/sbatch.py + launch/ft_groups.sh):
one job step per group with the variables train.py reads, groups on whole leaves of the
switch order, the restart loop run in bash against a fake `srun`, and bad input refused by
key before anything is submitted (docs/fault_tolerance.md)."""

from __future__ import annotations

import random
import re
import subprocess

import pytest

from core.errors import ConfigError
from parallel.cluster import load_cluster
from recipe.loader import load_recipe
from runtime import fault_tolerance as rft
from tests.helpers.job_scripts import render_job
from tests.helpers.runs import ROOT
from tools.launch import main as launch_main
from tools.node_order import main as node_order_main

DEBUG = ROOT / "recipes" / "debug.toml"
FT = ("fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2")


def _script(groups: int = 2, nodes: int = 4, **kw) -> str:
    sets = ("fault_tolerance.enabled=true", f"fault_tolerance.replica_groups={groups}")
    return render_job(DEBUG, load_cluster("slurmlab_cpu"), nodes, sets, **kw)[0]


def test_one_step_per_group_with_the_variables_train_py_reads():
    text = _script(groups=2, max_group_restarts=5)
    calls = re.findall(r"^run_group (\d+) (.*?) -- (.*) &$", text, re.M)
    assert [int(g) for g, _, _ in calls] == [0, 1]
    recipe = load_recipe(DEBUG, list(FT))
    for g, assigns, args in calls:
        # What the step's ranks get, read back by train.py's own parsers.
        env = dict(a.strip('"').split("=", 1) for a in assigns.split())
        assert rft.replica_id(env, 2) == int(g)
        env = {k: v.replace("$LIGHTHOUSE", "http://node1:20001") for k, v in env.items()}
        assert rft.lighthouse(recipe, env) == "http://node1:20001"
        assert args.endswith("--set job.output_dir=/scratch/run") and "train.py" in args
    # The lighthouse: its own step, on the first node in switch order, before the groups.
    lh = text.index("-m tools.lighthouse")
    assert 'FIRST=$(head -n 1 "$ORDER_FILE")' in text and '--nodelist="$FIRST"' in text
    assert text.index("srun --overlap") < lh < text.index("run_group 0 ")
    assert "--min-replicas 1" in text and 'LIGHTHOUSE="http://$FIRST:$LH_PORT"' in text
    # Each group's step: its own node list (node_order's group file), torchrun on those nodes.
    assert "--replica-groups 2 --group-files" in text
    assert re.search(r'srun --nodes="\$GROUP_NODES" --ntasks="\$GROUP_NODES" .*--nodelist="\$nodes"',
                     text)  # fmt: skip
    assert "GROUP_NODES=2" in text and "MAX_GROUP_RESTARTS=5" in text
    assert '--nnodes="$SLURM_STEP_NUM_NODES"' in text
    # No whole-job training step.
    assert "run_step $((PORT0 + 1))" not in text
    # Ports: pre-flight, lighthouse, one per group and attempt, per incarnation.
    assert "SLURM_JOB_ID * 28 + RESTART * 14" in text  # 2 + 2 groups x 6 attempts


def test_script_is_valid_bash(tmp_path):
    f = tmp_path / "job.sbatch"
    f.write_text(_script(groups=4))
    p = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True, check=False)
    assert p.returncode == 0 and p.stderr == "", p.stderr


def test_plain_jobs_keep_one_step():
    text = render_job(DEBUG, load_cluster("slurmlab_cpu"), 4)[0]
    assert "run_step $((PORT0 + 1)) " in text and "run_group" not in text
    assert "tools.lighthouse" not in text and "--replica-groups" not in text
    assert "SLURM_JOB_ID * 4 + RESTART * 2" in text and "GROUP_PREFIX" not in text


@pytest.mark.parametrize("seed", range(3))
def test_groups_are_runs_of_the_switch_order(tmp_path, capsys, seed):
    """4 leaves of 4 nodes, names shuffled against the cabling: 4 groups of 4 nodes are the
    4 leaves, 2 groups of 8 are two leaves each (under one spine when it has them)."""
    nodes = [f"n{i:02d}" for i in range(16)]
    random.Random(seed).shuffle(nodes)
    leaf = {n: f"leaf{i // 4}" for i, n in enumerate(nodes)}
    spine = {n: f"spine{i // 8}" for i, n in enumerate(nodes)}
    lines = [f"{n} {spine[n]}.{leaf[n]}.{n}" for n in nodes]
    random.Random(seed + 1).shuffle(lines)  # arrival order
    gathered = tmp_path / "gathered.txt"
    gathered.write_text("\n".join(lines) + "\n")
    for groups, key in ((4, leaf), (2, spine)):
        prefix = tmp_path / f"g{groups}"
        args = [str(gathered), "--replica-groups", str(groups), "--group-files", str(prefix)]
        assert node_order_main(args) == 0
        order = capsys.readouterr().out.split()
        members = [(tmp_path / f"g{groups}-{g}.txt").read_text().split() for g in range(groups)]
        assert sum(members, []) == order  # consecutive runs, in the order's node ranks
        for m in members:
            assert len(m) == 16 // groups and len({key[n] for n in m}) == 1, m
    with pytest.raises(SystemExit) as e:
        node_order_main([str(gathered), "--replica-groups", "3", "--group-files", str(prefix)])
    assert e.value.code == 2 and "--replica-groups" in capsys.readouterr().err


def _run_group(tmp_path, codes: list[int], max_restarts: int, stop: bool = False):
    """The rendered `run_group` in bash, `srun` a fake that logs its environment and exits
    with the next code of `codes`."""
    text = _script(max_group_restarts=max_restarts)
    fn = text[text.index("run_group() {") : text.index("\n}\n", text.index("run_group() {")) + 3]
    (tmp_path / "codes").write_text("".join(f"{c}\n" for c in codes))
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(
        "#!/bin/bash\n"
        'echo "$MASTER_ADDR $MASTER_PORT $REPLICA_GROUP_ID $TORCHFT_LIGHTHOUSE $* " >>"$CALLS"\n'
        'c=$(head -n 1 "$CODES"); sed -i 1d "$CODES"; exit "$c"\n'
    )
    srun.chmod(0o755)
    (tmp_path / "grp-1.txt").write_text("node2\nnode4\n")
    script = (
        f'export PATH="{tmp_path}/bin:$PATH" CALLS="{tmp_path}/calls" CODES="{tmp_path}/codes"\n'
        f'GROUP_PREFIX="{tmp_path}/grp" PORT0=100 FT_GROUPS=2 GROUP_NODES=2 NODE_SCRIPT=ns.sh\n'
        f"MAX_GROUP_RESTARTS={max_restarts} LIGHTHOUSE=http://node1:101\n"
        f'TITANSCALE_STOP_FILE="{tmp_path}/stop"\n'
        + (f'touch "{tmp_path}/stop"\n' if stop else "")
        + fn
        + 'run_group 1 "REPLICA_GROUP_ID=1" "TORCHFT_LIGHTHOUSE=$LIGHTHOUSE" -- train.py --x "a b"\n'
        'echo "rc=$?"\n'
    )
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    calls = (tmp_path / "calls").read_text().splitlines()
    return p.stdout, calls


def test_restart_loop_relaunches_a_failed_group_alone(tmp_path):
    out, calls = _run_group(tmp_path, [137, 1, 0], max_restarts=3)
    # Three steps for group 1 on its nodes, a fresh rendezvous port each (PORT0 + 2 + g + 2a).
    assert [c.split()[:4] for c in calls] == [
        ["node2", str(p), "1", "http://node1:101"] for p in (103, 105, 107)
    ]
    assert all("--nodelist=node2,node4" in c and "ns.sh train.py --x a b" in c for c in calls)
    assert "re-launching its step alone (1 of 3)" in out and "(2 of 3)" in out
    assert "replica group 1 finished" in out and out.rstrip().endswith("rc=0")


@pytest.mark.parametrize(
    ("codes", "max_restarts", "stop", "launches", "rc", "why"),
    [
        ([137, 137, 137], 2, False, 3, 137, "no re-launches left (2)"),
        ([2], 3, False, 1, 2, "not re-launched"),  # bad input: a re-launch repeats it
        ([143], 3, True, 1, 143, "not re-launched"),  # the run is stopping for the time limit
    ],
)
def test_restart_loop_bounds(tmp_path, codes, max_restarts, stop, launches, rc, why):
    out, calls = _run_group(tmp_path, codes, max_restarts, stop)
    assert len(calls) == launches and why in out and out.rstrip().endswith(f"rc={rc}")


def test_bad_groups_refused_by_key_before_anything(capsys):
    cluster = load_cluster("slurmlab_cpu")
    with pytest.raises(ConfigError) as e:
        render_job(DEBUG, cluster, 3, FT)  # 3 nodes, 2 groups: not whole nodes
    assert e.value.key == "fault_tolerance.replica_groups" and "whole nodes" in str(e.value)
    with pytest.raises(ConfigError) as e:
        render_job(DEBUG, cluster, 4, FT, max_group_restarts=-1)
    assert e.value.key == "--max-group-restarts"
    # 4 groups of one 2-process node: valid for each group (train.py's check of its share).
    assert "run_group 3 " in _script(groups=4)
    args = ["--recipe", str(DEBUG), "--cluster", "slurmlab_cpu", "--nodes", "3", "--dry-run"]
    with pytest.raises(SystemExit) as ex:
        launch_main(args + [a for s in FT for a in ("--set", s)])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fault_tolerance.replica_groups" in err[0], err


def test_group_that_would_straddle_a_leaf_is_warned():
    # 6 nodes under 2-node leaves: 3 groups of 2 tile the leaves; 2 groups of 3 do not.
    cluster = load_cluster("slurmlab_cpu").with_nodes(6)
    sets = ("fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2")
    _, warnings = render_job(DEBUG, cluster, 6, sets)
    assert any("do not tile leaf switches" in w for w in warnings), warnings
    _, warnings = render_job(DEBUG, cluster, 6, FT[:1] + ("fault_tolerance.replica_groups=3",))
    assert not any("leaf" in w for w in warnings), warnings
