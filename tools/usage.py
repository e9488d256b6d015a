"""Usage per tenant from the service's accounting log: device-seconds and GPU-minutes.

    python -m tools.usage --storage DIR [--since 2025-01-31|2025-01-31T12:00|24h|7d|UNIX]
                          [--by tenant|session|kind] [--json]

Reads `DIR/usage.jsonl` (written by `tools.serve --storage DIR`, one record per operation:
service/accounting.py) and prints one row per tenant (its name from the key file, or the
key's fingerprint `key-<12 hex>`; never a key), or per tenant and session / operation kind,
with sessions, operations, failed operations, device-seconds (wall seconds x devices) and
GPU-minutes (device-seconds / 60), then the total. Damaged lines (a write cut short by a
crash) are skipped and counted on stderr. Bad arguments: one line, exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from core.errors import ConfigError
from tools.cli import ArgumentParser, run


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--storage", required=True, help="the service's --storage folder")
    p.add_argument("--since", default=None, help="only records from then on")
    p.add_argument("--by", choices=("tenant", "session", "kind"), default="tenant")
    p.add_argument("--json", action="store_true", help="per-tenant totals as JSON")
    args = p.parse_args(argv)
    from service.accounting import FILE_NAME, parse_since, read_records, summarize, table

    since = None
    if args.since is not None:
        try:
            since = parse_since(args.since)
        except ValueError as e:
            raise ConfigError(str(e), key="--since") from None
    folder = Path(args.storage)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder", key="--storage")
    path = folder / FILE_NAME
    if not path.is_file():
        raise ConfigError(
            f"no {FILE_NAME} in {folder} (has the service run there?)", key="--storage"
        )
    try:
        records, damaged = read_records(path, since)
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror})", key="--storage") from None
    summary = summarize(records)
    if args.json:
        print(json.dumps({t: summary.tenant_json(t) for t in sorted(summary.tenants)}, indent=1))
    else:
        for line in table(summary, args.by):
            print(line)
    if damaged:
        print(f"tools.usage: skipped {damaged} damaged line(s) in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
