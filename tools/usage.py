"""Usage per tenant from the service's accounting log: device-seconds, GPU-minutes, tokens.

    python -m tools.usage --storage DIR [--since 2025-01-31|2025-01-31T12:00|24h|7d|UNIX]
                          [--by tenant|session|kind] [--json] [--prices PRICES.json]

Reads `DIR/usage.jsonl` (written by `tools.serve --storage DIR`, one record per operation:
service/accounting.py) and prints one row per tenant (its name from the key file, or the
key's fingerprint `key-<12 hex>`; never a key), or per tenant and session / operation kind,
with sessions, operations, failed operations, device-seconds (wall seconds x devices) and
GPU-minutes (device-seconds / 60) and tokens by kind (prefill, sampled, trained: only
operations that ran and succeeded), then the total. With `--prices` (the operator's price
table, service/accounting.py `Prices`) a cost column in USD follows. Damaged lines (a write cut short by a
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
    p.add_argument("--prices", default=None, help="price table (JSON) for a cost column")
    args = p.parse_args(argv)
    from service.accounting import FILE_NAME, Prices, parse_since, read_records, summarize, table

    prices = None
    if args.prices is not None:
        try:
            prices = Prices.load(args.prices)
        except ValueError as e:
            raise ConfigError(str(e), key="--prices") from None

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
        out = {t: summary.tenant_json(t) for t in sorted(summary.tenants)}
        if prices is not None:
            for t, v in summary.tenants.items():
                out[t]["cost_usd"] = prices.cost(v.device_seconds, dict(v.tokens))
        print(json.dumps(out, indent=1))
    else:
        for line in table(summary, args.by, prices):
            print(line)
    if damaged:
        print(f"tools.usage: skipped {damaged} damaged line(s) in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run(main)
