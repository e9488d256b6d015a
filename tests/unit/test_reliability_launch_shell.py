"""Shell-reaching strings: every value `tools.launch` writes into the job script, an #SBATCH
line or a path, fuzzed with newlines, `$()`, backticks, quotes, semicolons, NUL, U+2028,
U+0085, bidi overrides, leading dashes and very long values.

Each value is either refused (SystemExit 2, one line on stderr naming the argument or recipe
key) or accepted, and then the script has exactly the #SBATCH lines it should (all before the
first command, where sbatch stops reading them), every line printable, and the value back
exactly: verbatim in its #SBATCH line (checked against sbatch's own special characters), or
through `shlex.split` of its quoted shell line (bash itself parses a sample in
tests/integration/test_reliability_launch_bash.py). The same class through recipe loading
(job.name, job.output_dir, checkpoint folders: what train.py creates) and through
tools.node_order's gathered node list.
"""

from __future__ import annotations

import contextlib
import functools
import io
import shlex
import string
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from recipe.loader import load_recipe
from tools.launch import main as launch_main
from tools.node_order import main as node_order_main
from tools.reliability_report import record_case

BASE = ["--recipe", "debug", "--cluster", "local_cpu", "--nodes", "1", "--dry-run"]
PIECES = [
    "\n", "\r", "\x00", "\u2028", "\u2029", "\x85", "\u202e", "\x1b[31m", "\t", " ",
    "$(id)", "`id`", "${HOME}", "'", '"', ";", "&&", "|", "#", "%j", "\\", "*", "~", "=",
    ",", "..", "/", "-", "--", "é", "\n#SBATCH --qos=evil", "\nrm -rf /tmp/x\n",
]  # fmt: skip
SAFE = st.text(alphabet=string.ascii_letters + string.digits + "_.-", min_size=1, max_size=8)
HOSTILE = st.one_of(
    st.lists(st.one_of(st.sampled_from(PIECES), SAFE), min_size=1, max_size=5).map("".join),
    st.text(max_size=24),
    st.integers(129, 5000).map(lambda n: "a" * n),
    SAFE,
)
# Characters sbatch's #SBATCH parser treats specially (whitespace splits, quotes and '\\'
# escape, '#' starts a comment) plus what the shell or Slurm's file patterns would expand.
SBATCH_SPECIAL = set(" \t\n\r'\"\\#$`;&|<>()*?%")
BAD_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def run_main(main, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a tool's main, in-process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def run_launch(*args: str) -> tuple[int, str, str]:
    return run_main(launch_main, [*BASE, *args])


def sbatch_lines(script: str) -> list[str]:
    return [ln for ln in script.split("\n") if ln.startswith("#SBATCH")]


def first_command(script: str) -> int:
    lines = script.split("\n")
    return next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))


@functools.cache
def baseline_script() -> str:
    """The script with every value at its default (a function, not a fixture: hypothesis
    would print a fixture's 5 KB value with every failing case)."""
    rc, out, _ = run_launch()
    assert rc == 0
    return out


def check_refused(rc: int, err: str, names: tuple[str, ...], value: str) -> None:
    assert rc == 2, (value, err)
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), (value, err)
    assert "Traceback" not in err
    assert any(f"{n}:" in lines[0] for n in names), (names, lines[0])


def check_accepted(script: str, extra_sbatch: int) -> list[str]:
    lines = script.split("\n")
    for ln in lines:
        assert not any(unicodedata.category(c) in BAD_CATEGORIES for c in ln), ln
    sb = sbatch_lines(script)
    assert len(sb) == len(sbatch_lines(baseline_script())) + extra_sbatch, sb
    last_sbatch = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert last_sbatch < first_command(script)  # sbatch reads every one of them
    return sb


# (argument, #SBATCH option it fills or None, extra #SBATCH lines when given)
SBATCH_FIELDS = [
    ("--partition", "partition", 1),
    ("--account", "account", 1),
    ("--qos", "qos", 1),
    ("--job-name", "job-name", 0),
    ("--workdir", "chdir", 0),
]


