"""`python -m tools.dryrun`: the dry run's command line (tools/dryrun/cli.py)."""

from __future__ import annotations

from tools.cli import run
from tools.dryrun import cli


def main(argv: list[str] | None = None) -> int:
    # Defined here, in __main__: tools.cli.run ends a process that imported torch through
    # tools.cli.exit_process only when its main is the program's own.
    return cli.main(argv)


if __name__ == "__main__":
    run(main)
