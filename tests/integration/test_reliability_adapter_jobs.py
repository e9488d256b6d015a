"""[[adapters]] jobs through train.main: a resume that does not fit is one line, exit 2.

A first job trains adapters a and b one step each and saves them; resuming it with another
`lora.rank`, with the two sources swapped, or over a damaged adapter checkpoint used to end
in a tensor-copy traceback, the data position's ValueError or an unpickling error. Now
`posttrain.adapter_checks.resume_problem` names the key before anything is loaded (from the
DCP checkpoint's metadata and data position), and the saved adapters are left as they were:
a misfit is not damage, so nothing is moved aside. A damaged checkpoint is the verified
manager's (runtime.checkpoint): with no older one to fall back to, one line. A 300-character adapter name is refused at recipe load
(it used to reach the first save: OSError, File name too long).
"""

from __future__ import annotations

import pytest

from tests.helpers.adapter_recipe import write_adapter_recipe
from tests.helpers.runs import train_main_error
from tools.reliability_report import record_case

TINY = ["model.layers=1", "training.seq_len=32", "checkpoint.interval=1",
        "metrics.tensorboard=false"]  # fmt: skip


def _adapters(d, a="a", b="b", name="a") -> str:
    return (f'adapters=[{{name="{name}", source="{d}/{a}.jsonl", steps=1, seed=1}}, '
            f'{{name="b", source="{d}/{b}.jsonl", steps=1, seed=2}}]')  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import train

    d = tmp_path_factory.mktemp("aj")
    recipe = write_adapter_recipe(d)
    base = ["--recipe", recipe, "--set", f"job.output_dir={d}/out"]
    for o in [*TINY, _adapters(d)]:
        base += ["--set", o]
    train.main(base)
    assert (d / "out" / "adapters" / "a" / "step-1" / ".metadata").is_file()
    return d, base


def _refused(argv, capsys, key: str, *needles: str) -> str:
    code, lines = train_main_error(argv, capsys)
    assert code == 2 and len(lines) == 1, lines
    assert f": {key}: " in lines[0], lines[0]
    assert lines[0].startswith("error: --set ") or key == "checkpoint.folder", lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_resume_with_another_rank_is_one_line(trained, capsys):
    d, base = trained
    step = d / "out" / "adapters" / "a" / "step-1"
    before = {p.name: p.read_bytes() for p in step.iterdir()}
    _refused([*base, "--set", "lora.rank=4"], capsys, "lora.rank",
             "lora.rank = 16, the recipe has 4")  # fmt: skip
    assert {p.name: p.read_bytes() for p in step.iterdir()} == before  # nothing moved aside
    record_case("adapter jobs", "resume with another lora.rank")


def test_resume_with_swapped_sources_is_one_line(trained, capsys):
    d, base = trained
    _refused([*base, "--set", _adapters(d, a="b", b="a")], capsys, "adapters[0].source",
             "a.jsonl", "b.jsonl")  # fmt: skip
    record_case("adapter jobs", "resume with swapped sources")


def test_resume_over_a_damaged_adapter_checkpoint_is_one_line(trained, capsys, tmp_path):
    import shutil

    d, base = trained
    out = tmp_path / "out"
    shutil.copytree(d / "out", out)
    step = out / "adapters" / "b" / "step-1"
    p = max((f for f in step.iterdir() if f.suffix == ".distcp"), key=lambda f: f.stat().st_size)
    p.write_bytes(p.read_bytes()[:100])
    argv = [*base, "--set", f"job.output_dir={out}"]
    _refused(argv, capsys, "checkpoint.folder", "step-1", "damaged")
    record_case("adapter jobs", "damaged adapter checkpoint")


def test_long_adapter_name_refused_at_load(trained, capsys):
    d, base = trained
    _refused([*base, "--set", _adapters(d, name="a" * 300)], capsys, "adapters[0].name",
             "at most 128 characters")  # fmt: skip
    record_case("adapter jobs", "name too long (train.py)")
