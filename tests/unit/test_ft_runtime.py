"""runtime.fault_tolerance's pure pieces and the launcher's plan, against independent
references: torchtitan's own TorchFTManager.get_dp_info, a copy through torch's optimizer
API, and launch.ft_local's commands (docs/fault_tolerance.md)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from core.errors import ConfigError
from recipe.loader import load_recipe
from runtime import fault_tolerance as rft


@pytest.mark.parametrize(("dp", "groups"), [(1, 2), (2, 2), (4, 3)])
def test_data_share_is_torchtitans_and_covers_the_stream_once(dp, groups):
    from torchtitan.experiments.torchft.manager import TorchFTManager

    seen = []
    for rid in range(groups):
        for r in range(dp):
            ref = SimpleNamespace(enabled=True, group_size=groups, replica_id=rid)
            got = rft.dp_info(dp, r, groups, rid)
            assert got == TorchFTManager.get_dp_info(ref, dp, r)  # type: ignore[arg-type]
            assert got[0] == dp * groups
            seen.append(got[1])
    assert sorted(seen) == list(range(dp * groups))  # every shard read by exactly one rank


def test_replica_id_and_lighthouse_are_checked():
    assert rft.replica_id({"REPLICA_GROUP_ID": "1"}, 2) == 1
    for bad in (
        {},
        {"REPLICA_GROUP_ID": "2"},
        {"REPLICA_GROUP_ID": "-1"},
        {"REPLICA_GROUP_ID": "x"},
    ):
        with pytest.raises(ConfigError) as e:
            rft.replica_id(bad, 2)
        assert e.value.key == "REPLICA_GROUP_ID"
    recipe = load_recipe(None, ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2"])
    with pytest.raises(ConfigError) as e:
        rft.lighthouse(recipe, {})
    assert e.value.key == "fault_tolerance.lighthouse"
    env = {"TORCHFT_LIGHTHOUSE": "http://h:1"}
    rft.torchft_env(recipe, env)
    t = str(recipe.fault_tolerance.quorum_timeout_s)
    assert env == {"TORCHFT_LIGHTHOUSE": "http://h:1", "TORCHFT_QUORUM_TIMEOUT_SEC": t,
                   "TORCHFT_TIMEOUT_SEC": t}  # fmt: skip


def test_recipe_maps_onto_torchtitans_fault_tolerance_config():
    recipe = load_recipe(
        None,
        ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=3",
         "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=7"],
    )  # fmt: skip
    ft = rft.fault_tolerance_config(recipe, 2, cpu=True)
    assert (ft.enable, ft.process_group, ft.replica_id, ft.group_size, ft.min_replica_size) == (
        True, "gloo", 2, 3, 2)  # fmt: skip
    assert ft.process_group_timeout_ms == 7000 and ft.semi_sync_method is None
    assert rft.fault_tolerance_config(recipe, 0, cpu=False).process_group == "nccl"


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(seed + 1):
        opt.zero_grad()
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    train = SimpleNamespace(step=seed + 1)
    train.state_dict = lambda: {"step": train.step}
    train.load_state_dict = lambda sd: setattr(train, "step", sd["step"])
    return {
        "model": SimpleNamespace(model=[model]),
        "optimizer": SimpleNamespace(optimizers=[opt]),
        "lr_scheduler": sched,
        "train_state": train,
    }


def test_heal_state_copies_a_peer_exactly():
    live, healing = _trained(2), _trained(0)
    assert rft.state_digest(rft.heal_state(live)) != rft.state_digest(rft.heal_state(healing))
    # Sent as torchft would (a deep copy standing for the transport).
    rft.load_heal_state(healing, copy.deepcopy(rft.heal_state(live)))
    # Reference: torch's own state dicts of the two, compared entry by entry.
    a, b = live["model"].model[0].state_dict(), healing["model"].model[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa = live["optimizer"].optimizers[0].state_dict()
    ob = healing["optimizer"].optimizers[0].state_dict()
    for i, st in oa["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][i][k]))
                   for k, v in st.items())  # fmt: skip
    assert oa["param_groups"] == ob["param_groups"]  # lr after the schedule's step
    assert healing["train_state"].step == 3
    assert healing["lr_scheduler"].state_dict() == live["lr_scheduler"].state_dict()
    assert rft.state_digest(rft.heal_state(live)) == rft.state_digest(rft.heal_state(healing))


def test_heal_state_reads_the_parameters_taken_while_sharded():
    """Between a module's forward and its reshard FSDP2 registers the unsharded parameters
    in place of the shards, and torchft's quorum thread may call heal_state then: what is
    sent and loaded are the parameters taken at the checkpointer's construction."""
    live, healing = _trained(2), _trained(0)
    live_params, healing_params = rft.sharded_parameters(live), rft.sharded_parameters(healing)
    shard = live["model"].model[0][0].weight
    # The registration of the moment, as mid-forward: a different, larger tensor.
    live["model"].model[0][0].weight = torch.nn.Parameter(torch.zeros(8, 4))
    assert rft.heal_state(live)["model"]["0.0.weight"].shape == (8, 4)  # what went wrong
    sent = rft.heal_state(live, live_params)
    assert torch.equal(sent["model"]["0.0.weight"], shard)
    target = healing["model"].model[0][0].weight
    healing["model"].model[0][0].weight = torch.nn.Parameter(torch.zeros(8, 4))
    rft.load_heal_state(healing, copy.deepcopy(sent), healing_params)
    assert torch.equal(target, shard)


def test_launcher_starts_one_torchrun_per_group(tmp_path):
    from launch.ft_local import REPO_ROOT, GroupsPlan, group_command, group_env

    plan = GroupsPlan(groups=2, nproc=2, min_replicas=1, train_args=("--recipe", "r.toml"),
                      out=str(tmp_path))  # fmt: skip
    cmd = group_command(plan, python="py")
    assert cmd[:3] == ["py", "-m", "tools.torchrun"] and "--nproc_per_node=2" in cmd
    assert cmd[-3].endswith("train.py") and cmd[-2:] == ["--recipe", "r.toml"]
    env = group_env({"RANK": "3", "PATH": "/bin"}, 1, "http://h:1")
    assert env == {"PATH": "/bin", "REPLICA_GROUP_ID": "1", "TORCHFT_LIGHTHOUSE": "http://h:1",
                   "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
