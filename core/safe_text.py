"""Checks for strings that reach a shell script, an #SBATCH line, a file name or a path (pure).

A value is either checked against a conservative character set for its field (names, Slurm
words, #SBATCH paths) or, where free text is legitimate (paths given to bash, --set values),
quoted with `shlex.quote` by the renderer after `check_text` has refused what no quoting makes
safe on one line: control characters (newline, CR, NUL, ESC, U+0085), Unicode line and
paragraph separators (U+2028/U+2029), format characters (bidi overrides) and unpaired
surrogates (undecodable bytes from argv). Every refusal is a ConfigError naming the argument
or recipe key and what is allowed: one line, exit 2. docs/reliability.md lists the fields.
"""

from __future__ import annotations

import re
import unicodedata

from core.errors import ConfigError, shown

# Cc: C0/C1 controls incl. \n \r \t NUL ESC U+0085; Cf: format (bidi overrides, zero-width);
# Cs: surrogates (argv bytes that are not UTF-8); Zl/Zp: U+2028/U+2029.
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
MAX_PATH = 4096  # PATH_MAX on Linux
MAX_NAME = 128

# A run name: a folder name and `#SBATCH --job-name`. No leading '.' ("..", hidden folders)
# or '-' (read as an option), no '/', whitespace, quotes, '$', '#', '%' (Slurm file patterns).
NAME = re.compile(rf"[A-Za-z0-9_][A-Za-z0-9_.+-]{{0,{MAX_NAME - 1}}}")
NAME_ALLOWED = (
    f"1-{MAX_NAME} letters, digits, '_', '.', '+' or '-', not starting with '.', '+' or '-'"
)
# A path written into an #SBATCH line (--output, --chdir): sbatch splits #SBATCH lines on
# whitespace, reads quotes and backslashes and stops at '#'; Slurm expands '%' in file names.
SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+,:@=~-]{1,1024}")
SBATCH_PATH_ALLOWED = "letters, digits and _ . / + , : @ = ~ - (no spaces, quotes, '#' or '%')"


def bad_char(value: str) -> str | None:
    """The first character no one-line rendering can carry safely, or None."""
    for ch in value:
        if unicodedata.category(ch) in _BAD_CATEGORIES:
            return ch
    return None


def check_text(
    value: str, *, key: str, file: str | None = None, what: str = "text", limit: int = MAX_PATH
) -> str:
    """Free text that will be quoted (a path, a --set value): one line, printable, bounded."""
    ch = bad_char(value)
    if ch is not None:
        raise ConfigError(
            f"expected {what} on one line without control characters, got {shown(value)} "
            f"(contains U+{ord(ch):04X} {unicodedata.name(ch, 'control character')})",
            file=file,
            key=key,
        )
    if len(value) > limit:
        raise ConfigError(
            f"expected {what} of at most {limit} characters, got {len(value)}", file=file, key=key
        )
    return value


def check_path(value: str, *, key: str, file: str | None = None) -> str:
    """A path we create or pass on: not empty, one printable line, at most PATH_MAX."""
    if not value:
        raise ConfigError("expected a path, got ''", file=file, key=key)
    return check_text(value, key=key, file=file, what="a path")


def check_name(value: str, *, key: str, file: str | None = None) -> str:
    """A run or job name (a folder name and `#SBATCH --job-name`)."""
    if not NAME.fullmatch(value):
        raise ConfigError(f"expected {NAME_ALLOWED}, got {shown(value)}", file=file, key=key)
    return value


def check_word(
    value: str, pattern: re.Pattern[str], allowed: str, *, key: str, file: str | None = None
) -> str:
    """A value with its own character set (Slurm partition, account, an #SBATCH path...)."""
    if not pattern.fullmatch(value):
        raise ConfigError(f"expected {allowed}, got {shown(value)}", file=file, key=key)
    return value
