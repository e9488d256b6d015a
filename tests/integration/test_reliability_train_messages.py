"""train.py's messages for bad input: one line naming where the value came from, before any
process group, and nothing else on stderr.

- `--set`: a table merges into its section (never resets it to defaults); a value given with
  `--set` is blamed on `--set key=value`, a base file's on the base file.
- Data sources that cannot train (empty, all bad, FIFO, no assistant turn) stop in
  `prepare`, before the mesh; a tokenizer larger than the model's vocabulary and a seq_len
  over the model's RoPE maximum too.
- As `python train.py` subprocesses: stderr is exactly the one line (torch's and torchao's
  import-time warnings are held back while the checks run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime.session  # noqa: F401  (torch's import-time warnings at collection, not in capsys)
import train
from core.errors import ConfigError
from recipe.loader import load_recipe
from tests.helpers.runs import ROOT, child_env
from tools.reliability_report import record_case

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def env():
    saved = dict(os.environ)
    for k in LAUNCH_VARS:
        os.environ.pop(k, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def one_line(capsys, argv: list[str]) -> str:
    """train.main in-process: exit 2 and exactly one stderr line, which is returned."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ex:
        train.main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert ex.value.code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-2000:]
    return lines[0]


# ----------------------------------------------------------------------------- --set


def test_a_table_merges_into_its_section():
    """`--set 'training={steps=5}'` changes steps only; the recipe's other values stay (it
    used to replace [training] with the defaults: seq_len 256 -> 256 here, lr 3e-3 -> 8e-4)."""
    base = load_recipe("recipes/sft_debug.toml", [])
    r = load_recipe("recipes/sft_debug.toml", ["training={steps=5, warmup_steps=1}"])
    assert (r.training.steps, r.training.warmup_steps) == (5, 1)
    assert r.training.lr == base.training.lr == 3e-3
    assert r.training.local_batch_size == base.training.local_batch_size == 4
    assert r.data == base.data
    # Nested: [torchtitan] is a free table; a table value merges there too.
    t = load_recipe(None, ["torchtitan={'training.gc_freq' = 7}", "torchtitan={a = 1}"])
    assert t.torchtitan == {"training.gc_freq": 7, "a": 1}
    record_case("train.py", "--set", n=2)


@pytest.mark.parametrize(
    "override, key, words",
    [
        ("training.steps=-1", "training.steps", "positive"),
        ("training={steps=-1}", "training.steps", "positive"),
        ("training={stepz=1}", "training.stepz", "did you mean 'steps'"),
        ("training.warmup_steps=99", "training.warmup_steps", "exceeds steps"),
        ("training={}", "training", "empty table"),
        ("training=5", "training", "expected a table"),
        ("model.vocab_size=100", "model.vocab_size", "260"),
        ("rl={temperature=0.0}", "rl.temperature", "positive"),
        ("lora.dropout=0.1", "lora.dropout", "no dropout"),
        ("data={source=''}", "data.source", "does not exist"),
        # Cross-key: the named key came from the file, the --set value broke it.
        ("parallel.tp=3", "parallel.dp_shard", "does not divide"),
        ("training.steps=1", "training.warmup_steps", "exceeds steps (1)"),
        ("training.weight_decay=2000", "training.weight_decay", "lr x weight_decay"),
    ],
)
def test_set_values_are_blamed_on_set(override, key, words):
    """The message starts with `--set <the override>` and names the key, never the file."""
    with pytest.raises(ConfigError) as e:
        r = load_recipe("recipes/debug.toml", [override])
        from recipe.loader import blamed, check_recipe
        from runtime.session import check_data_source

        with blamed(r):
            check_recipe(r, 1)
            check_data_source(r)
    msg = str(e.value)
    assert msg.startswith(f"--set {override}: {key}: "), msg
    assert words in msg and "debug.toml" not in msg, msg
    record_case("train.py", "--set")


