"""tools.plan, tools.predict and tools.reproduce, run in-process on their real arguments."""

from __future__ import annotations

import json

import pytest

from tests.helpers.mesh import groups_by_coordinates
from tools import plan as plan_cli
from tools import predict as predict_cli
from tools import reproduce as reproduce_cli

PLAN_KEYS = {
    "dp_replicate", "dp_shard", "tp", "pp", "cp", "pp_schedule", "microbatches",
    "activation_checkpoint", "memory_gib_per_gpu", "tokens_per_sec_per_gpu", "mfu_pct",
    "cross_switch_gb_per_step",
}  # fmt: skip


def test_plan_json(capsys):
    plan_cli.main(
        ["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib", "--top", "5", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["plans"] and len(out["plans"]) == 5
    assert all(set(p) >= PLAN_KEYS for p in out["plans"])
    tps = [p["tokens_per_sec_per_gpu"] for p in out["plans"]]
    assert tps == sorted(tps, reverse=True)
    for p in out["plans"]:
        assert p["dp_replicate"] * p["dp_shard"] * p["tp"] * p["pp"] * p["cp"] == 64
        assert set(p["cross_switch_gb_per_step"]) == {"leaf", "spine"}


def test_plan_placement_16_nodes_4_leaves_shuffled(capsys):
    args = ["--recipe", "llama3_70b", "--cluster", "hgx_h100_16n_4leaf", "--nodes", "16",
            "--top", "3", "--placement", "--shuffle-hosts", "5", "--placement-rows", "8"]  # fmt: skip
    plan_cli.main(args)
    text = capsys.readouterr().out
    assert "planned" in text and "plain rank order" in text and "tp groups" in text
    plan_cli.main([*args, "--json"])
    pl = json.loads(capsys.readouterr().out)["placement"]
    assert pl["planned"]["spine_gb_per_step"] < pl["plain rank order"]["spine_gb_per_step"]
    assert pl["planned"]["tp_cp_inside_nvlink"]
    assert sorted(pl["rank_order"]) == list(range(128))
    assert len(pl["node_order"]) == 16
    # mesh_permutation_safe, from its definition: every group of every mesh axis lists its
    # ranks in increasing order (torch's DeviceMesh sorts them). Groups by coordinates here.
    top = plan_cli_plans(args)[0]
    dims = [top[a] for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")]
    order = pl["rank_order"]

    increasing = all(g == sorted(g) for axis in groups_by_coordinates(order, dims) for g in axis)
    assert pl["mesh_permutation_safe"] is increasing


def plan_cli_plans(args):
    """The --json plans of tools.plan for `args` (without the placement section)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        plan_cli.main([*args, "--json"])
    return json.loads(buf.getvalue())["plans"]


def test_plan_from_slurm_topology(tmp_path, capsys):
    topo = tmp_path / "topo.txt"
    topo.write_text(
        "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=gpu[1-2]\n"
        "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=gpu[3-4]\n"
        "SwitchName=spine Level=1 LinkSpeed=1 Nodes=gpu[1-4] Switches=leaf[1-2]\n"
    )
    plan_cli.main(["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--slurm-topology",
                   str(topo), "--nodelist", "gpu[4,1,3,2]", "--placement", "--top", "1"])  # fmt: skip
    text = capsys.readouterr().out
    assert "on 4 x 8 H100" in text and "spine/leaf1" in text and "gpu4" in text


def test_predict_json_and_set(capsys):
    base = ["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib", "--json"]
    predict_cli.main(base)
    bf16 = json.loads(capsys.readouterr().out)
    for k in ("tokens_per_sec_per_gpu", "tokens_per_sec_per_node", "mfu_pct", "step_time_s",
              "memory_gib_per_gpu", "breakdown"):  # fmt: skip
        assert k in bf16
    assert bf16["layout"] == {"pp": 8, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 4}
    assert sum(bf16["breakdown"].values()) == pytest.approx(bf16["step_time_s"], rel=1e-3)
    predict_cli.main([*base, "--set", "kernels.linear=fp8_rowwise", "--set", "parallel.tp=4",
                      "--set", "parallel.dp_shard=-1", "--set", "parallel.pp=1",
                      "--set", "parallel.cp=1", "--set", "parallel.pp_microbatches=0",
                      "--set", "training.local_batch_size=4"])  # fmt: skip
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["layout"]["tp"] == 4 and fp8["layout"]["dp_shard"] == 16
    predict_cli.main([*base, "--set", "parallel.auto=true"])
    auto = json.loads(capsys.readouterr().out)
    # the recipe ships at the planner's best layout (tests/unit/test_recipes_at_best.py)
    assert auto["tokens_per_sec_per_gpu"] >= bf16["tokens_per_sec_per_gpu"] * (1 - 1e-9)
    assert "plan" in auto


@pytest.mark.parametrize(
    "argv,fragment,clis",
    [
        (["--recipe", "llama3_8b", "--cluster", "hgx_h100_lb"], "did you mean 'hgx_h100_ib'", "pd"),
        (
            ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--set", "parallel.tpp=2"],
            "did you mean 'tp'",
            "pd",
        ),  # fmt: skip
        (["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--nodes", "0"], "--nodes", "pd"),
        (["--recipe", "nope", "--cluster", "hgx_h100_ib"], "file not found", "pd"),
        # The planner ignores the recipe's degrees; pricing them checks them.
        (
            [
                "--recipe",
                "llama3_8b",
                "--cluster",
                "hgx_h100_ib",
                "--nodes",
                "3",
                "--set",
                "parallel.tp=3",
                "--set",
                "parallel.dp_shard=-1",
                "--set",
                "parallel.world_size=0",
            ],
            "parallel.tp: tp=3 must divide the attention heads",
            "d",
        ),  # fmt: skip
    ],
)
def test_bad_input_exits_2_with_one_line(argv, fragment, clis, capsys):
    for cli in [{"p": plan_cli, "d": predict_cli}[k] for k in clis]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err


def test_reproduce_together(tmp_path, capsys):
    reproduce_cli.main(["--out", str(tmp_path), "--nodes", "8"])
    text = capsys.readouterr().out
    report = (tmp_path / "report.md").read_text()
    data = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    b200 = {p["reading"]: p for p in data["together_b200"]["physics"]}
    assert b200["per_gpu"]["pct_of_bf16_peak"] > 300 and "impossible" in b200["per_gpu"]["verdict"]
    assert 35 < b200["per_node"]["pct_of_bf16_peak"] < 45
    assert "possible" in b200["per_node"]["verdict"]
    assert data["together_h100"]["predictions"][0]["tokens_per_sec_per_gpu"] > 0
    assert data["together_b200"]["measured"] == [] and "Measured: none" in report
    assert "per 8-GPU node" in text


def test_reproduce_bad_claims(tmp_path):
    bad = tmp_path / "claims.toml"
    bad.write_text('[[claim]]\nid = "x"\nvalue = -1.0\n')
    with pytest.raises(SystemExit) as e:
        reproduce_cli.main(["--claims", str(bad), "--out", str(tmp_path)])
    assert e.value.code == 2
