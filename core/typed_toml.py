"""Typed TOML -> dataclass conversion, shared by recipes, cluster profiles and claims files.

One implementation of: reading TOML with positioned syntax errors, `base = "..."`
inheritance with deep merge, unknown keys with a "did you mean" hint, type checks from the
dataclass annotations (int, float, bool, str, Literal choices, lists, nested sections), and
`--set section.key=value` overrides typed by the schema. Every error is a `ConfigError`
naming the file and the dotted key.

Field documentation lives in `field(metadata={"doc": ...})` so tools can print it.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from core.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

T = TypeVar("T")

# TOML integers are 64-bit; anything larger cannot be a degree, a size or a step count.
MAX_INT = 2**63 - 1


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlevel = 3
_REPR.maxlong = 40


def show(value: Any) -> str:
    """A bounded repr for messages: huge strings, numbers and deep nesting stay one short line."""
    try:
        return _REPR.repr(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__}>"


def doc(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: `field(default=..., metadata=doc("what it is"))`."""
    return {"doc": text, **extra}


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; missing files, bad bytes and syntax errors become ConfigError."""
    p = Path(path)
    try:
        if not p.exists():
            raise ConfigError("file not found", file=str(path))
        if p.is_dir():
            raise ConfigError("expected a TOML file, found a folder", file=str(path))
        if not p.is_file():  # a FIFO or a device would block or never end
            raise ConfigError("expected a regular TOML file", file=str(path))
        raw = p.read_bytes()
    except (OSError, ValueError) as e:  # ValueError: NUL byte in the path
        raise ConfigError(
            f"cannot read: {getattr(e, 'strerror', None) or e}", file=str(path)
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"not valid UTF-8 (byte {e.start}, line {line}); TOML files must be UTF-8",
            file=str(path),
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib's message carries "(at line L, column C)", or "(at end of document)" for
        # an unterminated string or table: give that one its line number too.
        msg = str(e).replace(
            "at end of document", f"at end of document, line {text.count(chr(10)) + 1}"
        )
        raise ConfigError(f"invalid TOML: {msg}", file=str(path)) from None
    except RecursionError:
        raise ConfigError("invalid TOML: nesting too deep", file=str(path)) from None
    except ValueError as e:  # e.g. an integer literal over Python's 4300-digit limit
        raise ConfigError(f"invalid TOML: {show(str(e))}", file=str(path)) from None


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` wins; tables merge key by key, everything else is replaced whole."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def resolve_named(name_or_path: str | Path, folder: Path, *, what: str | None = None) -> Path:
    """The one resolver for named TOML files (recipes in recipes/, profiles in clusters/).

    A path (it exists, ends in .toml or has a '/') is returned as given; a bare name becomes
    `folder/<name>.toml` when that exists. Otherwise: with `what`, a ConfigError naming the
    known names (and the closest); without, the name as given (its loader then says the file
    is not there).
    """
    text = str(name_or_path)
    p = Path(name_or_path)
    try:
        if p.exists() or p.suffix == ".toml" or "/" in text:
            return p
        cand = folder / f"{text}.toml"
        if cand.exists():
            return cand
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return p
    if what is None:
        return p
    known = sorted(f.stem for f in folder.glob("*.toml"))
    hint = did_you_mean(text, known)
    raise ConfigError(f"no {what} named {text!r}{hint}; known: {', '.join(known)}", file=text)


def leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of every non-table value in `data` (tables recurse; lists are leaves)."""
    out: list[str] = []
    todo = [(prefix, data)]  # a stack, not recursion: tables may nest thousands deep
    while todo:
        pre, table = todo.pop()
        for k, v in table.items():
            key = f"{pre}.{k}" if pre else str(k)
            if isinstance(v, dict) and v:
                todo.append((key, v))
            else:
                out.append(key)
    return out


def origin_of(key: str | None, origins: dict[str, str]) -> str | None:
    """Where the value at dotted `key` came from (a file, or `--set k=v`): the entry for the
    key or, for a key inside a list or a free table, for the closest enclosing one."""
    while key:
        if key in origins:
            return origins[key]
        cut = max(key.rfind("."), key.rfind("["))
        key = key[:cut] if cut > 0 else ""
    return None


