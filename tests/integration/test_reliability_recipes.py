"""Recipe fuzzing: every bad recipe ends in a ConfigError naming its key or file position.

Hypothesis generates broken recipes of every kind users produce (wrong types, negative or
non-dividing degrees, unknown and misspelled keys and sections, missing and cyclic bases,
invalid TOML, non-UTF-8 bytes, huge numbers, deep nesting, bad --set overrides), each
with the error it must produce: the dotted key, or for syntax and encoding errors the
file and a "line N" position. Any other exception, or a ConfigError naming something else,
fails the test with the recipe shown. The bulk goes through `recipe.loader`; a sample goes
through `train.main` in-process (exit code 2, one line on stderr, no traceback) and a
handful through `python train.py` as real subprocesses.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import ConfigError
from core.typed_toml import MAX_INT, describe
from recipe.loader import check_recipe, load_recipe
from recipe.schema import Recipe
from tests.helpers.runs import ROOT, child_env
from tools.reliability_report import record

FUZZ_EXAMPLES = int(os.environ.get("TITANSCALE_FUZZ_EXAMPLES", "600"))
TRAIN_MAIN_EXAMPLES = 120

# A valid base recipe (the debug recipe's values): every case breaks exactly one thing.
BASE: dict[str, dict[str, Any]] = {
    "job": {"name": "fuzz", "output_dir": "outputs/fuzz"},
    "model": {"flavor": "debugmodel", "tokenizer": "embedded"},
    "training": {"seq_len": 256, "local_batch_size": 2, "steps": 10, "lr": 8e-4},
    "parallel": {"dp_shard": -1},
    "checkpoint": {"interval": 0},
    "metrics": {"log_every": 1},
}
# [torchtitan] is a free-form table (checked against torchtitan's dataclasses at prepare,
# tests/unit/test_torchtitan_overrides.py), so it is no section with fixed keys here.
FREE_TABLES = ("torchtitan",)
# Top-level arrays of tables ([[adapters]]) have no "section.key" of their own: the section
# mutators skip them, and test_adapter_array_errors_name_the_entry covers them.
FIELDS = {
    key: tp for key, tp, _default, _doc in describe(Recipe) if key not in FREE_TABLES and "." in key
}
SECTIONS = sorted({k.split(".")[0] for k in FIELDS})


@dataclass
class Case:
    kind: str
    files: dict[str, bytes]
    main: str = "recipe.toml"
    overrides: list[str] = field(default_factory=list)
    world_size: int = 2
    expect: str = ""  # dotted key, or "position" (file + line), or "file"

    def __repr__(self) -> str:  # hypothesis prints failing cases: keep them readable
        return self.show()

    def show(self) -> str:
        body = {n: b[:600].decode("utf-8", "backslashreplace") for n, b in self.files.items()}
        return f"[{self.kind}] world={self.world_size} overrides={self.overrides}\n" + "\n".join(
            f"--- {n}\n{t}" for n, t in body.items()
        )


# ---------------------------------------------------------------------------- TOML writing


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, Raw):
        return v.text
    raise TypeError(type(v))


@dataclass
class Raw:
    """A TOML value written verbatim (datetimes, 1e400, deep nesting)."""

    text: str


def toml_text(data: dict[str, Any]) -> str:
    lines = []
    for k, v in data.items():
        if not isinstance(v, dict):
            lines.append(f"{json.dumps(k)} = {toml_value(v)}")
    for section, table in data.items():
        if isinstance(table, dict):
            lines.append(f"[{json.dumps(section)}]")
            lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def with_value(dotted: str, value: Any) -> dict[str, Any]:
    section, key = dotted.split(".")
    data = {s: dict(t) for s, t in BASE.items()}
    data.setdefault(section, {})[key] = value
    return data


def one_file(kind: str, data: dict[str, Any], expect: str, world_size: int = 2) -> Case:
    return Case(
        kind, {"recipe.toml": toml_text(data).encode()}, world_size=world_size, expect=expect
    )


# ---------------------------------------------------------------------------- strategies

scalar_keys = sorted(FIELDS)
texts = st.text(max_size=30)
datetimes = st.sampled_from(["1979-05-27T07:32:00Z", "1979-05-27", "07:32:00"]).map(Raw)
tables = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.integers(), max_size=3)


def wrong_values_for(tp: str) -> st.SearchStrategy:
    ints = st.integers(min_value=-(2**70), max_value=2**70)
    floats = st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x))
    lists = st.lists(st.integers(), max_size=3)
    if tp == "an integer":
        return st.one_of(texts, floats, st.booleans(), lists, tables, datetimes)
    if tp == "a number":
        return st.one_of(texts, st.booleans(), lists, tables, datetimes)
    if tp == "true or false":
        return st.one_of(ints, texts, floats, lists, tables, datetimes)
    if tp == "a string":
        return st.one_of(ints, st.booleans(), floats, lists, tables, datetimes)
    if tp.startswith("a list of"):  # data.data_files, data.sources: any non-list
        return st.one_of(ints, st.booleans(), floats, texts, datetimes)
    assert tp.startswith("one of"), tp
    choices = re.findall(r"'([^']*)'", tp)
    return st.one_of(ints, st.booleans(), lists, texts.filter(lambda s: s not in choices))


@st.composite
def wrong_type(draw) -> Case:
    key = draw(st.sampled_from(scalar_keys))
    return one_file("wrong type", with_value(key, draw(wrong_values_for(FIELDS[key]))), key)


# key -> strategy of invalid values (negative, zero, out of range)
NEGATIVE = {
    "training.seq_len": st.integers(max_value=0),
    "training.local_batch_size": st.integers(max_value=0),
    "training.steps": st.integers(max_value=0),
    "training.global_batch_size": st.integers(max_value=0).filter(lambda v: v != -1),
    "training.lr": st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    "training.warmup_steps": st.integers(max_value=-1),
    "training.weight_decay": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
    "training.max_norm": st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    "parallel.dp_replicate": st.integers(max_value=0),
    "parallel.dp_shard": st.integers(max_value=0).filter(lambda v: v != -1),
    "parallel.tp": st.integers(max_value=0),
    "parallel.pp": st.integers(max_value=0),
    "parallel.cp": st.integers(max_value=0),
    "parallel.world_size": st.integers(max_value=-1),
    "parallel.pp_microbatches": st.integers(max_value=-1),
    "model.vocab_size": st.one_of(st.integers(max_value=-1), st.integers(1, 259)),
    "checkpoint.interval": st.integers(max_value=-1),
    "checkpoint.keep_latest": st.one_of(st.integers(max_value=-1), st.just(1)),
    "metrics.log_every": st.integers(max_value=0),
    "metrics.summary_skip_steps": st.integers(max_value=-1),
    "job.collective_timeout_s": st.integers(max_value=0),
    "job.init_timeout_s": st.integers(max_value=-1),  # 0 = automatic
}


@st.composite
def negative(draw) -> Case:
    key = draw(st.sampled_from(sorted(NEGATIVE)))
    value = draw(NEGATIVE[key].map(lambda v: max(v, -(2**63)) if isinstance(v, int) else v))
    return one_file("negative or out of range", with_value(key, value), key)


@st.composite
def non_dividing(draw) -> Case:
    how = draw(st.sampled_from(["product", "fixed", "heads", "declared", "gbs", "pp_split"]))
    par = {"dp_shard": -1}
    ws = draw(st.integers(1, 64))
    training = dict(BASE["training"])
    if how == "product":
        degs = {k: draw(st.integers(1, 16)) for k in ("dp_replicate", "tp", "pp", "cp")}
        if ws % math.prod(degs.values()) == 0:
            degs["cp"] = degs["cp"] * ws + 1  # no longer divides
        par.update(degs)
        expect = "parallel.dp_shard"
    elif how == "fixed":
        par["dp_shard"] = draw(st.integers(1, 2**40).filter(lambda v: v != ws))
        expect = "parallel.dp_shard"
    elif how == "heads":
        tp = draw(st.sampled_from([3, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]))
        par["tp"], ws = tp, tp * draw(st.integers(1, 4))
        expect = "parallel.tp"
    elif how == "declared":
        par["world_size"] = draw(st.integers(1, 2**20).filter(lambda v: v != ws))
        expect = "parallel.world_size"
    elif how == "gbs":
        ws = draw(st.integers(1, 8))
        lbs = draw(st.integers(1, 8))
        training["local_batch_size"] = lbs
        training["global_batch_size"] = draw(
            st.integers(1, 10**6).filter(lambda g: g % (lbs * ws) != 0)
        )
        expect = "training.global_batch_size"
    else:
        pp = draw(st.sampled_from([5, 7, 9, 10, 11, 12, 13]))
        par["pp"], ws = pp, pp
        expect = "parallel.pp"
    data = {s: dict(t) for s, t in BASE.items()}
    data["parallel"], data["training"] = par, training
    return one_file(f"non-dividing degrees ({how})", data, expect, world_size=ws)


ident = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,30}", fullmatch=True)


@st.composite
def unknown_key(draw) -> Case:
    section = draw(st.sampled_from(SECTIONS))
    name = draw(ident.filter(lambda n: f"{section}.{n}" not in FIELDS))
    value = draw(st.one_of(st.integers(), texts, st.booleans()))
    data = {s: dict(t) for s, t in BASE.items()}
    data.setdefault(section, {})[name] = value
    return one_file("unknown key", data, f"{section}.{name}")


@st.composite
def unknown_section(draw) -> Case:
    name = draw(ident.filter(lambda n: n not in (*SECTIONS, *FREE_TABLES, "base")))
    data = {s: dict(t) for s, t in BASE.items()}
    data[name] = draw(st.one_of(tables, st.integers()))
    return one_file("unknown section", data, name)


def _edits(word: str) -> st.SearchStrategy[str]:
    alphabet = "abcdefghijklmnopqrstuvwxyz_"
    i = st.integers(0, len(word) - 1)
    delete = i.map(lambda k: word[:k] + word[k + 1 :])
    swap = st.integers(0, len(word) - 2).map(
        lambda k: word[:k] + word[k + 1] + word[k] + word[k + 2 :]
    )
    replace = st.tuples(i, st.sampled_from(alphabet)).map(
        lambda t: word[: t[0]] + t[1] + word[t[0] + 1 :]
    )
    insert = st.tuples(i, st.sampled_from(alphabet)).map(
        lambda t: word[: t[0]] + t[1] + word[t[0] :]
    )
    return st.one_of(delete, swap, replace, insert)


@st.composite
def misspelled(draw) -> Case:
    real = draw(st.sampled_from([k for k in scalar_keys if len(k.split(".")[1]) >= 5]))
    section, key = real.split(".")
    wrong = draw(_edits(key).filter(lambda w: w and f"{section}.{w}" not in FIELDS))
    data = {s: dict(t) for s, t in BASE.items()}
    data.setdefault(section, {})[wrong] = 1
    case = one_file("misspelled key", data, f"{section}.{wrong}")
    case.kind = "misspelled key"
    return case


@st.composite
def missing_base(draw) -> Case:
    name = draw(st.from_regex(r"[a-z]{1,12}(/[a-z]{1,8})?\.toml", fullmatch=True))
    text = f"base = {json.dumps(name)}\n" + toml_text(BASE)
    return Case("missing base", {"recipe.toml": text.encode()}, expect="base")


@st.composite
def bad_base_value(draw) -> Case:
    value = draw(
        st.one_of(
            st.integers(),
            st.booleans(),
            st.just(""),
            st.just("."),
            st.just("a\u0000b.toml"),
            st.just("x" * 5000 + ".toml"),
            st.lists(st.integers(), max_size=2),
        )
    )
    text = f"base = {toml_value(value)}\n" + toml_text(BASE)
    return Case("bad base value", {"recipe.toml": text.encode()}, expect="base")


@st.composite
def cyclic_base(draw) -> Case:
    n = draw(st.integers(1, 5))
    names = [f"r{i}.toml" for i in range(n)]
    files = {}
    for i, name in enumerate(names):
        text = f"base = {json.dumps(names[(i + 1) % n])}\n" + toml_text(BASE)
        files[name] = text.encode()
    return Case(f"cyclic base ({n} files)", files, main=names[0], expect="base")


BROKEN_TOML = [
    'name = "unterminated',
    "[job",
    "[[job]",
    "= 5",
    "x = ",
    "x = abc",
    "x = [1 2]",
    'x = "\\q"',
    "x = 1\nx = 2",
    "x = {a = 1,}",
    "x = 1979-13-45",
    "[training]\n[training]",
    "x = 0x",
    "x = 1__0",
    "x = +nan_",
    "x = '''",
]


@st.composite
def invalid_toml(draw) -> Case:
    lines = toml_text(BASE).splitlines()
    at = draw(st.integers(0, len(lines)))
    broken = draw(st.sampled_from(BROKEN_TOML))
    lines.insert(at, broken)
    return Case("invalid TOML", {"recipe.toml": "\n".join(lines).encode()}, expect="position")


BAD_UTF8 = [
    b"\xff",
    b"\xfe\xff",
    b"\xc3\x28",
    b"\x80",
    b"\xe2\x82",
    b"\xf0\x28\x8c\x28",
    b"\xed\xa0\x80",
]


@st.composite
def non_utf8(draw) -> Case:
    raw = toml_text(BASE).encode()
    at = draw(st.integers(0, len(raw)))
    bad = draw(st.sampled_from(BAD_UTF8))
    return Case("non-UTF-8 bytes", {"recipe.toml": raw[:at] + bad + raw[at:]}, expect="position")


@st.composite
def huge_number(draw) -> Case:
    int_keys = [k for k in scalar_keys if FIELDS[k] == "an integer"]
    float_keys = [k for k in scalar_keys if FIELDS[k] == "a number"]
    how = draw(st.sampled_from(["int64", "float", "degree", "digits"]))
    if how == "digits":  # over Python's 4300-digit int parsing limit
        key = draw(st.sampled_from(int_keys))
        raw = Raw("9" * draw(st.integers(4301, 6000)))
        return one_file("huge number (digits)", with_value(key, raw), f"file|{key}")
    if how == "int64":
        key = draw(st.sampled_from(int_keys))
        value: Any = draw(st.integers(min_value=MAX_INT + 1, max_value=10**400))
        value = value * draw(st.sampled_from([1, -1]))
    elif how == "float":
        key = draw(st.sampled_from(float_keys))
        value = Raw(draw(st.sampled_from(["1e400", "-1e400", "inf", "-inf", "nan", "+nan"])))
    else:
        key = draw(
            st.sampled_from(["parallel.tp", "parallel.pp", "parallel.cp", "parallel.dp_replicate"])
        )
        value = draw(st.integers(2**31, MAX_INT))
        # Named at the degree itself (recipe.limits: over 2^31 - 1), or by the world-size fit.
        return one_file("huge degree", with_value(key, value), f"{key}|parallel.dp_shard")
    return one_file(f"huge number ({how})", with_value(key, value), key)


@st.composite
def deep_nesting(draw) -> Case:
    depth = draw(st.integers(30, 3000))
    how = draw(st.sampled_from(["array", "inline_table", "table_header"]))
    if how == "array":
        key = draw(st.sampled_from(scalar_keys))
        section, k = key.split(".")
        text = f"[{section}]\n{k} = " + "[" * depth + "1" + "]" * depth + "\n"
        # Either the TOML parser gives up ("nesting too deep", names the file) or the
        # schema rejects the value at its key.
        return Case(f"deep nesting ({how})", {"recipe.toml": text.encode()}, expect=f"file|{key}")
    if how == "inline_table":
        section = draw(st.sampled_from(SECTIONS))
        text = f"[{section}]\nx = " + "{a = " * depth + "1" + "}" * depth + "\n"
        return Case(
            f"deep nesting ({how})", {"recipe.toml": text.encode()}, expect=f"file|{section}.x"
        )
    section = draw(st.sampled_from(SECTIONS))
    text = "[" + ".".join([section] + ["a"] * depth) + "]\nx = 1\n"
    base = "[" + ".".join([section] + ["a"] * depth) + "]\ny = 1\n"
    files = {"recipe.toml": ('base = "b.toml"\n' + text).encode(), "b.toml": base.encode()}
    return Case(f"deep nesting ({how})", files, expect=f"file|{section}.a")


@st.composite
def bad_override(draw) -> Case:
    how = draw(st.sampled_from(["no_equals", "unknown", "not_section", "wrong_type", "section"]))
    key = draw(st.sampled_from(scalar_keys))
    section = key.split(".")[0]
    if how == "no_equals":
        o = draw(st.from_regex(r"[a-z_.]{1,20}", fullmatch=True))
        expect = o
    elif how == "unknown":
        name = draw(ident.filter(lambda n: f"{section}.{n}" not in FIELDS))
        o, expect = f"{section}.{name}=1", f"{section}.{name}"
    elif how == "not_section":
        o, expect = f"{key}.x=1", key
    elif how == "section":
        o, expect = f"{section}=1", section
    else:
        v = draw(wrong_values_for(FIELDS[key]).filter(lambda v: not isinstance(v, (dict, Raw))))
        o, expect = f"{key}={toml_value(v)}", key
        if FIELDS[key] == "a string" and isinstance(v, list):
            o = f"{key}={toml_value(v)}"
    return Case(
        f"bad --set ({how})",
        {"recipe.toml": toml_text(BASE).encode()},
        overrides=[o],
        expect=expect,
    )


ANY_BAD = st.one_of(
    wrong_type(),
    negative(),
    non_dividing(),
    unknown_key(),
    unknown_section(),
    misspelled(),
    missing_base(),
    bad_base_value(),
    cyclic_base(),
    invalid_toml(),
    non_utf8(),
    huge_number(),
    deep_nesting(),
    bad_override(),
)


# ---------------------------------------------------------------------------- checks


def materialise(case: Case, folder: Path) -> Path:
    for name, data in case.files.items():
        (folder / name).write_bytes(data)
    return folder / case.main


def check_error(case: Case, err: ConfigError) -> None:
    msg = str(err)
    options = case.expect.split("|")
    ok = False
    for expect in options:
        if expect == "position":
            ok |= bool(err.file) and bool(re.search(r"\bline \d+", msg))
        elif expect == "file":
            ok |= bool(err.file) and err.file in msg
        else:
            ok |= err.key == expect and expect in msg
    assert ok, (
        f"expected {case.expect!r}, got key={err.key!r} file={err.file!r}: {msg}\n{case.show()}"
    )
    assert "\n" not in msg.strip(), f"multi-line message: {msg!r}"
    if case.kind == "misspelled key":
        assert "did you mean" in msg, msg


def load_and_check(case: Case, folder: Path) -> ConfigError:
    path = materialise(case, folder)
    try:
        recipe = load_recipe(path, case.overrides)
        check_recipe(recipe, case.world_size)
    except ConfigError as e:
        return e
    except Exception as e:  # noqa: BLE001 - the property under test
        raise AssertionError(f"{type(e).__name__}: {e}\n{case.show()}") from e
    raise AssertionError(f"accepted a bad recipe\n{case.show()}")


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=ANY_BAD)
def _fuzz_loader(kinds: Counter[str], case: Case) -> None:
    with tempfile.TemporaryDirectory() as d:
        err = load_and_check(case, Path(d))
    check_error(case, err)
    kinds[case.kind.split(" (")[0]] += 1


def test_fuzzed_recipes_end_in_config_error():
    kinds: Counter[str] = Counter()
    _fuzz_loader(kinds)
    total = sum(kinds.values())
    assert total >= min(FUZZ_EXAMPLES, 500), kinds
    assert len(kinds) >= 12, kinds  # every kind of bad input was generated
    record("recipes_fuzzed_loader", total)
    record("recipe_fuzz_kinds", dict(sorted(kinds.items())))


# ---------------------------------------------------------------------------- via train.py


@pytest.fixture
def restore_env():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@settings(
    max_examples=TRAIN_MAIN_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=ANY_BAD)
def test_fuzzed_recipes_through_train_main(case: Case, restore_env, capsys):
    """train.main in-process: exit code 2, one 'error:' line last on stderr, no traceback."""
    import train

    for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    os.environ["WORLD_SIZE"] = str(case.world_size)
    capsys.readouterr()
    with tempfile.TemporaryDirectory() as d:
        path = materialise(case, Path(d))
        argv = ["--recipe", str(path)]
        for o in case.overrides:
            argv += ["--set", o]
        with pytest.raises(SystemExit) as ex:
            train.main(argv)
        out, errtext = capsys.readouterr()
    assert ex.value.code == 2, f"exit {ex.value.code}\n{errtext[-2000:]}\n{case.show()}"
    # Only our line starts with "error:"; torch may log import-time warnings before it.
    errors = [ln for ln in errtext.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errtext.strip().splitlines()[-1] == errors[0], errtext
    assert "Traceback" not in out + errtext
    record("recipes_through_train_main", 1)


SUBPROCESS_CASES = {
    "unknown key": (b"[training]\nstepz = 5\n", "training.stepz"),
    "wrong type": (b'[training]\nsteps = "ten"\n', "training.steps"),
    "invalid TOML": (b"[training\nsteps = 5\n", "line 1"),
    "non-UTF-8": (b'[job]\nname = "\xff\xfe"\n', "line 2"),
    "huge number": (b"[training]\nsteps = 99999999999999999999999\n", "training.steps"),
    "cyclic base": (b'base = "recipe.toml"\n', "cycle"),
    "missing base": (b'base = "nope.toml"\n', "nope.toml"),
    # Fails in check_recipe (needs the model's head count: imports torchtitan).
    "tp does not divide heads": (b"[parallel]\ntp = 3\nworld_size = 3\n", "parallel.world_size"),
}


def test_bad_recipes_through_train_py_subprocess(tmp_path):
    """A few real `python train.py` runs: exit 2, the message on stderr, no traceback."""
    n = 0
    for name, (text, needle) in SUBPROCESS_CASES.items():
        p = tmp_path / "recipe.toml"
        p.write_bytes(text)
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), "--recipe", str(p)],
            cwd=ROOT,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
        assert needle in proc.stderr and str(p) in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr + proc.stdout, (name, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
        # The whole of stderr is the one line: decided before torch is imported, or after
        # it with the import's warnings held back (core.errors.held_stderr).
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        n += 1
    record("recipes_through_train_py_subprocess", n)


@pytest.mark.parametrize(
    "text, expect",
    [
        ("adapters = 3\n", r"adapters: expected a list of AdapterSection, got 3"),
        (
            '[[adapters]]\nname = "x"\nsource = "d.jsonl"\nlrr = 1\n',
            r"adapters\[0\]\.lrr: unknown key \(did you mean 'lr'\?\)",
        ),
        (
            '[[adapters]]\nname = "ok"\nsource = "d.jsonl"\n[[adapters]]\nname = "a b"\n'
            'source = "d.jsonl"\n',
            r"adapters\[1\]\.name: expected a name of ASCII letters, digits, _ or -",
        ),
        ('[[adapters]]\nname = "x"\nsource = "d.jsonl"\nsteps = -2\n', r"adapters\[0\]\.steps"),
    ],
)
def test_adapter_array_errors_name_the_entry(tmp_path, text, expect):
    """[[adapters]] entries: one ConfigError naming the file and adapters[i].key."""
    from recipe.loader import load_recipe

    f = tmp_path / "r.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(str(f)) + ": " + expect):
        load_recipe(str(f), [])
