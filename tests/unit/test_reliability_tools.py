"""Planning tools and cluster files: every bad input ends in one line and exit 2 (or a
documented exit 0), within seconds, with no traceback. In-process through each tool's
`main(argv)` (its `exit_on_config_error` path, what `python -m tools.X` runs), with a
SIGALRM hang guard per call; `tests/integration/test_reliability_tools_subprocess.py` runs
a few of the same cases as real processes.

The references are independent of the code under test: the hardware bounds are the
documented ones (core.hardware), a plan's degrees are checked against the model's heads and
layers from torchtitan's config, and the kernel rule against the GPU's compute capability
(SM100 for MXFP8, from the backend table).
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.hardware import MAX_GPUS_PER_NODE, MAX_NODES, MAX_NVLINK_DOMAIN_GPUS
from tests.helpers.guards import alarm_guard
from tools import bench, kernel_bench, launch, packstats, plan, predict, preflight, reproduce
from tools.reliability_report import record_case

HANG_GUARD_S = 30  # generous: a loaded 2-core machine; the bug was "never finishes"
MAINS = {
    "tools.plan": plan.main,
    "tools.predict": predict.main,
    "tools.launch": launch.main,
    "tools.preflight": preflight.main,
    "tools.packstats": packstats.main,
    "tools.reproduce": reproduce.main,
    "tools.bench": bench.main,
    "tools.kernel_bench": kernel_bench.main,
}
H100 = 'gpu = "H100"\ngpus_per_node = 8\nnodes = 4\n'


def hang_guard(seconds: float = HANG_GUARD_S):
    return alarm_guard(seconds)


def run_tool(entry: str, argv: list[str], capsys) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds) of `entry`'s main(argv), as `run(main)` exits."""
    t0 = time.monotonic()
    code = 0
    with hang_guard():
        try:
            rc = MAINS[entry](argv)
            code = rc if isinstance(rc, int) else 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err, time.monotonic() - t0


def refused(entry: str, argv: list[str], capsys, *needles: str, kind: str) -> str:
    """Assert exit 2 with exactly one stderr line naming `needles`; count the case."""
    code, _, err, _ = run_tool(entry, argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    record_case(entry, kind)
    return lines[0]


def cluster_file(tmp_path, text: str, name: str = "c.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --- hangs: sizes past any machine are refused at once ----------------------------------


@pytest.mark.parametrize("entry", ["tools.plan", "tools.predict"])
@pytest.mark.parametrize("nodes", [10**15, 2**62, 10**400, MAX_NODES + 1])
def test_huge_nodes_argument_is_refused_at_once(entry, nodes, capsys):
    line = refused(
        entry,
        ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--nodes", str(nodes)],
        capsys,
        "--nodes",
        f"at most {MAX_NODES:,}",
        kind="hang (huge size)",
    )
    assert len(line) < 300  # a 401-digit number is not echoed


@pytest.mark.parametrize(
    "key,value,bound",
    [
        ("nodes", 2**62, MAX_NODES),
        ("nodes", 10**15, MAX_NODES),
        ("gpus_per_node", 100000, MAX_GPUS_PER_NODE),
        ("gpus_per_node", 2**62, MAX_GPUS_PER_NODE),
        ("nvlink_domain_gpus", 8 * 10**6, MAX_NVLINK_DOMAIN_GPUS),
    ],
)
def test_huge_cluster_sizes_are_refused_naming_file_and_key(tmp_path, key, value, bound, capsys):
    base = {"gpu": '"H100"', "gpus_per_node": "8", "nodes": "1", key: str(value)}
    path = cluster_file(tmp_path, "".join(f"{k} = {v}\n" for k, v in base.items()))
    for entry in ("tools.plan", "tools.predict"):
        refused(entry, ["--recipe", "debug", "--cluster", path], capsys, path, f"{key}:",
                f"at most {bound:,}", kind="hang (huge size)")  # fmt: skip


def test_world_size_past_the_bound_names_the_recipe_key(capsys):
    refused(
        "tools.plan",
        ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--set", f"parallel.world_size={2**62}"],
        capsys,
        "parallel.world_size",
        kind="hang (huge size)",
    )  # fmt: skip


def test_huge_global_batch_is_refused_before_the_divisor_search(capsys):
    refused(
        "tools.plan",
        ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--set",
         f"training.global_batch_size={2**62}", "--set", "parallel.world_size=0"],
        capsys,
        "training.global_batch_size",
        kind="hang (huge size)",
    )  # fmt: skip


def test_a_large_but_real_world_plans_within_seconds(capsys):
    """131,072 nodes of 8 H100 for an 8B recipe with a 16-sequence batch: no layout can use
    them (dp would exceed the batch): exit 0 saying why, and what fits, within seconds."""
    code, out, err, secs = run_tool(
        "tools.plan", ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--nodes",
                       str(MAX_NODES), "--set", "parallel.world_size=0"], capsys)  # fmt: skip
    assert code == 0 and "no layout for 1,048,576 GPUs" in out and "0 fit" in out
    assert "training.global_batch_size = " in out and "nodes (--nodes " in out
    record_case("tools.plan", "hang (huge size)")
    # A world with many divisors (720,720 = 2^4 3^2 5 7 11 13 GPUs) and a derived batch.
    code, out, err, _ = run_tool(
        "tools.plan", ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes", "90090",
                       "--top", "1"], capsys)  # fmt: skip
    assert code == 0 and "world 720720" in out
    record_case("tools.plan", "hang (huge size)")


