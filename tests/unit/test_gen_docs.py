"""docs/recipes.md and docs/tools.md are generated (tools/gen_docs.py): current, complete, true.

A new recipe key or tool flag without `python -m tools.gen_docs` fails here; so does a key the
generator skips (checked by a walk of the schema written here, not the generator's), a limit
documented but not enforced, and a "refused at load" claim the probing would get wrong.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field

import pytest

from core.errors import ConfigError
from recipe import schema
from recipe.limits import DOCUMENTED_LIMITS, check_limits
from tools import gen_docs

ROOT = gen_docs.ROOT


@pytest.fixture(scope="module")
def generated() -> dict:
    return gen_docs.generate()


def test_generated_docs_are_current(generated):
    for path, text in generated.items():
        old = path.read_text()
        diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), lineterm=""))
        assert old == text, (
            f"{path.relative_to(ROOT)} is stale: run `python -m tools.gen_docs` and commit it\n"
            + "\n".join(diff[:30])
        )


def test_generation_is_deterministic(generated):
    assert gen_docs.generate() == generated


def _schema_tables(cls: type, header: str) -> typing.Iterator[tuple[str, str]]:
    """(TOML table header, key) for every leaf key, walked here from the dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        sub = f"{header}.{f.name}" if header else f.name
        if dataclasses.is_dataclass(tp):
            yield from _schema_tables(tp, sub)
        elif inner is not None and dataclasses.is_dataclass(inner):
            yield from _schema_tables(inner, f"[{sub}]")  # an array of tables: [[sub]]
        elif not header:
            yield sub, ""  # a free table ([torchtitan])
        else:
            yield header, f.name


def test_every_schema_key_is_in_recipes_md():
    text = (ROOT / "docs" / "recipes.md").read_text()
    # The body of each `## [section]` / `### [[section]]` heading, up to the next heading.
    parts = re.split(r"^#{2,3} `\[(.+?)\]`$", text, flags=re.M)
    bodies = dict(zip(parts[1::2], parts[2::2], strict=True))
    pairs = list(_schema_tables(schema.Recipe, ""))
    assert len(pairs) > 100  # the walk found the schema, not an empty class
    missing = [
        f"[{table}] {key}"
        for table, key in pairs
        if table not in bodies or (key and f"| `{key}` |" not in bodies[table])
    ]
    assert not missing, f"keys missing from docs/recipes.md: {missing}"
    for table in ("rl", "finetune", "lora", "[adapters]", "[data.sources]", "torchtitan"):
        assert table in bodies


def _set(recipe: schema.Recipe, dotted: str, value) -> None:
    if dotted.startswith("adapters[]."):
        if not recipe.adapters:
            recipe.adapters.append(schema.AdapterSection(name="a", source="a.jsonl"))
        obj, name = recipe.adapters[0], dotted.split(".", 1)[1]
    else:
        section, name = dotted.split(".")
        obj = getattr(recipe, section)
    setattr(obj, name, value)


@pytest.mark.parametrize("key", sorted(DOCUMENTED_LIMITS))
def test_documented_limits_are_enforced(key):
    settings, _ = DOCUMENTED_LIMITS[key]
    ok = schema.Recipe()
    check_limits(ok)  # the defaults pass
    bad = schema.Recipe()
    for dotted, value in settings.items():
        _set(bad, dotted, value)
    with pytest.raises(ConfigError) as e:
        check_limits(bad)
    assert e.value.key == key.replace("[]", "[0]")


def _refusing(check):
    """A one-field section whose __post_init__ refuses what `check(x)` is true for."""

    @dataclass
    class Section:
        x: float = field(default=0.5)

        def __post_init__(self) -> None:
            if check(self.x):
                raise ConfigError("refused", key="x")

    return Section


@pytest.mark.parametrize(
    ("check", "tp", "expected"),
    [
        (lambda x: x <= 0, int, "≤ 0"),
        (lambda x: x < 0, int, "< 0"),
        (lambda x: x <= 0 and x != -1, int, "≤ 0 except -1"),
        (lambda x: x < 0 or x == 1, int, "< 0, 1"),
        (lambda x: not 0 <= x <= 1, float, "< 0, > 1"),
        (lambda x: x != 0, float, "≠ 0"),
        (lambda x: x > 1e6, float, ""),  # a bound the probes don't reach is not claimed
        (lambda x: x < -5, int, ""),  # -1 and -2 pass: no claim about negatives
        (lambda x: False, float, ""),
    ],
)
def test_refused_range_probe(check, tp, expected):
    assert gen_docs.refused_range(_refusing(check), "x", tp) == expected


def test_every_tool_with_a_parser_is_in_tools_md():
    text = (ROOT / "docs" / "tools.md").read_text()
    tools = [
        f"python -m tools.{p.stem}"
        for p in sorted((ROOT / "tools").glob("*.py"))
        if "ArgumentParser(" in p.read_text() and p.stem not in ("cli", "gen_docs")
    ]
    assert len(tools) > 10
    missing = [t for t in [*tools, "python train.py"] if f"\n## {t}\n" not in text]
    assert not missing, f"tools missing from docs/tools.md: {missing}"
    # flags of one tool, listed here by hand, are in its table
    serve = text.split("\n## python -m tools.serve\n")[1].split("\n## ")[0]
    for flag in ("--recipe", "--port", "--api-key-file", "--session-ttl", "--set"):
        assert f"| `{flag}` |" in serve
