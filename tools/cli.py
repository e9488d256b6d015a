"""The one command-line module: shared arguments, one resolver, one exit path.

Every tool (and train.py) takes a recipe and a cluster profile by name (`llama3_8b`,
`hgx_h100_ib`: a file in recipes/ or clusters/) or by path, resolved by the loaders
(`recipe.loader.resolve_recipe_path`, `parallel.cluster.resolve_cluster_path`, both
`core.typed_toml.resolve_named`); the same `--set section.key=value` overrides, typed by the
recipe schema; and one exit path: `main` is decorated with `exit_on_config_error` (bad input:
one line, exit 2) and the module ends with `run(main)` (main's int return is the exit code).
No torch import here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from core.errors import ConfigError, exit_on_config_error

ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "ROOT",
    "ArgumentParser",
    "add_cluster_arg",
    "add_override_arg",
    "add_recipe_arg",
    "add_recipe_cluster_args",
    "add_stack_arg",
    "exit_on_config_error",
    "load",
    "load_stack_arg",
    "recipe_arg",
    "run",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the tools' one exit path: a bad argument (a wrong type, a missing or
    unknown option) is one line naming it and exit 2 (`exit_on_config_error`), not a usage
    block before the message. `--help` still prints the usage and exits 0."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        # argparse skips `type` for some strings: `--nodes=--` arrives as [], not an int.
        for a in self._actions:
            v = getattr(ns, a.dest, None)
            typed = a.type in (int, float) and a.nargs is None and v is not None
            # A repeatable option (action="append") holds a list of typed values.
            values = v if typed and isinstance(a, argparse._AppendAction) else [v]
            for x in values if typed else []:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    from core.typed_toml import show

                    flag = "/".join(a.option_strings) or a.dest
                    self.error(
                        f"argument {flag}: expected {getattr(a.type, '__name__', '')}, "
                        f"got {show(x)}"
                    )
        return ns


def positive_arg(value: int | float, key: str, bound: int | float | None = None) -> None:
    """An argument that must be positive (and finite, and at most `bound`): one line otherwise."""
    if not (value > 0) or value != value or value == float("inf"):  # nan fails `> 0`
        raise ConfigError(f"expected a positive number, got {value}", key=key)
    if bound is not None and value > bound:
        shown = f"{value:,}" if value < 10**30 else f"a {len(str(int(value)))}-digit number"
        raise ConfigError(f"{shown} is too large: at most {bound:,}", key=key)


def read_text_arg(path: str, key: str) -> str:
    """A text file named by an argument: one line (not a traceback, not a hang on a FIFO)
    when it is missing, a folder, not a regular file or not UTF-8."""
    from core.typed_toml import show

    p = Path(path)
    try:
        if not p.exists():
            raise ConfigError("file not found", file=show(path), key=key)
        if not p.is_file():
            what = "a folder" if p.is_dir() else "not a regular file"
            raise ConfigError(f"expected a text file, found {what}", file=show(path), key=key)
        return p.read_bytes().decode("utf-8")
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path, bad UTF-8
        if isinstance(e, ConfigError):
            raise
        why = getattr(e, "strerror", None) or show(str(e))
        raise ConfigError(f"cannot read: {why}", file=show(path), key=key) from None


def out_dir_arg(path: str, key: str) -> Path:
    """An output folder named by an argument, created: one line when it cannot be (a file
    is in the way, no permission, a NUL byte, a name too long)."""
    from core.typed_toml import show

    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or show(str(e))
        raise ConfigError(
            f"cannot create the output folder: {why}", file=show(path), key=key
        ) from None
    return p


def out_file_arg(path: str, key: str) -> Path:
    """An output file named by an argument: its folder created and the name not a folder,
    checked before the work that produces it (one line, not a traceback at the end)."""
    from core.typed_toml import show

    p = Path(path)
    out_dir_arg(str(p.parent), key)
    if p.is_dir() or not p.name:
        raise ConfigError("expected a file name, found a folder", file=show(path), key=key)
    return p


def add_override_arg(
    p: argparse.ArgumentParser,
    help: str = "override a recipe key (repeatable), typed by the recipe schema",
) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help,
    )


def add_recipe_arg(
    p: argparse.ArgumentParser,
    *,
    required: bool = False,
    default: str | None = None,
    help: str = "",
    repeat: bool = False,
) -> None:
    """--recipe: a TOML path or a name in recipes/ (default: the debug recipe); `repeat`:
    a list of them (several bases: tools.plan --serve)."""
    what = help or "recipe TOML or a name in recipes/"
    if not required:
        what += f" (default: {default or 'recipes/debug.toml'})"
    p.add_argument(
        "--recipe",
        required=required,
        default=default,
        help=what,
        type=recipe_arg,
        metavar="RECIPE",
        action="append" if repeat else "store",
    )


def recipe_arg(value: str) -> str:
    """`--recipe=` (empty) is an error, not the default recipe (it used to run the debug
    recipe in its place)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("expected a recipe TOML or a name in recipes/, got ''")
    return value