def test_huge_hostlists_are_refused(tmp_path, capsys):
    for expr in ("n[0-99999999999]", "n[0-9999][0-9999]", "n[0-" + "9" * 5000 + "]"):
        path = cluster_file(
            tmp_path,
            H100 + f'[[topology.switches]]\nname = "leaf"\nnodes = "{expr}"\n',
        )
        refused("tools.plan", ["--recipe", "debug", "--cluster", path], capsys,
                "topology.switches[0].nodes", kind="hang (huge size)")  # fmt: skip
    code, _, err, _ = run_tool(
        "tools.plan", ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes", "2",
                       "--nodelist", "n[0-99999999999]"], capsys)  # fmt: skip
    assert code == 2 and "more than 131,072 hosts" in err and err.count("\n") == 1, err
    record_case("tools.plan", "hang (huge size)")


# --- silent acceptance of nonsense --------------------------------------------------------


@pytest.mark.parametrize(
    "text,missing",
    [
        ("", "gpu, nodes, gpus_per_node"),
        ("# only a comment\n", "gpu, nodes, gpus_per_node"),
        ('gpu = "H100"\n', "nodes, gpus_per_node"),
        ('gpu = "H100"\nnodes = 2\n', "gpus_per_node"),
        ("nodes = 2\ngpus_per_node = 8\n", "gpu"),
    ],
)
def test_cluster_file_without_required_keys_is_an_error(tmp_path, text, missing, capsys):
    path = cluster_file(tmp_path, text)
    for entry in ("tools.plan", "tools.predict"):
        refused(entry, ["--recipe", "debug", "--cluster", path], capsys, path,
                f"{missing}: missing", kind="nonsense accepted")  # fmt: skip
    refused("tools.launch", ["--recipe", "debug", "--cluster", path, "--nodes", "1",
                             "--dry-run"], capsys, path, "missing", kind="nonsense accepted")  # fmt: skip


