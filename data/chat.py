"""SFT records -> token ids with an assistant-only loss mask (pure apart from the tokenizer).

Records (one JSON object per line):
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...], "weight"?: w}
  {"prompt": "...", "completion": "...", "weight"?: w}   (= one user turn, one assistant turn)

Rendering (docs/sft.md):
- A tokenizer folder with a chat template (tokenizer_config.json "chat_template" or
  chat_template.jinja): Hugging Face `apply_chat_template`, rendered incrementally: the text
  up to each assistant turn with `add_generation_prompt=True` is prompt, the text that turn
  adds after it is trained. Each piece is tokenized on its own (what a generator produces:
  the prompt tokenized, the answer sampled token by token). A template whose rendering of a
  prefix is not a prefix of the whole rendering (some templates drop earlier reasoning) is a
  bad record ("template"), never a silently wrong mask.
- The embedded tokenizer (no template of its own), the documented EMBEDDED template:
      <|begin_of_text|>System: {content}\\n User: {content}\\n Assistant: {content}<|end_of_text|>
  i.e. BOS, then per message "System: ...\\n" / "User: ...\\n" (prompt), and for assistant
  turns the header "Assistant: " (prompt) followed by content + EOS (trained). The
  generation prompt is the rendered prompt followed by "Assistant: ".

Loss mask encoding: a rendered example is ONE int32 array where trained tokens are their id
and prompt tokens are stored as -1 - id. Packing, checkpoints and the loader's document
store carry it unchanged; `data.packing.materialize` decodes inputs (always the id) and
labels (IGNORE_INDEX where the predicted token is a prompt token). So a pair (t[k], t[k+1])
is trained iff t[k+1] is an assistant token: the first assistant token is predicted from the
last prompt token, and the EOS closing each assistant turn is trained (the model learns to
stop).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core import jsonio

ROLES = ("system", "user", "assistant")
# Bad-record reasons specific to SFT records (data.sources.BAD_REASONS are the generic ones).
CHAT_BAD_REASONS = ("not_chat", "unknown_role", "no_assistant", "too_long", "template", "weight")
TEMPLATES = ("auto", "embedded", "hf")
_HEADERS = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


class BadChat(ValueError):
    """A record that cannot be rendered; `reason` is one of CHAT_BAD_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Example:
    """A parsed SFT record: messages and a loss weight (1.0 unless the record gives one)."""

    messages: tuple[dict[str, str], ...]
    weight: float = 1.0


