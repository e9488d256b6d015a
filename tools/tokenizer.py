"""Fetch a titanscale service's tokenizer where the tinker SDK's `get_tokenizer()` finds it.

    python -m tools.tokenizer [--url URL] [--base-model NAME] [--dir DIR]

The SDK's `TrainingClient.get_tokenizer()` calls `AutoTokenizer.from_pretrained` on the
`tokenizer_id` that `get_info` returns (`SamplingClient.get_tokenizer()` on the base name);
the service sets it to the served name, never to a path of the server's machine. A Hugging
Face base's name loads from the Hub or the client's cache as usual; a titanscale base
(`titanscale/<job>`), or a client with no Hub access, runs this once: it asks the service
for its tokenizer (`GET /api/v1/tokenizer`, the tenant's key in `X-API-Key`) and writes the
files into `DIR/<tokenizer_id>/`, a local folder that `from_pretrained(tokenizer_id)` reads
when the client runs in DIR. The folder is written whole or not at all (core/atomic.py).

`--url` defaults to `TINKER_BASE_URL` and the key is `TINKER_API_KEY`, as for the SDK. Bad
arguments and refusals by the service: one line, exit 2.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from data.tokenizer import TOKENIZER_FILES
from tools.cli import ArgumentParser, out_dir_arg, run

# What the service may name: `org/name` or `name` with Hugging Face's characters (no `..`,
# no absolute path: the id becomes a folder under --dir).
SAFE_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?\Z")
MAX_BYTES = 256 << 20  # a tokenizer.json is at most tens of MiB; a larger answer is refused


def fetch(url: str, key: str, base_model: str | None, timeout_s: float = 60.0) -> dict[str, Any]:
    """The service's answer to GET /api/v1/tokenizer, checked: {"tokenizer_id", "files"}."""
    query = f"?{urllib.parse.urlencode({'base_model': base_model})}" if base_model else ""
    req = urllib.request.Request(
        f"{url.rstrip('/')}/api/v1/tokenizer{query}", headers={"X-API-Key": key}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            raw = r.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read(4096)).get("detail", "")
        except (ValueError, AttributeError):
            detail = ""
        raise ConfigError(f"the service answered {e.code} {detail}".rstrip(), key="--url") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise ConfigError(f"cannot reach the service ({why})", key="--url") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"the answer exceeds {MAX_BYTES >> 20} MiB", key="--url")
    try:
        out = json.loads(raw)
    except ValueError:
        raise ConfigError(
            "the answer is not JSON (is this a titanscale service?)", key="--url"
        ) from None
    tid, files = out.get("tokenizer_id"), out.get("files")
    if not isinstance(tid, str) or not SAFE_ID.match(tid) or ".." in tid:
        raise ConfigError(f"the service named an unusable tokenizer_id {tid!r}", key="--url")
    if not isinstance(files, dict) or not isinstance(files.get("tokenizer.json"), str):
        raise ConfigError("the answer carries no tokenizer.json", key="--url")
    return {
        "tokenizer_id": tid,
        "files": {n: files[n] for n in TOKENIZER_FILES if isinstance(files.get(n), str)},
    }


def write(folder: Path, answer: dict[str, Any]) -> Path:
    """`folder/<tokenizer_id>/` holding the files, committed with one rename (a previous
    fetch of the same id is replaced)."""
    from core.atomic import publish_folder

    final = folder / answer["tokenizer_id"]
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    for name, text in answer["files"].items():
        (tmp / name).write_text(text, encoding="utf-8")
    publish_folder(tmp, final)
    return final


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--url", default=os.environ.get("TINKER_BASE_URL"),
                   help="the service (default: TINKER_BASE_URL)")  # fmt: skip
    p.add_argument("--base-model", default=None, help="the served base (checked by the service)")
    p.add_argument("--dir", default=".", help="the client's working directory")
    args = p.parse_args(argv)
    if not args.url:
        raise ConfigError("expected the service's URL (or TINKER_BASE_URL)", key="--url")
    key = os.environ.get("TINKER_API_KEY", "")
    if not key:
        raise ConfigError("expected the tenant's key in TINKER_API_KEY", key="TINKER_API_KEY")
    folder = out_dir_arg(args.dir, "--dir")
    answer = fetch(args.url, key, args.base_model)
    final = write(folder, answer)
    print(f"tools.tokenizer: {answer['tokenizer_id']} -> {final} ({', '.join(answer['files'])})")
    return 0


if __name__ == "__main__":
    run(main)