@pytest.mark.parametrize(
    "switches,cycle",
    [
        ([("a", "", "b"), ("b", "", "a")], "b -> a -> b"),
        ([("s", "", "s")], "s -> s"),
        ([("x", "", "y"), ("y", "", "z"), ("z", "", "x")], "-> x"),
        ([("spine", "", "leaf,spine")], "spine -> spine"),
    ],
)
def test_switch_cycles_are_refused_naming_the_switches(tmp_path, switches, cycle, capsys):
    text = H100 + '[[topology.switches]]\nname = "leaf"\nnodes = "n[0-3]"\n'
    for name, nodes, children in switches:
        text += f'[[topology.switches]]\nname = "{name}"\n'
        text += f'nodes = "{nodes}"\n' if nodes else f'switches = "{children}"\n'
    path = cluster_file(tmp_path, text)
    for entry, extra in (("tools.plan", []), ("tools.launch", ["--nodes", "1", "--dry-run"])):
        line = refused(entry, ["--recipe", "debug", "--cluster", path, *extra], capsys, path,
                       "topology.switches", "switch cycle", kind="nonsense accepted")  # fmt: skip
        assert cycle in line or cycle.split(" -> ")[-1] in line, line
    # The same tree without the cycle plans.
    ok = cluster_file(tmp_path, H100 + '[[topology.switches]]\nname = "leaf"\nnodes = "n[0-3]"\n'
                      '[[topology.switches]]\nname = "spine"\nswitches = "leaf"\n', "ok.toml")  # fmt: skip
    assert run_tool("tools.plan", ["--recipe", "debug", "--cluster", ok], capsys)[0] == 0


def test_switch_cycle_in_slurm_topology_text(tmp_path, capsys):
    topo = tmp_path / "topo.txt"
    topo.write_text(
        "SwitchName=leaf Level=0 Nodes=n[0-1]\n"
        "SwitchName=a Level=1 Switches=b\nSwitchName=b Level=2 Switches=a\n"
    )
    refused("tools.plan", ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes", "2",
                           "--slurm-topology", str(topo), "--nodelist", "n[0-1]"], capsys,
            "switch cycle", kind="nonsense accepted")  # fmt: skip


@pytest.mark.parametrize(
    "line,key",
    [
        ("hbm_gib = 80000", "hbm_gib"),  # MB for GiB
        ("nvlink_gbps = 3.6e9", "nvlink_gbps"),  # bits for gigabits
        ("ib_gbps_per_gpu = 4e11", "ib_gbps_per_gpu"),
        ("power_limit_w = 7e5", "power_limit_w"),
        (f"[topology]\nleaves_per_spine = {2**62}", "topology.leaves_per_spine"),
    ],
)
def test_unit_slips_in_profiles_are_refused(tmp_path, line, key, capsys):
    path = cluster_file(tmp_path, H100 + line + "\n")
    refused("tools.plan", ["--recipe", "debug", "--cluster", path], capsys, path, f"{key}:",
            "at most", kind="nonsense accepted")  # fmt: skip


def test_gpus_per_node_bound_is_the_hardware_table(capsys, tmp_path):
    """72 (an NVL72 rack as one host) plans; 73 is refused. 100,000 used to plan 800,000 GPUs."""
    at = cluster_file(tmp_path, 'gpu = "GB200"\nnodes = 1\ngpus_per_node = 72\n', "at.toml")
    code, out, _, _ = run_tool("tools.plan", ["--recipe", "debug", "--cluster", at, "--top", "1"],
                               capsys)  # fmt: skip
    assert code == 0 and "world 72" in out
    past = cluster_file(tmp_path, 'gpu = "GB200"\nnodes = 1\ngpus_per_node = 73\n', "past.toml")
    refused("tools.plan", ["--recipe", "debug", "--cluster", past], capsys, "gpus_per_node",
            "at most 72", kind="nonsense accepted")  # fmt: skip


# The compute capability each backend needs, from NVIDIA's architecture names (an independent
# reference for the table in core.linear_backends): MXFP8 block scaling is Blackwell (SM100),
# FP8 Ada/Hopper (SM89).
SM = {"H100": (9, 0), "H200": (9, 0), "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3),
      "GB300": (10, 3)}  # fmt: skip
NEEDS = {"mxfp8": (10, 0), "fp8_rowwise": (8, 9), "fp8_rowwise_gw_hp": (8, 9), "bf16": (0, 0),
         "fp8_tensorwise": (8, 9), "nvfp4": (10, 0)}  # fmt: skip
PROFILES = {"H100": "hgx_h100_ib", "H200": "hgx_h200_ib", "B200": "hgx_b200_ib", "GB200": "gb200_nvl72",
            "B300": "hgx_b300_ib", "GB300": "gb300_nvl72"}  # fmt: skip


