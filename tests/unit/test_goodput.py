"""parallel.goodput against hand-computed formulas (Young 1974, Daly 2006) and the
[fault_tolerance] / cluster-field validation."""

import math

import pytest

from core.errors import ConfigError
from parallel import goodput as gp


def _inputs(**kw):
    base = dict(
        gpus=1000,
        tokens_per_sec_per_gpu=1000.0,
        step_time_s=10.0,
        failures_per_gpu_hour=1e-4,  # M = 3600 / 0.1 = 36,000 s
        state_bytes=1e12,  # 1 TB
        checkpoint_bytes_per_s_per_gpu=1e8,  # 1e9 B per GPU / 1e8 = 10 s write
        net_bytes_per_s_per_gpu=5e10,
        restart_s=290.0,
        replica_groups=10,
        lighthouse_gpus=8,
        detect_s=10.0,
        reconfigure_s=30.0,
    )
    base.update(kw)
    return gp.GoodputInputs(**base)


def test_whole_job_matches_young_and_daly_by_hand():
    g = gp.whole_job_restart(_inputs())
    m, c, r = 36_000.0, 10.0, 300.0  # R = restart 290 + read 10
    t = math.sqrt(2 * c * m)  # Young: 848.5 s
    assert g.checkpoint_interval_s == pytest.approx(t)
    assert g.checkpoint_interval_steps == round(t / 10.0)
    e = t / (t + c) * (1 - (r + (t + c) / 2) / m)
    assert g.efficiency == pytest.approx(e)
    assert g.goodput_tokens_per_sec_per_gpu == pytest.approx(1000.0 * e)
    assert 0.96 < e < 0.97  # 0.9648 by hand


def test_young_interval_is_near_the_optimum():
    i = _inputs()
    best = gp.whole_job_restart(i)
    for factor in (0.5, 0.8, 1.25, 2.0):
        other = gp.whole_job_restart(i, best.checkpoint_interval_s * factor)
        assert other.efficiency < best.efficiency


def test_per_replica_by_hand():
    g = gp.per_replica_recovery(_inputs())
    # Heal: 1e12 B over 100 GPUs of a group at 5e10 B/s = 0.2 s.
    h = 1e12 / 100 / 5e10
    lost = 10.0 + 10.0 + 2 * 30.0 + (290.0 + 2 * h) / 10
    assert g.lost_per_failure_s == pytest.approx(lost)
    m_whole = 3600 / (1e-4 * 8)
    t = math.sqrt(2 * 10.0 * m_whole)
    assert g.checkpoint_interval_s == pytest.approx(t)
    e = t / (t + 10) * (1 - (300 + (t + 10) / 2) / m_whole) - lost / 36_000
    assert g.efficiency == pytest.approx(e)
    assert g.efficiency > gp.whole_job_restart(_inputs()).efficiency


def test_zero_failure_rate_and_one_group():
    g = gp.whole_job_restart(_inputs(failures_per_gpu_hour=0.0))
    assert g.efficiency == 1.0 and g.checkpoint_interval_s is None
    one = gp.per_replica_recovery(_inputs(replica_groups=1))
    whole = gp.whole_job_restart(_inputs(replica_groups=1))
    assert one.mode == "per_replica_recovery" and one.efficiency == whole.efficiency


def test_cluster_default_is_metas_figure_and_bounds():
    from parallel.cluster import Cluster

    c = Cluster()
    # 419 interruptions / (54 days x 24 h x 16,384 GPUs)
    assert c.failures_per_gpu_hour == pytest.approx(1.973e-5, rel=1e-3)
    with pytest.raises(ConfigError, match="failures_per_gpu_hour"):
        Cluster(failures_per_gpu_hour=-1)
    with pytest.raises(ConfigError, match="checkpoint_gbps_per_gpu"):
        Cluster(checkpoint_gbps_per_gpu=0)


