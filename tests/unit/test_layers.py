"""Layers import only downward: a module may import its own package or a lower layer.

The order (bottom first) is written in the README's folder map; `LAYERS` here is the same list
and this test reads every import statement (module level and inside functions) of every
project module. A test of the checker itself makes sure a violation is seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.runs import ROOT

# Bottom first. A package may import itself and anything before it in this list.
LAYERS = (
    "core", "recipe", "kernels", "data", "parallel", "launch", "runtime", "posttrain", "rl", "service",
    "tools",
    "train",
)  # fmt: skip


def _layer_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in LAYERS else None


def upward_imports(path: Path, package: str) -> list[str]:
    """`path:line imports X (layer L above P)` for every import of a higher layer."""
    out = []
    rank = LAYERS.index(package)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            layer = _layer_of(name)
            if layer is not None and LAYERS.index(layer) > rank:
                rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                out.append(f"{rel}:{node.lineno} imports {name} ({layer} is above {package})")
    return out


def project_modules() -> list[tuple[Path, str]]:
    mods = [(ROOT / "train.py", "train")]
    for pkg in LAYERS[:-1]:
        mods += [(p, pkg) for p in sorted((ROOT / pkg).rglob("*.py"))]
    return mods


def test_every_package_is_in_the_layer_list():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} == set(LAYERS) - {"train"}, (
        "a new top-level package needs a place in LAYERS and in the README's folder map"
    )


def test_layers_import_only_downward():
    found = [v for path, pkg in project_modules() for v in upward_imports(path, pkg)]
    assert not found, "imports from a higher layer:\n" + "\n".join(found)


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from runtime.trainer import TitanscaleTrainer\n")
    assert upward_imports(bad, "parallel") == [
        f"{bad}:2 imports runtime.trainer (runtime is above parallel)"
    ]
    assert upward_imports(bad, "tools") == []


def test_readme_states_the_same_order():
    """The README's folder map lists the layers bottom first, in this test's order."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("Layers import only downward"))
    named = []
    for x in lines[start + 1 :]:
        if x.strip() and not x.startswith("    "):
            break
        first = x.strip().split("  ")[0]
        if first:
            named.append(first)
    layers = [f"{x}.py" if x == "train" else f"{x}/" for x in LAYERS]
    assert [n for n in named if n in layers] == layers, named


def test_no_test_helper_shadows_a_project_package():
    """Worker scripts in tests/helpers run with that folder first on sys.path."""
    helpers = {p.stem for p in (ROOT / "tests" / "helpers").glob("*.py")}
    assert not helpers & set(LAYERS), sorted(helpers & set(LAYERS))