@pytest.mark.parametrize("gpu", ["H100", "B200"])
@pytest.mark.parametrize("linear", ["mxfp8", "fp8_rowwise"])
def test_kernel_capability_in_every_planning_tool(gpu, linear, capsys):
    cluster = PROFILES[gpu]
    recipe = "llama3_70b_h100" if gpu == "H100" else "llama3_70b_b200"
    nodes = "8"
    cases = {
        "tools.plan": ["--top", "1"],
        "tools.predict": [],
        "tools.launch": ["--dry-run"],
    }
    for entry, extra in cases.items():
        argv = ["--recipe", recipe, "--cluster", cluster, "--nodes", nodes,
                "--set", f"kernels.linear={linear}", *extra]  # fmt: skip
        if SM[gpu] >= NEEDS[linear]:
            code, out, err, _ = run_tool(entry, argv, capsys)
            assert code == 0, err
            record_case(entry, "kernel capability")
        else:
            refused(entry, argv, capsys, "kernels.linear", f"'{linear}' cannot run on",
                    "SM90", kind="kernel capability")  # fmt: skip


@pytest.mark.parametrize(
    "gpu,linear", [("H100", "nvfp4"), ("GB300", "nvfp4"), ("H100", "fp8_tensorwise"),
                   ("cpu", "nvfp4"), ("cpu", "fp8_tensorwise")],
)  # fmt: skip
def test_new_precisions_in_every_planning_tool(gpu, linear, capsys):
    """Issue 29's values keep the promise: NVFP4 below SM100 and on CPU (no emulation) is one
    line naming kernels.linear, exit 2; FP8 tensorwise plans wherever FP8 runs (emulated on
    CPU)."""
    if gpu == "cpu":
        base = ["--recipe", "debug", "--cluster", "local_cpu"]
    else:
        # 64 GPUs, the recipes' declared world size (8 HGX hosts, 16 NVL72 compute trays).
        recipe, nodes = ("llama3_70b_h100", "8") if gpu == "H100" else ("llama3_70b_b200", "16")
        base = ["--recipe", recipe, "--cluster", PROFILES[gpu], "--nodes", nodes]
    cases = {"tools.plan": ["--top", "1"], "tools.predict": [], "tools.launch": ["--dry-run"]}
    for entry, extra in cases.items():
        if gpu == "cpu" and entry == "tools.launch":
            continue  # a Slurm launch of a CPU profile is the slurmlab's case
        argv = [*base, "--set", f"kernels.linear={linear}", *extra]
        if gpu != "cpu" and SM[gpu] >= NEEDS[linear] or (gpu == "cpu" and linear != "nvfp4"):
            code, out, err, _ = run_tool(entry, argv, capsys)
            assert code == 0, err
            record_case(entry, "kernel capability")
        else:
            need = "no CPU emulation" if gpu == "cpu" else "SM100"
            refused(entry, argv, capsys, "kernels.linear", f"'{linear}' cannot run on", need,
                    kind="kernel capability")  # fmt: skip


def test_auto_linear_never_ranks_an_incapable_backend(capsys):
    from parallel.cluster import load_cluster
    from recipe.loader import load_recipe
    from tools.predict import predict_recipe

    for gpu in ("H100", "B200"):
        recipe = "llama3_70b_h100" if gpu == "H100" else "llama3_70b_b200"
        for auto in ("false", "true"):  # the recipe's layout, and the planner's best plan
            r = load_recipe(recipe, ["kernels.linear=auto", f"parallel.auto={auto}"])
            _, pred = predict_recipe(r, load_cluster(PROFILES[gpu], nodes=8))
            linear = pred.workload.linear
            assert SM[gpu] >= NEEDS[linear], (gpu, linear)
            assert (linear == "mxfp8") == (SM[gpu] >= NEEDS["mxfp8"]), (gpu, linear)
            record_case("tools.predict", "kernel capability")