def test_fault_tolerance_section_validation():
    from recipe.loader import check_fault_tolerance, load_recipe, recipe_degrees

    def check_recipe(recipe, world_size):  # the layout part of recipe.loader.check_recipe
        layout = recipe_degrees(recipe, world_size)
        check_fault_tolerance(recipe, layout)
        return layout

    ok = load_recipe(None, ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2"])
    assert check_recipe(ok, world_size=4).world_size == 4
    cases = [
        (["fault_tolerance.enabled=true"], 4, "fault_tolerance.replica_groups"),
        (["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=3"], 4, "evenly"),
        (
            ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2",
             "fault_tolerance.min_replicas=3"],
            4,
            "fault_tolerance.min_replicas",
        ),
        (
            ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2",
             "parallel.dp_replicate=4"],
            4,
            "dp_replicate",
        ),
    ]  # fmt: skip
    for sets, world, want in cases:
        with pytest.raises(ConfigError, match=want):
            check_recipe(load_recipe(None, sets), world_size=world)
    with pytest.raises(ConfigError, match="lighthouse"):
        load_recipe(None, ["fault_tolerance.lighthouse=http://a b:1"])
    with pytest.raises(ConfigError, match="semi_sync"):
        load_recipe(None, ["fault_tolerance.semi_sync=diloko"])


def test_predict_prints_both_goodputs_at_4096_gpus(capsys):
    import json

    from tools import predict as predict_cli

    predict_cli.main(["--recipe", "llama3_70b_h100", "--cluster", "hgx_h100_ib", "--nodes",
                      "512", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 4096
    tps = out["tokens_per_sec_per_gpu"]
    gp_ = out["goodput"]
    m = 3600 / (gp_["failures_per_gpu_hour"] * 4096)  # 12.4 h for 4,096 GPUs
    for mode in ("whole_job_restart", "per_replica_recovery"):
        g = gp_[mode]
        assert g["mtbf_s"] == pytest.approx(m, abs=0.1)
        assert 0 < g["goodput_tokens_per_sec_per_gpu"] < tps
        assert g["goodput_tokens_per_sec_per_gpu"] == pytest.approx(tps * g["efficiency"], rel=1e-3)
        assert g["checkpoint_interval_steps"] * out["step_time_s"] == pytest.approx(
            g["checkpoint_interval_s"], abs=out["step_time_s"]
        )
    w = gp_["whole_job_restart"]
    assert w["checkpoint_interval_s"] == pytest.approx(
        math.sqrt(2 * w["checkpoint_cost_s"] * m), rel=1e-2
    )
    assert out["goodput_tokens_per_sec_per_gpu"] == w["goodput_tokens_per_sec_per_gpu"]
    assert gp_["per_replica_recovery"]["efficiency"] > w["efficiency"]


@pytest.mark.parametrize(
    ("sets", "env", "key"),
    [
        # Outside tools.launch --local: no replica group id, one line naming it.
        ([], {}, "REPLICA_GROUP_ID"),
        ([], {"REPLICA_GROUP_ID": "2"}, "REPLICA_GROUP_ID"),  # 2 groups: 0 or 1
        # Layouts torchft replica groups are not built for: refused by key.
        (["parallel.tp=2"], {"REPLICA_GROUP_ID": "0"}, "parallel.tp"),
        (["fault_tolerance.semi_sync=diloco"], {"REPLICA_GROUP_ID": "0"},
         "fault_tolerance.semi_sync"),
    ],
)  # fmt: skip
def test_train_refuses_fault_tolerance_it_does_not_run(tmp_path, capsys, monkeypatch, sets, env,
                                                        key):  # fmt: skip
    from tests.helpers.runs import train_main_error

    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = ["--set", f"job.output_dir={tmp_path}", "--set", "fault_tolerance.enabled=true",
            "--set", "fault_tolerance.replica_groups=2"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    code, err = train_main_error(args, capsys)
    assert code == 2
    assert len(err) == 1 and key in err[0], err