@pytest.mark.parametrize("arg,option,extra", SBATCH_FIELDS)
@SETTINGS
@given(value=HOSTILE)
def test_sbatch_values_refused_or_verbatim(arg, option, extra, value):
    rc, out, err = run_launch(f"{arg}={value}")
    if rc != 0:
        check_refused(rc, err, (arg,), value)
    elif value == "":  # '' = not given (the partition's default, the recipe's name ...)
        assert check_accepted(out, 0) == sbatch_lines(baseline_script())
    else:
        sb = check_accepted(out, extra)
        assert f"#SBATCH --{option}={value}" in sb
        assert not (set(value) & SBATCH_SPECIAL) and not value.startswith("-")
    record_case("tools.launch", "shell injection (#SBATCH values)")


@SETTINGS
@given(value=st.one_of(HOSTILE, st.sampled_from(["04:00:00", "1-00:00:00", "UNLIMITED", "90"])))
def test_time_refused_or_verbatim(value):
    rc, out, err = run_launch(f"--time={value}")
    if rc != 0:
        check_refused(rc, err, ("--time", "--signal-seconds"), value)
    elif value == "":
        assert check_accepted(out, 0) == sbatch_lines(baseline_script())
    else:
        assert f"#SBATCH --time={value}" in check_accepted(out, 1)
    record_case("tools.launch", "shell injection (#SBATCH values)")


@SETTINGS
@given(
    value=st.one_of(
        HOSTILE,
        HOSTILE.map(lambda v: "--comment=" + v),
        st.sampled_from(["--mail-type=END", "-x", "--error=/tmp/%x-%j.err"]),
    )
)
def test_sbatch_arg_is_one_option(value):
    rc, out, err = run_launch(f"--sbatch-arg={value}")
    if rc != 0:
        check_refused(rc, err, ("--sbatch-arg",), value)
    else:
        assert f"#SBATCH {value}" in check_accepted(out, 1)
        assert value.startswith("-") and not (set(value) & (SBATCH_SPECIAL - {"%"}))
    record_case("tools.launch", "shell injection (--sbatch-arg)")


@SETTINGS
@given(value=HOSTILE)
def test_quoted_values_round_trip(value, tmp_path_factory):
    """Free text (a --set value, the Python path): quoted; shlex reads back the exact value."""
    rc, out, err = run_launch(f"--set=job.description={value}", f"--python={value}")
    if rc != 0:
        check_refused(rc, err, ("--set", "--python", "job.description"), value)
    else:
        check_accepted(out, 0)
        lines = out.split("\n")
        py = next(ln for ln in lines if ln.startswith("PY="))
        assert shlex.split(py[3:]) == [value]
        train = next(ln for ln in lines if ln.startswith("run_step $((PORT0 + 1))"))
        assert f"job.description={value}" in shlex.split(train)
    record_case("tools.launch", "shell injection (quoted text)")


@SETTINGS
@given(value=HOSTILE)
def test_output_folder_refused_or_verbatim(value):
    rc, out, err = run_launch(f"--out=/tmp/{value}")
    if rc != 0:
        check_refused(rc, err, ("--out",), value)
    else:
        sb = check_accepted(out, 0)
        folder = str(Path(f"/tmp/{value}").resolve())
        assert f"#SBATCH --output={folder}/logs/%x-%j.out" in sb
        assert not set(folder) & SBATCH_SPECIAL
    record_case("tools.launch", "shell injection (paths)")


@SETTINGS
@given(value=HOSTILE)
def test_recipe_job_name_and_folders(value, tmp_path_factory):
    """What train.py creates (job.name as a folder, job.output_dir, checkpoint folders) is
    checked at recipe load: refused with the dotted key, or a plain name / one-line path."""
    keys = ("job.name", "job.output_dir", "checkpoint.folder", "checkpoint.export_folder",
            "finetune.export_dir")  # fmt: skip
    for key in keys:
        try:
            r = load_recipe(None, [f"{key}={value}"])
        except ConfigError as e:
            assert "\n" not in str(e) and e.key == key, (key, str(e))
            continue
        got = {"job.name": r.job.name, "job.output_dir": r.job.output_dir,
               "checkpoint.folder": r.checkpoint.folder,
               "checkpoint.export_folder": r.checkpoint.export_folder,
               "finetune.export_dir": r.finetune.export_dir}[key]  # fmt: skip
        assert not any(unicodedata.category(c) in BAD_CATEGORIES for c in got)
        if key == "job.name":
            assert set(got) <= set(string.ascii_letters + string.digits + "_.+-")
            assert got[0] not in ".+-" and 1 <= len(got) <= 128
    record_case("train.py", "shell injection (names, folders)", n=len(keys))