def test_attention_checks_on_the_profile(capsys):
    # flex has no backward on CPU: training refuses it on local_cpu, so does the planner.
    refused("tools.plan", ["--recipe", "debug", "--cluster", "local_cpu", "--set",
                           "kernels.attention=flex"], capsys, "kernels.attention",
            kind="kernel capability")  # fmt: skip
    # varlen has no context parallelism: every plan with cp > 1 is dropped, with the reason.
    code, out, err, _ = run_tool(
        "tools.plan", ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--set",
                       "kernels.attention=varlen", "--set", "training.seq_len=65536",
                       "--json", "--top", "50"], capsys)  # fmt: skip
    import json

    plans = json.loads(out)["plans"]
    assert code == 0 and plans and all(p["cp"] == 1 for p in plans), plans[:2]
    record_case("tools.plan", "kernel capability")
    code, out, _, _ = run_tool(
        "tools.plan", ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--set",
                       "training.seq_len=65536", "--json", "--top", "50"], capsys)  # fmt: skip
    assert any(p["cp"] > 1 for p in json.loads(out)["plans"])  # flex: cp is searched


def test_planned_degrees_respect_the_model(capsys):
    """Every plan the tool prints: tp divides the key/value heads, pp at most the layers,
    dp at most the global batch (numbers from torchtitan's config of the flavor)."""
    import json

    from core.models import model_shape

    s = model_shape("8B")
    code, out, _, _ = run_tool(
        "tools.plan", ["--recipe", "llama3_8b", "--cluster", "hgx_h100_ib", "--nodes", "16",
                       "--set", "parallel.world_size=0", "--json", "--top", "1000"], capsys)  # fmt: skip
    plans = json.loads(out)["plans"]
    assert code == 0 and plans
    for p in plans:
        assert s.n_kv_heads % p["tp"] == 0 and p["pp"] <= s.n_layers
        assert p["dp_replicate"] * p["dp_shard"] <= 16  # the recipe's global batch
    record_case("tools.plan", "model shape")


# --- arguments: types, signs, extremes, files ------------------------------------------