def test_base_file_values_are_blamed_on_the_base(tmp_path):
    (tmp_path / "base.toml").write_text("[training]\nsteps = 0\n")
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[job]\nname = "c"\n')
    with pytest.raises(ConfigError) as e:
        load_recipe(tmp_path / "child.toml", [])
    assert str(e.value).startswith(f"{tmp_path / 'base.toml'}: training.steps: "), str(e.value)
    # The child's own value is the child's; a --set over it is --set's.
    (tmp_path / "child.toml").write_text('base = "base.toml"\n[training]\nsteps = -3\n')
    with pytest.raises(ConfigError, match=r"child\.toml: training\.steps: "):
        load_recipe(tmp_path / "child.toml", [])
    with pytest.raises(ConfigError, match=r"^--set training\.steps=-4: training\.steps: "):
        load_recipe(tmp_path / "child.toml", ["training.steps=-4"])
    record_case("train.py", "--set", n=3)


def test_set_blamed_after_the_torch_import(env, tmp_path, capsys):
    """Checks in prepare (model, data) name --set too, through train.main."""
    line = one_line(
        capsys, ["--set", f"job.output_dir={tmp_path}", "--set", "training.seq_len=1000000"]
    )
    assert line.startswith("error: --set training.seq_len=1000000: training.seq_len: "), line
    assert "131072" in line and "model.flavor" in line, line
    record_case("train.py", "model shape")


# ----------------------------------------------------------------------------- data, model


def _data_cases(tmp: Path) -> list[tuple[str, list[str], str, str]]:
    """(name, overrides, key, words)."""
    (tmp / "e.jsonl").write_text("")
    (tmp / "bad.jsonl").write_text('x\n{"t": 1}\n')
    os.mkfifo(tmp / "fifo.jsonl")
    (tmp / "noasst.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}))
    (tmp / "dir").mkdir()
    sft = ["data.format=sft", "data.packing=bfd", "finetune.mode=lora"]
    return [
        ("empty jsonl", [f"data.source={tmp / 'e.jsonl'}"], "data.source", "is empty (0 records)"),
        ("all bad", [f"data.source={tmp / 'bad.jsonl'}"], "data.source", "invalid_json 1"),
        ("fifo", [f"data.source={tmp / 'fifo.jsonl'}"], "data.source", "FIFO"),
        ("empty folder", [f"data.source={tmp / 'dir'}"], "data.source", "holds no"),
        (
            "no assistant",
            [*sft, f"data.source={tmp / 'noasst.jsonl'}"],
            "data.source",
            "no_assistant 1",
        ),
        (
            "mix entry empty",
            [f'data.sources=[{{source="stdlib"}}, {{source="{tmp / "e.jsonl"}"}}]'],
            "data.sources[1].source",
            "is empty",
        ),
        (
            "eval source",
            [
                *sft,
                "data.source=data/tasks/letter_sort/train.jsonl",
                f"data.eval_source={tmp / 'noasst.jsonl'}",
            ],
            "data.eval_source",
            "no_assistant",
        ),  # fmt: skip
        (
            "validation source",
            ["validation.enable=true", f"validation.source={tmp / 'e.jsonl'}"],
            "validation.source",
            "is empty",
        ),
    ]


def test_bad_data_sources_stop_before_the_mesh(env, tmp_path, capsys):
    """One line naming the key; nothing written (no metrics: the Trainer never started)."""
    for name, ovs, key, words in _data_cases(tmp_path):
        out = tmp_path / f"out-{name.replace(' ', '_')}"
        argv = ["--set", f"job.output_dir={out}"]
        for o in ovs:
            argv += ["--set", o]
        line = one_line(capsys, argv)
        assert f" {key}: " in line and words in line, (name, line)
        assert line.startswith("error: --set "), (name, line)
        assert not (out / "metrics.jsonl").exists(), name
        record_case("train.py", "data source")


def test_tokenizer_larger_than_the_model_vocabulary(env, tmp_path, capsys):
    """The embedded 2048-entry tokenizer with model.vocab_size = 300: ids up to 2047 would
    index past the embedding table (nn.Embedding raises IndexError on CPU)."""
    from data.tokenizer import resolve_tokenizer

    folder = resolve_tokenizer("embedded", vocab_size=2048)
    line = one_line(
        capsys,
        ["--set", f"job.output_dir={tmp_path}", "--set", f"model.tokenizer={folder}",
         "--set", "model.vocab_size=300"],
    )  # fmt: skip
    assert "model.vocab_size" in line and "model.tokenizer" in line and "300" in line, line
    record_case("train.py", "model shape")


# ----------------------------------------------------------------------------- subprocesses


@pytest.mark.slow  # measured: over 60 s on 2 loaded cores (#31)
def test_stderr_is_exactly_our_line(tmp_path):
    """Real `python train.py` runs for bad input found after torch is imported: stderr holds
    the one line and nothing before it (exit 2)."""
    (tmp_path / "e.jsonl").write_text("")
    os.mkfifo(tmp_path / "f.jsonl")
    cases = [
        ["training.seq_len=1000000"],
        [f"data.source={tmp_path / 'e.jsonl'}"],
        [f"data.source={tmp_path / 'f.jsonl'}"],
        ["parallel.tp=3"],
    ]
    procs = []
    for ovs in cases:  # concurrently: each spends its seconds importing torch
        argv = [sys.executable, str(ROOT / "train.py"), "--set", f"job.output_dir={tmp_path}/o"]
        for o in ovs:
            argv += ["--set", o]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=ROOT,
                env=child_env(),
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )  # fmt: skip
        )
    for ovs, proc in zip(cases, procs, strict=True):
        out, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (ovs, err[-3000:])
        assert lines[0].startswith("error: ") and "Traceback" not in out, (ovs, lines)
        record_case("train.py", "stderr before our line")


