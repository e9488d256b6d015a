"""Resident memory admitted: what stays on the device between requests (each model's adapter
with its gradients and AdamW moments, each sampler's weight snapshot) is priced when it is
created and refused when the total would pass the service's resident budget, before the
allocator fails (the 77th rank-128 adapter of the round-III probe died inside it).

Prices come from the backend (`Backend.adapter_bytes(spec)`: the adapter's weights; a
trained model holds 4 copies: weights, gradients, AdamW's two moments; a sampler snapshot
one). The budget is `tools.serve --max-resident-gib` (default: the half of the memory
available at start that the per-request budget leaves). When full: 429 naming the budget
and what the tenant holds (it fits again once a session finishes); a single object larger
than the whole budget: 413. Nothing is paged out to host or disk (not done).
"""

from __future__ import annotations

import threading

from service.errors import ServiceError

GIB = 1 << 30
TRAINED_COPIES = 4  # weights, gradients, exp_avg, exp_avg_sq (float32 each)


class ResidentLedger:
    def __init__(self, budget_bytes: float | None):
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, int]] = {}  # key -> (tenant, bytes)

    def total(self) -> int:
        with self._lock:
            return sum(b for _, b in self._held.values())

    def admit(self, key: str, tenant: str, nbytes: int, what: str) -> None:
        """Hold `nbytes` for `key` (again for a key already held: nothing), or refuse."""
        if self.budget is None:
            return
        with self._lock:
            if key in self._held:
                return
            if nbytes > self.budget:
                raise ServiceError(
                    413,
                    f"{what} needs {nbytes / GIB:.3f} GiB resident; this service holds at most "
                    f"{self.budget / GIB:.3f} GiB of adapters and snapshots "
                    "(tools.serve --max-resident-gib)",
                )
            used = sum(b for _, b in self._held.values())
            if used + nbytes > self.budget:
                mine = sum(b for t, b in self._held.values() if t == tenant)
                raise ServiceError(
                    429,
                    f"{what} needs {nbytes / GIB:.3f} GiB resident and {used / GIB:.3f} of "
                    f"{self.budget / GIB:.3f} GiB are held (this tenant: {mine / GIB:.3f}; "
                    "tools.serve --max-resident-gib); finish a session to free some",
                    retry_after=30,
                )
            self._held[key] = (tenant, nbytes)

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)
