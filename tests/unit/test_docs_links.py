"""Every relative link in README.md, docs/ and benchmarks/ points at a file that exists, and
every `#anchor` at a heading of that file (GitHub's anchor rule: lowercase, punctuation
dropped, spaces to hyphens). Cheap: text only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def anchors(text: str) -> set[str]:
    out = set()
    for line in re.sub(r"```.*?```", "", text, flags=re.S).splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def test_anchor_rule():
    assert anchors("## 3. Checkpoint writes are atomic; damage is detected\n") == {
        "3-checkpoint-writes-are-atomic-damage-is-detected"
    }
    assert anchors("## Exports (`posttrain/lora.py`)\n## python -m tools.gpu_check\n") == {
        "exports-posttrainlorapy",
        "python--m-toolsgpu_check",
    }


def test_relative_links_resolve():
    files = [
        ROOT / "README.md",
        *sorted(ROOT.glob("docs/*.md")),
        *sorted(ROOT.glob("benchmarks/*.md")),
    ]
    bad = []
    checked = 0
    for f in files:
        text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)\)", text):
            link = m.group(1)
            if re.match(r"^[a-z]+:", link):
                continue  # http(s), mailto
            path, _, anchor = link.partition("#")
            target = (f.parent / path) if path else f
            checked += 1
            if not target.exists():
                bad.append(f"{f.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                bad.append(f"{f.relative_to(ROOT)}: {link} (no such heading)")
    assert checked > 30
    assert not bad, "\n".join(bad)