def test_sft_examples_all_too_long_stop_before_the_mesh(env, tmp_path, capsys):
    """Every letter_sort example is longer than seq_len 8 + 1 tokens: refused in prepare (the
    loader would find no usable example only after the mesh exists); with truncate it runs."""
    out = tmp_path / "o"
    argv = ["--recipe", "recipes/sft_debug.toml", "--set", f"job.output_dir={out}",
            "--set", "checkpoint.load_from=", "--set", "training.seq_len=8"]  # fmt: skip
    line = one_line(capsys, argv)
    assert "data.source: " in line and "too_long" in line and "data.truncate" in line, line
    assert not (out / "metrics.jsonl").exists()
    record_case("train.py", "data source")


def test_cpu_memory_refusals_name_the_key(env, tmp_path, capsys):
    """Sizes that would fail allocating after training starts (or be killed by the kernel):
    refused in prepare, one line naming the key that sized them."""
    cases = [
        (["training.seq_len=131072"], "training.seq_len"),
        (["model.vocab_size=2147483647"], "model.vocab_size"),
        (["--recipe", "recipes/rl_debug.toml", "rl.max_new_tokens=100000"], "rl.max_new_tokens"),
        (["--recipe", "recipes/sft_debug.toml", "checkpoint.load_from=",
          f'adapters=[{{name="a", source="{SFT}", local_batch_size=100000}}]'],
         "adapters[0].local_batch_size"),
    ]  # fmt: skip
    for ovs, key in cases:
        argv = ["--set", f"job.output_dir={tmp_path / 'o'}"]
        for o in ovs:
            argv += [o] if o.startswith("--") or o.startswith("recipes/") else ["--set", o]
        line = one_line(capsys, argv)
        assert f" {key}: " in line and "GiB" in line or "RoPE" in line, line
        record_case("train.py", "memory size")


SFT = "data/tasks/letter_sort/train.jsonl"