def parse_record(obj: Any) -> Example:
    """A JSON value -> Example, or BadChat naming the reason."""
    if not isinstance(obj, dict):
        raise BadChat("not_chat", "not an object")
    w = obj.get("weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
        raise BadChat("weight", f"weight must be a non-negative number, got {w!r}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadChat("not_chat", "messages must be a non-empty list")
        out = []
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise BadChat("not_chat", "each message needs a string content")
            if m.get("role") not in ROLES:
                raise BadChat("unknown_role", f"role {m.get('role')!r}")
            out.append({"role": m["role"], "content": m["content"]})
    elif isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
        out = [
            {"role": "user", "content": obj["prompt"]},
            {"role": "assistant", "content": obj["completion"]},
        ]
    else:
        raise BadChat("not_chat", "needs 'messages' or string 'prompt' and 'completion'")
    if not any(m["role"] == "assistant" for m in out):
        raise BadChat("no_assistant")
    return Example(tuple(out), float(w))


def encode_masked(ids: Sequence[int], trained: Sequence[bool]) -> np.ndarray:
    """ids + mask -> one int32 array, prompt tokens as -1 - id (see module docstring)."""
    a = np.asarray(ids, dtype=np.int64)
    m = np.asarray(trained, dtype=bool)
    return np.where(m, a, -1 - a).astype(np.int32)


def decode_masked(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained mask) of an encoded example."""
    a = np.asarray(arr, dtype=np.int64)
    return np.where(a < 0, -1 - a, a), a >= 0


# -- renderers: messages -> (segments of (text, trained)) -----------------------------------
Segments = list[tuple[str, bool]]


def embedded_segments(messages: Sequence[dict[str, str]], *, bos: str, eos: str) -> Segments:
    segs: Segments = [(bos, False)]
    for m in messages:
        if m["role"] == "assistant":
            segs.append((_HEADERS["assistant"], False))
            segs.append((m["content"] + eos, True))
        else:
            segs.append((_HEADERS[m["role"]] + m["content"] + "\n", False))
    return segs


def embedded_generation_prompt(messages: Sequence[dict[str, str]], *, bos: str) -> str:
    """The text a generator continues (the embedded template's prompt for the next turn)."""
    return (
        "".join(t for t, _ in embedded_segments(messages, bos=bos, eos="")) + _HEADERS["assistant"]
    )


def hf_segments(render: Callable[..., str], messages: Sequence[dict[str, str]]) -> Segments:
    """Incremental rendering through a Hugging Face chat template (`render(msgs,
    add_generation_prompt=...)` returns text)."""
    segs: Segments = []
    done = ""
    msgs = list(messages)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(msgs[:i], add_generation_prompt=True)
        full = render(msgs[: i + 1], add_generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise BadChat("template", "the chat template does not render prefixes as prefixes")
        segs.append((prompt[len(done) :], False))
        segs.append((full[len(prompt) :], True))
        done = full
    whole = render(msgs, add_generation_prompt=False)
    if not whole.startswith(done):
        raise BadChat("template", "the chat template does not render prefixes as prefixes")
    if len(whole) > len(done):
        segs.append((whole[len(done) :], False))
    return segs


class ChatRenderer:
    """Tokenizer + template -> `render(obj) -> Example + encoded ids`.

    `encode(text) -> ids` must not add BOS/EOS (the templates spell them out as text, and both
    the embedded and Hugging Face tokenizers map those strings to their special ids).
    """

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        *,
        template: str,
        bos: str = "",
        eos: str = "",
        hf_render: Callable[..., str] | None = None,
        max_token_chars: int | None = None,
    ) -> None:
        """`max_token_chars`: the most characters one token can cover (None = unknown): a
        text of n characters then has at least n / max_token_chars tokens, which decides
        "too long" without tokenizing a huge record (`render_line`)."""
        if template not in ("embedded", "hf"):
            raise ValueError(f"template must be 'embedded' or 'hf', got {template!r}")
        if template == "hf" and hf_render is None:
            raise ValueError("template 'hf' needs hf_render")
        self.encode = encode
        self.template = template
        self.bos, self.eos = bos, eos
        self.hf_render = hf_render
        self.max_token_chars = max_token_chars

    def segments(self, messages: Sequence[dict[str, str]]) -> Segments:
        if self.template == "hf":
            assert self.hf_render is not None
            return hf_segments(self.hf_render, messages)
        return embedded_segments(messages, bos=self.bos, eos=self.eos)

    def render(self, ex: Example) -> np.ndarray:
        return self._encode_segments(self.segments(ex.messages))

    def _encode_segments(self, segments: Segments) -> np.ndarray:
        ids: list[int] = []
        mask: list[bool] = []
        for text, trained in segments:
            if not text:
                continue
            t = self.encode(text)
            ids.extend(t)
            mask.extend([trained] * len(t))
        if not any(mask):
            raise BadChat("no_assistant", "assistant turns render to no tokens")
        return encode_masked(ids, mask)

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Token ids of the generation prompt for `messages` (what a generator is given)."""
        if self.template == "hf":
            assert self.hf_render is not None
            return self.encode(self.hf_render(list(messages), add_generation_prompt=True))
        segs = embedded_segments(messages, bos=self.bos, eos=self.eos)
        segs.append((_HEADERS["assistant"], False))
        out: list[int] = []
        for text, _ in segs:
            if text:
                out.extend(self.encode(text))
        return out

    def render_line(
        self, line: str, *, max_tokens: int, truncate: bool
    ) -> tuple[np.ndarray | None, float, str | None]:
        """A JSON line -> (encoded ids, weight, None) or (None, 0, bad reason).

        max_tokens: the longest example that fits a row (seq_len + 1 tokens = seq_len pairs).
        Longer ones are cut to it when `truncate`, else bad ("too_long"); a cut that leaves
        no trained token is bad too.
        """
        try:
            ex = parse_record(jsonio.loads_line(line))
            segs = self.segments(ex.messages)
            cap = self.max_token_chars
            # Each segment is tokenized on its own: at least ceil(chars / cap) tokens each.
            if cap and sum(-(-len(t) // cap) for t, _ in segs) > max_tokens:
                if not truncate:  # decided without tokenizing (a 48 MB record: 12 GiB)
                    return None, 0.0, "too_long"
                segs = cut_segments(segs, max_tokens * cap + CUT_SLACK_CHARS)
            arr = self._encode_segments(segs)
        except BadChat as e:
            return None, 0.0, e.reason
        except ValueError:
            return None, 0.0, "not_chat"
        if len(arr) > max_tokens:
            if not truncate:
                return None, 0.0, "too_long"
            arr = arr[:max_tokens]
            if not (arr[1:] >= 0).any():
                return None, 0.0, "too_long"
        return arr, ex.weight, None


# Characters kept past the cut when truncating a record too long to tokenize whole: the
# first max_tokens tokens of the cut text equal the whole text's unless one pre-token (a
# run of letters without a space) spans the cut.
CUT_SLACK_CHARS = 4096


def cut_segments(segments: Segments, chars: int) -> Segments:
    """The first `chars` characters of the rendered segments (the last one cut)."""
    out: Segments = []
    for text, trained in segments:
        if chars <= 0:
            break
        out.append((text[:chars], trained))
        chars -= len(text)
    return out


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of a `tokenizers.Tokenizer` can cover, when that is a
    bound: byte-level BPE (each vocabulary character is one byte, so a token covers at most
    len(token) characters; special tokens included), with no normalizer or a Unicode
    composition (NFC/NFKC, which join at most 4 characters into 1). None otherwise (other
    pre-tokenizers drop or merge characters: no cheap bound)."""
    pre = json.loads(tokenizer.to_str()).get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in parts if isinstance(p, dict)):
        return None
    norm = tokenizer.normalizer
    factor = 1 if norm is None else 4 if type(norm).__name__ in ("NFC", "NFKC") else 0
    if not factor:
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return factor * max((len(t) for t in vocab), default=1)


def has_chat_template(folder: str | Path) -> bool:
    p = Path(folder)
    if (p / "chat_template.jinja").exists():
        return True
    cfg = p / "tokenizer_config.json"
    if not cfg.exists():
        return False
    try:
        return bool(jsonio.loads(cfg.read_bytes()).get("chat_template"))
    except ValueError:
        return False


def make_renderer(tokenizer_folder: str | Path, template: str = "auto") -> ChatRenderer:
    """The renderer for a tokenizer folder: its own chat template ('hf') where it has one
    (template 'auto'), else the embedded template."""
    from tokenizers import Tokenizer

    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {TEMPLATES}, got {template!r}")
    folder = Path(tokenizer_folder)
    use_hf = template == "hf" or (template == "auto" and has_chat_template(folder))
    if use_hf:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder))

        def hf_render(msgs: list[dict[str, str]], add_generation_prompt: bool) -> str:
            out = hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert isinstance(out, str)
            return out

        def hf_encode(text: str) -> list[int]:
            return list(hf(text, add_special_tokens=False)["input_ids"])

        backend = getattr(hf, "backend_tokenizer", None)  # a fast (tokenizers) tokenizer
        cap = max_token_chars(backend) if backend is not None else None
        return ChatRenderer(hf_encode, template="hf", hf_render=hf_render, max_token_chars=cap)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = jsonio.loads((folder / "tokenizer_config.json").read_bytes())

    def special(name: str) -> str:
        v = cfg.get(name)
        return v["content"] if isinstance(v, dict) else str(v or "")

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False).ids)

    return ChatRenderer(
        encode,
        template="embedded",
        bos=special("bos_token"),
        eos=special("eos_token"),
        max_token_chars=max_token_chars(tok),
    )