@SETTINGS
@given(
    names=st.lists(st.one_of(HOSTILE, SAFE), min_size=1, max_size=4),
    addrs=st.lists(st.one_of(HOSTILE, SAFE.map(lambda s: f"spine.{s}")), min_size=4, max_size=4),
)
def test_node_order_gathered_names(tmp_path_factory, names, addrs):
    """Node names go back into the order file the job script reads (MASTER_ADDR = line 1,
    `grep -x` for the node rank): printed only as plain host names, one per line."""
    d = tmp_path_factory.mktemp("g")
    f = d / "gathered.txt"
    f.write_text(
        "".join(f"{n} {a}\n" for n, a in zip(names, addrs, strict=False)), errors="surrogateescape"
    )
    rc, out, err = run_main(node_order_main, [str(f)])
    if rc == 2:
        assert len(err.strip("\n").split("\n")) == 1 and err.startswith("error: "), err
    else:
        assert rc in (0, 1), err  # 1: no nodes (documented)
        for n in out.split("\n")[:-1]:
            assert n and set(n) <= set(string.ascii_letters + string.digits + "_.-"), n
            assert n[0] != "-"
    record_case("tools.node_order", "shell injection (node names)")


@pytest.mark.parametrize(
    "nodelist",
    ["n[1-", "n[1-10000000]", "r[1-1000]n[1-1000]", "n[0-1]\nx", "a b", "n[1-2]$(id)", "-n1"],
)
def test_node_lists_refused_in_one_line_and_bounded_time(nodelist):
    """SLURM_JOB_NODELIST / --nodelist: was a ValueError traceback ('n[1-') or minutes of
    planning for 10 million hosts; now counted before expanding, names checked."""
    from tests.helpers.guards import alarm_guard
    from tools.plan import main as plan_main

    argv = ["--recipe", "debug", "--cluster", "local_cpu", f"--nodelist={nodelist}"]
    with alarm_guard(60):  # minutes of planning (the old way) fail; no claim on speed
        rc, _, err = run_main(plan_main, argv)
    assert rc == 2 and len(err.strip("\n").split("\n")) == 1, err
    assert err.startswith("error: --nodelist: "), err  # the argument the user typed
    record_case("tools.plan", "node lists (hostlist)")


def test_signal_seconds_within_slurms_limit():
    rc, _, err = run_launch("--signal-seconds", str(10**20))
    check_refused(rc, err, ("--signal-seconds",), "10**20")
    record_case("tools.launch", "shell injection (#SBATCH values)")


@pytest.mark.parametrize(
    "profile,key",
    [
        ('name = "cpu\\n#SBATCH --qos=evil"', "name"),  # goes into the script's header
        ('[nccl.env]\nGLOO_SOCKET_IFNAME = "lo\\nrm -rf /tmp/x"', "env.GLOO_SOCKET_IFNAME"),
        ('[nccl.env]\n"FOO\\n" = "1"', "env.FOO\n"),  # a trailing newline passed `re.match`
        ('[nccl.env]\n"A B" = "1"', "env.A B"),
    ],
)
def test_profile_strings_reaching_the_script(tmp_path, profile, key):
    p = tmp_path / "p.toml"
    p.write_text(f'gpu = "cpu"\nnodes = 1\ngpus_per_node = 2\n{profile}\n')
    if not profile.startswith("name"):
        p.write_text(f'name = "p"\ngpu = "cpu"\nnodes = 1\ngpus_per_node = 2\n{profile}\n')
    rc, _, err = run_launch_with(["--cluster", str(p)])
    assert rc == 2 and len(err.strip("\n").split("\n")) == 1 and err.startswith("error: "), err
    assert key.replace("\n", "\\n") in err, err
    record_case("tools.launch", "shell injection (cluster profile)")


def run_launch_with(extra: list[str]) -> tuple[int, str, str]:
    argv = ["--recipe", "debug", "--nodes", "1", "--dry-run", *extra]
    return run_main(launch_main, argv)