def read_with_bases(
    path: str | Path,
    *,
    origins: dict[str, str] | None = None,
    _chain: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """Read `path` and its `base = "other.toml"` chain (relative to each file), merged.

    The base is read first and the child merged over it. A cycle or a missing base is an
    error naming the file that points at it. `origins`, when given, receives the file each
    value came from (dotted key -> file), so an error about a base file's value names it.
    """
    try:
        p = Path(path).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # symlink loop, NUL byte, too long
        raise ConfigError(f"unusable path: {show(str(e))}", file=show(str(path))) from None
    if p in _chain:
        cycle = " -> ".join(str(c) for c in (*_chain, p))
        raise ConfigError(f"'base' inheritance cycle: {cycle}", file=str(path), key="base")
    data = read_toml(path)
    base = data.pop("base", None)
    if base is None:
        if origins is not None:
            origins.update(dict.fromkeys(leaf_keys(data), str(path)))
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"expected a path string (relative to this file), got {show(base)}",
            file=str(path),
            key="base",
        )
    base_path = p.parent / base
    try:
        if not base_path.exists():
            raise ConfigError(
                f"base file not found: {show(str(base_path))}", file=str(path), key="base"
            )
        if not base_path.is_file():
            raise ConfigError(
                f"base is not a TOML file: {show(str(base_path))}", file=str(path), key="base"
            )
    except (OSError, ValueError) as e:  # name too long, NUL byte
        why = getattr(e, "strerror", None) or str(e)
        raise ConfigError(f"unusable base path: {show(why)}", file=str(path), key="base") from None
    parent = read_with_bases(base_path, origins=origins, _chain=(*_chain, p))
    try:
        merged = deep_merge(parent, data)
        if origins is not None:
            origins.update(dict.fromkeys(leaf_keys(data), str(path)))
    except RecursionError:
        raise ConfigError("tables nested too deep to merge with the base", file=str(path)) from None
    return merged


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        (inner,) = get_args(tp)
        return f"a list of {_type_name(inner)}"
    if origin is dict:
        return "a table"
    if tp is type(None):
        return "nothing"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def coerce(value: Any, tp: Any, *, file: str | None, key: str) -> Any:
    """Check `value` against annotation `tp` and return it (ints widen to floats)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table [{key}], got {show(value)}", file=file, key=key)
        return build_dataclass(tp, value, file=file, prefix=key)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or type(value) is not type(choices[0]):
            hint = did_you_mean(show(value).strip("'"), [str(c) for c in choices])
            raise ConfigError(
                f"expected {_type_name(tp)}, got {show(value)}{hint}", file=file, key=key
            )
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for alt in get_args(tp):
            if alt is type(None):
                continue
            try:
                return coerce(value, alt, file=file, key=key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"expected {_type_name(tp)}, got {show(value)}", file=file, key=key)
    if origin is list:
        (inner,) = get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"expected {_type_name(tp)}, got {show(value)}", file=file, key=key)
        return [coerce(v, inner, file=file, key=f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a table, got {show(value)}", file=file, key=key)
        (_, vt) = get_args(tp)
        return {str(k): coerce(v, vt, file=file, key=f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {show(value)}", file=file, key=key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"expected an integer, got {show(value)}", file=file, key=key)
        if abs(value) > MAX_INT:
            raise ConfigError(f"integer out of range: {show(value)}", file=file, key=key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {show(value)}", file=file, key=key)
        if not math.isfinite(float(value)):
            raise ConfigError(f"expected a finite number, got {show(value)}", file=file, key=key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {show(value)}", file=file, key=key)
        if "\x00" in value:  # no path, name or option can hold one; os calls would raise
            raise ConfigError("a string cannot contain NUL (\\u0000)", file=file, key=key)
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported schema type {tp!r} at {key}")  # a schema bug, not input


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def build_dataclass(cls: type[T], data: dict[str, Any], *, file: str | None, prefix: str) -> T:
    """Instantiate dataclass `cls` from a TOML table, checking every key and type."""
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in types_:
            hint = did_you_mean(str(k), types_)
            what = "section" if isinstance(v, dict) else "key"
            known = ", ".join(sorted(types_))
            raise ConfigError(
                f"unknown {what}{hint}; known: {known}",
                file=file,
                key=key,
            )
        kwargs[k] = coerce(v, types_[k], file=file, key=key)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ checks raise with a bare key; give them the file and full prefix.
        raise ConfigError(
            e.detail,
            file=e.file or file,
            key=(f"{prefix}.{e.key}" if prefix and e.key else e.key or prefix or None),
        ) from None


def parse_scalar(text: str) -> Any:
    """Parse the right-hand side of `--set k=v` as a TOML value; bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text
    except ValueError:  # an integer over Python's 4300-digit limit: not a usable value
        return text


