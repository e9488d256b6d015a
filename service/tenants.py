"""Tenants and their API keys: who owns a session, a model, a sampler, a future, a checkpoint.

The key file (`tools.serve --api-key-file`), one entry per line, `#` comments:

    tml-<secret>              a tenant of its own, named by the key's fingerprint key-<12 hex>
    alice tml-<secret>        tenant "alice"; several lines with one name = several keys

Rules (each broken rule is one line naming the file and line, never the key, and exit 2 at
start-up): a regular file (a FIFO would block the server), readable by its owner only
(mode 0600, like an ssh key: anyone who reads it can act as every tenant), UTF-8, every key
`tml-` (the SDK sends no other) plus at least `MIN_KEY_CHARS` characters from
[A-Za-z0-9._~+/=-], no key twice, tenant names [A-Za-z0-9][A-Za-z0-9_.-]{0,63} not starting
with `key-` (those are fingerprints).

Revocation without a restart: `KeyFile.ring()` re-reads the file when its size, mtime, inode
or mode changed (one stat per request), and `reload()` (SIGHUP) re-reads it at once. A reload
that fails keeps the previous keys and logs the reason at ERROR (the service must not lock
every tenant out over a typo); fix the file and save it again.

Keys are looked up by SHA-256 digest; the key itself is never stored in a log, a response, a
folder name or an accounting record: those carry the tenant's name (or fingerprint).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass

from core.errors import ConfigError

log = logging.getLogger("service")

KEY_PREFIX = "tml-"  # the SDK refuses keys without it (tinker.lib._auth_token_provider)
MIN_KEY_CHARS = 16  # after the prefix: 16 random base64 characters are 96 bits
MAX_KEY_FILE_BYTES = 1 << 20
_KEY = re.compile(r"^tml-[A-Za-z0-9._~+/=-]+\Z")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
LOCAL = "local"  # the one tenant of a service without a key file (loopback only)


@dataclass(frozen=True)
class Tenant:
    """A tenant: its name (from the key file, or the key's fingerprint) is also its storage
    folder and its accounting label."""

    name: str


def fingerprint(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def parse_keys(text: str, source: str) -> dict[bytes, Tenant]:
    """The key file's text -> {sha256(key): tenant}. ConfigError naming the line."""
    out: dict[bytes, Tenant] = {}
    first_line: dict[bytes, int] = {}
    key_arg = "--api-key-file"
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) > 2:
            raise ConfigError(
                f"{source} line {n}: expected 'KEY' or 'TENANT KEY' (found {len(fields)} fields)",
                key=key_arg,
            )
        key = fields[-1]
        name = fields[0] if len(fields) == 2 else None
        where = f"{source} line {n}"
        if not key.startswith(KEY_PREFIX):
            raise ConfigError(
                f"{where}: the key does not start with {KEY_PREFIX!r} (the tinker SDK only "
                "sends keys that do)",
                key=key_arg,
            )
        if len(key) - len(KEY_PREFIX) < MIN_KEY_CHARS:
            raise ConfigError(
                f"{where}: the key has {len(key) - len(KEY_PREFIX)} characters after "
                f"{KEY_PREFIX!r}; at least {MIN_KEY_CHARS} are required",
                key=key_arg,
            )
        if not _KEY.match(key):
            raise ConfigError(
                f"{where}: the key may only hold letters, digits and . _ ~ + / = -", key=key_arg
            )
        if name is not None and (not _NAME.match(name) or name.startswith("key-") or name == LOCAL):
            raise ConfigError(
                f"{where}: tenant name {name!r}: use 1-64 letters, digits, '_', '-', '.' "
                f"(not starting with 'key-', not {LOCAL!r})",
                key=key_arg,
            )
        d = _digest(key.encode())
        if d in out:
            raise ConfigError(
                f"{where}: the same key is already on line {first_line[d]}", key=key_arg
            )
        out[d] = Tenant(name or fingerprint(key))
        first_line[d] = n
    if not out:
        raise ConfigError(f"{source} holds no keys (one per line)", key=key_arg)
    names = {t.name for t in out.values() if t.name.startswith("key-")}
    if len(names) != sum(1 for t in out.values() if t.name.startswith("key-")):
        raise ConfigError(f"{source}: two keys share a fingerprint; replace one", key=key_arg)
    return out


_MISSING = (-1,)  # the signature of a key file that cannot be stat'ed


def _file_signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


def read_key_file(path: str) -> tuple[dict[bytes, Tenant], tuple[int, ...]]:
    """Checks and parses the key file; ConfigError (one line) for every problem."""
    key_arg = "--api-key-file"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror})", key=key_arg) from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "not a regular file"
        )
        raise ConfigError(f"{path} is {kind}; expected a regular file of keys", key=key_arg)
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{path} is accessible to group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"it holds every tenant's secret: run chmod 600 {path}",
            key=key_arg,
        )
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"{path} is {st.st_size} bytes; a key file is at most {MAX_KEY_FILE_BYTES}",
            key=key_arg,
        )
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO after the stat, do not hang.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(f"{path} is not a regular file", key=key_arg)
            data = os.read(fd, MAX_KEY_FILE_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror})", key=key_arg) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {e.start}: {data[e.start]:#04x})", key=key_arg
        ) from None
    return parse_keys(text, path), _file_signature(st)


class KeyFile:
    """The live key ring of one key file: reloaded when the file changes, or on `reload()`."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._keys, self._sig = read_key_file(path)
        self.reloads = 0

    def _signature(self) -> tuple[int, ...]:
        """The file's signature; `_MISSING` while it cannot be stat'ed (deleted), so a
        missing file is one change (one ERROR line), not one per request."""
        try:
            return _file_signature(os.stat(self.path))
        except OSError:
            return _MISSING

    def _changed(self) -> bool:
        return self._signature() != self._sig

    def reload(self) -> bool:
        """Re-read the file; on failure keep the previous keys (logged). True if reloaded."""
        with self._lock:
            try:
                keys, sig = read_key_file(self.path)
            except ConfigError as e:
                self._sig = self._signature()  # log once per change
                log.error("service: key file not reloaded, previous keys stay valid: %s", e)
                return False
            before = len(self._keys)
            self._keys, self._sig = keys, sig
            self.reloads += 1
        log.info("service: key file reloaded: %d key(s) (was %d)", len(keys), before)
        return True

    def tenant(self, key: str) -> Tenant | None:
        """The tenant owning `key`, or None (reloading first when the file changed)."""
        if self._changed():
            self.reload()
        return self._keys.get(_digest(key.encode()))

    def __len__(self) -> int:
        return len(self._keys)

    def tenants(self) -> set[str]:
        return {t.name for t in self._keys.values()}