RC = ["--recipe", "debug", "--cluster", "hgx_h100_ib"]
BAD_INT = ["abc", "", "nan", "1e400", "1.5", "0x10", "--"]
# (entry, argv before the value, option, values that must be refused)
ARGUMENTS = [
    (
        "tools.plan",
        RC,
        "--nodes",
        [*BAD_INT, "0", "-1", str(-(2**62)), str(2**62), "1" + "0" * 400],
    ),
    ("tools.plan", RC, "--top", [*BAD_INT, "0", "-5"]),
    ("tools.plan", RC, "--time", ["-1", "101", str(10**9), "x"]),
    ("tools.plan", RC, "--placement-rows", ["-1", "y"]),
    ("tools.plan", RC, "--shuffle-hosts", ["nan", "s"]),
    ("tools.plan", RC, "--stack", ["nope", "", "torchtitn", "/", "a/b"]),
    ("tools.plan", RC[:2], "--cluster", ["nope", "", "/", "/dev/null/x", "a\0b"]),
    ("tools.plan", RC[2:], "--recipe", ["nope", "/", "x" * 5000]),
    ("tools.plan", RC, "--set", ["parallel.tpp=2", "training", "=", "parallel.tp=x"]),
    ("tools.predict", RC, "--nodes", [*BAD_INT, "0", str(10**15)]),
    ("tools.predict", RC, "--stack", ["megatron"]),
    ("tools.launch", [*RC, "--dry-run"], "--nodes", [*BAD_INT, "0", "-3", str(10**15), "65"]),
    ("tools.launch", [*RC, "--dry-run", "--nodes", "1"], "--signal-seconds", ["0", "-1", "x"]),
    ("tools.launch", [*RC, "--dry-run", "--nodes", "1"], "--time", ["xx:yy", "-1", "1:2:3:4:5"]),
    ("tools.launch", [*RC, "--dry-run", "--nodes", "1"], "--switch-wait", ["forever", "-5"]),
    (
        "tools.preflight",
        ["--recipe", "debug"],
        "--size-mb",
        ["nan", "inf", "-1", "0", "1e400", "99999"],
    ),
    ("tools.preflight", ["--recipe", "debug"], "--iters", ["0", "-1", str(10**9), "x"]),
    ("tools.preflight", ["--recipe", "debug"], "--cluster", ["nope", "/"]),
    ("tools.packstats", ["--recipe", "debug"], "--rows", ["0", "-1", str(10**12), "x"]),
    ("tools.packstats", ["--recipe", "debug"], "--repeat", ["0", str(10**6)]),
    ("tools.packstats", ["--recipe", "debug"], "--dp", ["0", "-2", str(2**62)]),
    ("tools.packstats", ["--recipe", "debug"], "--max-records", ["0", "-1", str(10**12)]),
    ("tools.packstats", ["--recipe", "debug", "--dp", "2"], "--rank", ["2", "-1", "9"]),
    (
        "tools.reproduce",
        [],
        "--nodes",
        ["", "0", "-1", "x", "1,,x", str(10**15), ",".join(["1"] * 40)],
    ),
    ("tools.reproduce", [], "--only", ["nope", "a,b"]),
    ("tools.reproduce", [], "--claims", ["/", "nope.toml"]),
    ("tools.bench", [], "--steps", ["0", "-1", "x"]),
    ("tools.bench", [], "--nproc", ["0", "-1", str(10**6)]),
    ("tools.bench", ["--steps", "5"], "--warmup", ["-1", "5", "9"]),
    ("tools.kernel_bench", [], "--tokens", ["0", "-1", str(2**40)]),
    ("tools.kernel_bench", [], "--attn-seq", ["0", str(10**9)]),
    ("tools.kernel_bench", [], "--attn-batch", ["0", str(10**6)]),
    ("tools.kernel_bench", [], "--iters", ["0", str(10**9)]),
    ("tools.kernel_bench", [], "--warmup", ["-1", str(10**9)]),
    ("tools.kernel_bench", [], "--tp", ["0", "3", "x", ""]),
    ("tools.kernel_bench", [], "--model", ["nope", ""]),
    ("tools.kernel_bench", [], "--out", ["/proc/x/y", "/dev/null/z"]),
    ("tools.bench", ["--steps", "3", "--warmup", "1"], "--out", ["/proc/x", "/dev/null/z"]),
    ("tools.predict", ["--calibration"], "--out", ["/", "/proc/x/y.md", "/dev/null/z"]),
]
CASES = [(e, pre, opt, v) for e, pre, opt, vals in ARGUMENTS for v in vals]


def test_argument_table_covers_every_planning_tool():
    assert {e for e, *_ in CASES} == set(MAINS)
    assert len(CASES) >= 130


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES))
def test_bad_arguments_fuzzed(case, capsys, tmp_path_factory):
    entry, pre, opt, value = case
    out = tmp_path_factory.mktemp("o")
    argv = [*pre, f"{opt}={value}"] if value.startswith("-") else [*pre, opt, value]
    if entry == "tools.launch":
        argv += ["--out", str(out)]
    if entry == "tools.reproduce":
        argv += ["--out", str(out)]
    refused(entry, argv, capsys, kind="bad argument")


def test_every_argument_case_once(capsys, tmp_path):
    """The whole table, each case once (hypothesis above draws from it in other orders)."""
    for entry, pre, opt, value in CASES:
        argv = [*pre, f"{opt}={value}"] if value.startswith("-") else [*pre, opt, value]
        if entry in ("tools.launch", "tools.reproduce"):
            argv += ["--out", str(tmp_path / "out")]
        refused(entry, argv, capsys, kind="bad argument")