def apply_override(
    data: dict[str, Any],
    assignment: str,
    root: type,
    *,
    source: str = "--set",
    origins: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Apply `section.key=value` to the raw dict; the key path is checked against `root`.

    A table value given for a table (`--set 'training={steps=5, lr=1e-3}'`) merges into it
    key by key, as a recipe merges over its base; every other value replaces the old one.
    Errors name the override (`--set training.steps=-1`), and `origins` (dotted key ->
    where the value came from) records it, so later checks blame the override, not the file.
    """
    if "=" not in assignment:
        raise ConfigError(
            f"expected section.key=value, got {show(assignment)}", file=source, key=assignment
        )
    dotted, _, raw = assignment.partition("=")
    dotted = dotted.strip()
    text = assignment.strip()
    # Named as typed when short and printable, else as a bounded repr (one short line).
    source = f"{source} {text if len(text) <= 120 and text.isprintable() else show(text)}"
    parts = dotted.split(".")
    cls: Any = root
    for i, part in enumerate(parts):
        types_ = field_types(cls)
        if part not in types_:
            hint = did_you_mean(part, types_)
            raise ConfigError(
                f"unknown key{hint}; known: {', '.join(sorted(types_))}",
                file=source,
                key=".".join(parts[: i + 1]),
            )
        cls = types_[part]
        last = i == len(parts) - 1
        if not last and get_origin(cls) is dict:
            # A free-form table (e.g. [torchtitan]): the rest of the path are its keys,
            # checked by whoever consumes the table.
            cls = get_args(cls)[1]
            break
        if not last and not dataclasses.is_dataclass(cls):
            raise ConfigError("not a section", file=source, key=".".join(parts[: i + 1]))
    value = parse_scalar(raw.strip())
    section = dataclasses.is_dataclass(cls) or get_origin(cls) is dict
    if section and isinstance(value, dict):
        # Merged into the section below; its keys and types are checked with the whole
        # recipe (a key alone may break a cross-key check that the merged section passes).
        if not value:
            raise ConfigError(
                "an empty table changes nothing (a table merges into the section key by key)",
                file=source,
                key=dotted,
            )
    else:
        # A bare word that the schema wants as a number or bool is a type error, said clearly.
        coerce(value, cls, file=source, key=dotted)
    out = dict(data)
    cur = out
    for part in parts[:-1]:
        nxt = cur.get(part)
        nxt = dict(nxt) if isinstance(nxt, dict) else {}
        cur[part] = nxt
        cur = nxt
    previous = cur.get(parts[-1])
    try:
        if isinstance(value, dict) and isinstance(previous, dict):
            cur[parts[-1]] = deep_merge(previous, value)
        else:
            cur[parts[-1]] = value
        if origins is not None:
            leaves = leaf_keys(value, dotted) if isinstance(value, dict) else [dotted]
            origins.update(dict.fromkeys(leaves, source))
    except RecursionError:
        raise ConfigError("table nested too deep", file=source, key=dotted) from None
    return out


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every field, sections expanded."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key))  # type: ignore[arg-type]
            continue
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        rows.append((key, _type_name(tp), default, f.metadata.get("doc", "")))
    return rows
