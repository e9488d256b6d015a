"""Two gloo ranks running service.distributed's dispatcher over a fake backend (no model):
rank 0 prints one JSON line of what each call did. Run under torch.distributed.run."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from service.distributed import Dispatcher, Group, RankInfo, follow  # noqa: E402
from service.errors import ServiceError  # noqa: E402

SLOW_S = float(os.environ.get("SLOW_S", "6"))


class Fake:
    def __init__(self, rank: int):
        self.rank = rank

    def echo(self, x):
        return x

    def refuse(self):
        raise ServiceError(400, "x: refused the same way on every rank")

    def slow(self):
        if self.rank == 1:
            time.sleep(SLOW_S)  # a rank far slower than the deadline
        return 1


def main() -> int:
    group = Group.start(backend="gloo", device_type="cpu", timeout_s=60)
    backend = Fake(group.rank)
    if group.rank:
        return follow(group, backend)
    ranks = [RankInfo(r, 0, "", 0, 0, 0, 0) for r in range(group.world)]
    d = Dispatcher(group, backend, ranks, op_timeout_s=float(os.environ["OP_TIMEOUT_S"]))
    out = {}
    for name, args in (
        ("echo", (5,)),
        ("refuse", ()),
        ("echo", (6,)),
        ("slow", ()),
        ("echo", (7,)),
    ):
        t0 = time.monotonic()
        try:
            out[f"{name}{args}"] = {"value": d.call(name, *args)}
        except ServiceError as e:
            out[f"{name}{args}"] = {
                "error": e.message,
                "status": e.status,
                "type": type(e).__name__,
            }
        out[f"{name}{args}"]["s"] = round(time.monotonic() - t0, 2)
    out["broken"] = d.broken
    print(json.dumps(out), flush=True)
    os._exit(0)  # the group is broken: a slow rank still holds it


if __name__ == "__main__":
    sys.exit(main())