def test_files_that_are_not_files(tmp_path, capsys):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    folder = tmp_path / "dir.toml"
    folder.mkdir()
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"gpu = \xff\xfe\n")
    for bad in (fifo, folder, binary, tmp_path / "missing.toml"):
        for entry, extra in (("tools.plan", []), ("tools.predict", []),
                             ("tools.launch", ["--nodes", "1", "--dry-run"])):  # fmt: skip
            refused(entry, ["--recipe", "debug", "--cluster", str(bad), *extra], capsys,
                    str(bad), kind="bad file")  # fmt: skip
            refused(entry, ["--recipe", str(bad), "--cluster", "hgx_h100_ib", *extra], capsys,
                    str(bad), kind="bad file")  # fmt: skip
        refused("tools.plan", [*RC, "--nodes", "2", "--slurm-topology", str(bad),
                               "--nodelist", "n[0-1]"], capsys, "--slurm-topology",
                kind="bad file")  # fmt: skip
        refused("tools.reproduce", ["--claims", str(bad), "--out", str(tmp_path / "o")], capsys,
                str(bad), kind="bad file")  # fmt: skip
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    refused("tools.reproduce", ["--out", str(not_a_folder / "sub")], capsys, "--out",
            kind="bad file")  # fmt: skip


# --- the cluster-file schema, fuzzed ----------------------------------------------------

KEYS = {
    "gpu": st.sampled_from(
        [
            '"H100"',
            '"B200"',
            '"cpu"',
            '"H10"',
            '""',
            "8",
            "true",
            '"GB300"',
            '"B300"',
            '"H800"',
            '"H100_PCIE"',
            '"GB30"',
        ]
    ),
    "nodes": st.sampled_from(["1", "2", "0", "-1", str(2**62), "1.5", '"2"', "nan", "[1]"]),
    "gpus_per_node": st.sampled_from(["8", "4", "0", "73", "100000", "-8", '"8"', "inf"]),
    "nvlink_domain_gpus": st.sampled_from(["0", "8", "16", "12", "100000", "-1", "1e400"]),
    "nvlink_gbps": st.sampled_from(["3600", "-1", "nan", "inf", '"fast"', "3.6e9"]),
    "ib_gbps_per_gpu": st.sampled_from(["400", "0", "-400", "nan"]),
    "hbm_gib": st.sampled_from(["80", "-1", "nan", "1e400", "1e300"]),
    "power_limit_w": st.sampled_from(["700", "-1", "nan"]),
    "host_prefix": st.sampled_from(['"node"', '""', "3", '"a\\nb"']),
    "nvlnk_gbps": st.sampled_from(["1"]),  # misspelled: unknown key
    "extra_key": st.sampled_from(["1", '"x"']),
}
TOPOLOGY = st.sampled_from([
    "",
    "[topology]\nnodes_per_leaf = 2\n",
    "[topology]\nnodes_per_leaf = -1\n",
    f"[topology]\nnodes_per_leaf = {2**62}\n",
    "[topology]\noversubscription = 1e9\n",
    "[topology]\noversubscription = 0.5\n",
    "[topology]\nleaves_per_spine = \"x\"\n",
    '[[topology.switches]]\nname = "l"\nnodes = "n[0-1]"\n',
    '[[topology.switches]]\nname = "l"\nnodes = "n[0-1]"\n[[topology.switches]]\nname = "s"\nswitches = "s"\n',
    '[[topology.switches]]\nname = "l"\nnodes = "n[1-0]"\n',
    '[[topology.switches]]\nname = "l"\nswitches = "missing"\n',
    '[[topology.switches]]\nnodes = "n1"\n',
    '[[topology.switches]]\nname = "l"\nnodes = "n[0-1]"\n[[topology.switches]]\nname = "l"\nnodes = "n2"\n',
    "[nccl]\nfabric = \"infinband\"\n",
    '[nccl.env]\n"A B" = "1"\n',
    "topology = 3\n",
])  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    fields=st.dictionaries(st.sampled_from(sorted(KEYS)), st.just(None), max_size=7).flatmap(
        lambda d: st.fixed_dictionaries({k: KEYS[k] for k in d})
    ),
    tail=TOPOLOGY,
)
def test_cluster_files_fuzzed(fields, tail, tmp_path_factory, capsys):
    """Any profile: either it plans (exit 0, a world no larger than the bounds allow) or it
    is one line naming the file, exit 2. Never a traceback, never a hang."""
    folder = tmp_path_factory.mktemp("c")
    text = "".join(f"{k} = {v}\n" for k, v in fields.items()) + tail
    path = str(folder / "c.toml")
    (folder / "c.toml").write_text(text)
    code, out, err, _ = run_tool("tools.plan", ["--recipe", "debug", "--cluster", path,
                                                "--top", "1"], capsys)  # fmt: skip
    assert "Traceback" not in err
    if code == 0:
        # Only a complete, in-range profile plans.
        assert {"gpu", "nodes", "gpus_per_node"} <= set(fields), text
        world = int(out.split("world ")[1].split(":")[0])
        assert world <= MAX_NODES * MAX_GPUS_PER_NODE
    else:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and path in lines[0], (text, err)
    record_case("tools.plan", "cluster file schema")