def add_cluster_arg(p: argparse.ArgumentParser, *, required: bool = False, help: str = "") -> None:
    """--cluster: a profile TOML path or a name in clusters/."""
    p.add_argument(
        "--cluster",
        required=required,
        default=None,
        help=help or "cluster profile TOML or a name in clusters/",
    )


def add_recipe_cluster_args(
    p: argparse.ArgumentParser, *, recipe_help: str = "", repeat: bool = False
) -> None:
    """--recipe, --cluster, --nodes and --set, as the planning tools take them."""
    add_recipe_arg(p, required=True, help=recipe_help, repeat=repeat)
    add_cluster_arg(p, required=True)
    p.add_argument("--nodes", type=int, default=None, help="nodes in the job (default: the "
                   "recipe's world size / GPUs per node, else the profile's node count)")  # fmt: skip
    add_override_arg(p, "override a recipe key (repeatable), the same keys as train.py")


def add_stack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stack",
        default="torchtitan",
        help="software-stack profile in stacks/ (torchtitan: what recipes run; megatron_te: "
        "Megatron-Core + Transformer Engine, for published NeMo / Megatron-Bridge runs)",
    )


def load_stack_arg(args: argparse.Namespace) -> str:
    """The --stack name, checked (a ConfigError naming the known profiles) before any work."""
    from parallel.stacks import load_stack

    load_stack(args.stack)
    return args.stack


def load(args: argparse.Namespace):
    """(recipe, cluster sized for the job) from the planning tools' arguments."""
    from parallel.cluster import load_cluster
    from parallel.planner import world_for
    from recipe.loader import load_recipe

    if args.nodes is not None:
        from core.hardware import MAX_NODES

        positive_arg(args.nodes, "--nodes", MAX_NODES)
    recipe = load_recipe(args.recipe, args.overrides)
    cluster = load_cluster(args.cluster)
    cluster, _ = world_for(recipe, cluster, args.nodes)
    return recipe, cluster


def run(main: Callable[..., Any]) -> NoReturn:
    """`if __name__ == "__main__": run(main)`: exit with main's return code (an int; anything
    else is success), bad input as one line and exit 2; as the entry of a process that imported
    torch (main defined in `__main__`), it ends through `exit_process`."""
    try:
        rc = exit_on_config_error(main)()
        code = rc if isinstance(rc, int) else 0
    except SystemExit as e:  # sys.exit(...) inside main: same codes as the interpreter's
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    # Only as the program's entry (`python -m tools.x`, `python train.py`): a test calling run()
    # in-process must get its SystemExit, not lose the pytest process to os._exit.
    if getattr(main, "__module__", None) == "__main__" and "torch" in sys.modules:
        exit_process(code)
    raise SystemExit(code)


def exit_process(code: int) -> NoReturn:
    """End this process without the interpreter's finalization, after what a normal exit does
    that matters: non-daemon threads joined, atexit handlers run, logging and streams flushed.

    Why: a finished gloo collective's work object is freed by gloo's worker thread
    (`pt_gloo_runloop`) just after the caller's wait() returns; when it holds the last
    reference to a tensor with a Python object (gather_object's, FSDP's), freeing it takes the
    GIL. If the main thread is already finalizing the interpreter by then, taking the GIL ends
    the worker thread with pthread_exit inside a noexcept C++ frame: std::terminate ("terminate
    called without an active exception"), SIGABRT, exit 134 after a run that succeeded. Seen in
    CI on the second rank of a two-rank service and of a two-rank train.py, and in about one
    run in four of a bare two-rank gloo script ending in gather_object + destroy_process_group
    (torch 2.14.1, gdb backtrace in docs/reliability.md). Skipped: module teardown and C++ static
    destructors, which free only memory the kernel reclaims anyway.
    """
    import atexit
    import contextlib
    import logging
    import os
    import threading

    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to say to it
            stream.flush()
    os._exit(code)
