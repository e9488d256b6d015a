"""Attributes of an object as a torchtitan Stateful, for a loop's checkpoint.

torchtitan's checkpoint manager saves objects with `state_dict` / `load_state_dict`; the
post-training loops keep their counters and data-stream positions as plain attributes.
`Attrs` exposes some of them (a data stream's own state dict as JSON) without the loop
classes implementing the protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Attrs:
    """Some attributes of an object as a Stateful (a loop's counters in its checkpoint);
    `json_of`: an attribute holding an object whose own state dict is stored as JSON (a data
    stream's position); `on_load` runs after a load."""

    def __init__(
        self, obj: Any, *names: str, json_of: str = "", on_load: Callable[[], None] | None = None
    ) -> None:
        self.obj, self.names, self.json_of, self.on_load = obj, names, json_of, on_load

    def state_dict(self) -> dict[str, Any]:
        import json

        from data.loader import _plain  # the loader's JSON encoding of its own state

        sd = {n: getattr(self.obj, n) for n in self.names}
        if self.json_of:
            state = getattr(self.obj, self.json_of).state_dict()
            sd["json"] = json.dumps(state, default=_plain)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        import json

        for n in self.names:
            setattr(self.obj, n, sd[n])
        if self.json_of:
            getattr(self.obj, self.json_of).load_state_dict(json.loads(sd["json"]))
        if self.on_load is not None:
            self.on_load()