def test_placement_report_is_bounded(capsys):
    refused("tools.plan", ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes", "131072",
                           "--placement"], capsys, "--placement", "at most 32,768",
            kind="hang (huge size)")  # fmt: skip


def test_auto_with_no_usable_layout_is_one_line(capsys):
    """predict with parallel.auto on a world no layout can use: the planner's reason is in the
    one line (it was logged as a second line before it)."""
    line = refused("tools.predict", ["--recipe", "llama3_70b", "--cluster", "gb200_nvl72",
                                     "--nodes", "131072", "--set", "parallel.auto=true"], capsys,
                   "parallel.auto", kind="nonsense accepted")  # fmt: skip
    assert "no layout for 524,288 GPUs" in line
    # ... and the nearest global batch that fits, which the planner accepts (issue 29).
    assert "nearest that fit: training.global_batch_size = " in line
    value = int(line.split("training.global_batch_size = ")[1].split()[0].rstrip(",;"))
    code, out, err, _ = run_tool("tools.plan", ["--recipe", "llama3_70b", "--cluster",
                                                "gb200_nvl72", "--nodes", "131072", "--set",
                                                f"training.global_batch_size={value}", "--top",
                                                "1"], capsys)  # fmt: skip
    assert code == 0 and " 0 fit" not in out, out


@pytest.mark.parametrize(
    "text,needle",
    [
        ("SwitchName= Nodes=n[0-1]\n", "without a name"),
        ("SwitchName=l Nodes=n0\nSwitchName=l Nodes=n1\n", "duplicate switch names: ['l']"),
        ("SwitchName=l Nodes=n[0-1]\nSwitchName=m Nodes=n[0-1]\n", "under two leaf switches"),
        ("SwitchName=l Nodes=n[0-1] Switches=x\n", "unknown child switch"),
        ("no topology here\n", "no SwitchName="),
    ],
)
def test_bad_slurm_topology_text(tmp_path, text, needle, capsys):
    topo = tmp_path / "topo.txt"
    topo.write_text(text)
    refused("tools.plan", ["--recipe", "debug", "--cluster", "hgx_h100_ib", "--nodes", "2",
                           "--slurm-topology", str(topo), "--nodelist", "n[0-1]"], capsys,
            needle, kind="nonsense accepted")  # fmt: skip


def test_tokenizer_larger_than_the_vocabulary_is_refused_by_planning_tools(tmp_path, capsys):
    """Training's vocabulary check runs in plan, predict and launch when the tokenizer folder
    is on hand: ids up to 4999 do not fit the debug model's 2048 embedding rows."""
    import json

    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 4999}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = f"model.tokenizer={tmp_path}"
    for entry in ("tools.plan", "tools.predict"):
        argv = ["--recipe", "debug", "--cluster", "local_cpu", "--set", tok]
        refused(entry, argv, capsys, "model.vocab_size", "4999", kind="model shape (vocabulary)")
    # A folder this machine lacks is the cluster's: left to training.
    argv = ["--recipe", "debug", "--cluster", "local_cpu", "--set", "model.tokenizer=/nonexistent"]
    code, _, err, _ = run_tool("tools.plan", argv, capsys)
    assert code == 0, err
