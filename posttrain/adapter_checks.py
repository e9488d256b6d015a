"""Resuming an adapter from its checkpoint: the saved adapter must be the recipe's (pure).

`posttrain.adapters.AdapterJob.resume` loads the DCP checkpoint
`<output_dir>/adapters/<name>/step-N` into the adapter the recipe describes. A recipe changed
since (another `lora.rank`, other `lora.target_modules`, the adapters' sources swapped,
another `seq_len`) used to end in a
tensor-copy or optimizer traceback, or in the data position's ValueError. `resume_problem`
compares what the checkpoint holds with what the recipe builds, from plain data only (names,
shapes, the data position's fingerprint), and returns the one line to print (and the key
it is addressed to), or None when the resume is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Data-position fingerprint fields (data.loader.PackedStream.fingerprint) -> recipe keys.
FINGERPRINT_KEYS = {
    "seq_len": "training.seq_len",
    "packing": "data.packing",
    "window": "data.window",
    "vocab_size": "model.tokenizer",
    "format": "data.chat_template",
    "text_field": "data.text_field",
}


def _rank_of(shapes: Mapping[str, Sequence[int]]) -> int | None:
    for k, s in shapes.items():
        if k.endswith("lora_a.weight") and len(s) == 2:
            return int(s[0])
    return None


def resume_problem(
    *,
    adapter: str,
    index: int,
    checkpoint: str,
    saved_shapes: Mapping[str, Sequence[int]],
    shapes: Mapping[str, Sequence[int]],
    saved_data: Mapping[str, Any],
    data: Mapping[str, Any],
) -> tuple[str, str] | None:
    """(key, message) when the checkpoint at `checkpoint` (adapter tensors `saved_shapes`,
    data-position fingerprint `saved_data`) is not the adapter the recipe builds (`shapes`,
    `data`); None when it resumes exactly."""
    where = f"the checkpoint {checkpoint} of adapter {adapter!r}"
    old_rank, new_rank = _rank_of(saved_shapes), _rank_of(shapes)
    if old_rank is not None and new_rank is not None and old_rank != new_rank:
        return "lora.rank", (
            f"{where} was trained with lora.rank = {old_rank}, the recipe has {new_rank}; "
            "keep the rank to resume, or train into a new job.output_dir"
        )
    missing, extra = (
        sorted(set(shapes) - set(saved_shapes)),
        sorted(set(saved_shapes) - set(shapes)),
    )
    if missing or extra:
        return "lora.target_modules", (
            f"{where} adapts other layers than the recipe ("
            + "; ".join(
                f"{what}: {len(names)} ({names[0]}{', ...' if len(names) > 1 else ''})"
                for what, names in (("not in the checkpoint", missing), ("only there", extra))
                if names
            )
            + "); keep lora.target_modules to resume"
        )
    for k, s in shapes.items():
        if tuple(saved_shapes[k]) != tuple(s):
            return "model.flavor", (
                f"{where}: {k} is {list(saved_shapes[k])} there, the model expects {list(s)}"
            )
    if saved_data.get("source") != data.get("source"):
        return f"adapters[{index}].source", (
            f"{where} was trained on {saved_data.get('source')!r}, adapters[{index}].source is "
            f"now {data.get('source')!r} (sources swapped or changed?); resuming would mix "
            "another dataset's position into it"
        )
    for field, key in FINGERPRINT_KEYS.items():
        if saved_data.get(field) != data.get(field):
            return key, (
                f"{where} was trained with {field} {saved_data.get(field)!r}, the recipe gives "
                f"{data.get(field)!r}; resume with the same data settings"
            )
    return None
