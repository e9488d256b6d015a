"""One rank of a torchft replica group (tests/integration/test_torchft_gloo.py).

Run under torchrun (one torchrun per group) with REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE and
FT_OUT set. A 16 x 16 linear model learns a fixed target map; the group's ranks average
their gradients over the group's gloo process group, and torchft's Manager averages them
across the live groups and commits the step only if every participant succeeded. Sample
`(step, group, rank)` is the one batch that position of the global stream holds. Each step
appends {step, participants, participating, committed, loss} to FT_OUT/g{group}_r{rank}.jsonl; the run stops at the
step written in FT_OUT/stop (the test writes it once both groups train together again) and
saves the weights to FT_OUT/final_g{group}_r{rank}.pt.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

DIM = 16
BATCH = 8


def target() -> torch.Tensor:
    return torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(7))


def batch(step: int, group: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + 1009 * group + rank)
    x = torch.randn(BATCH, DIM, generator=g)
    # Noisy targets: the loss levels off at the noise (0.25), not at 0, so two runs' final
    # losses can be compared relatively.
    return x, x @ target().T + 0.5 * torch.randn(BATCH, DIM, generator=g)


def init_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, DIM)


def main() -> None:
    from torchft import Manager, ProcessGroupGloo

    group = int(os.environ["REPLICA_GROUP_ID"])
    out = Path(os.environ["FT_OUT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # torchrun starts each rank in its own session: the test kills ranks by these pids.
    (out / f"pid_g{group}_r{rank}").write_text(str(os.getpid()))
    model = init_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    mgr = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=1,
        load_state_dict=load,
        state_dict=state,
        replica_id=f"group{group}",
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=60),
    )
    log = open(out / f"g{group}_r{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    stop_file = out / "stop"
    while True:
        stop = int(stop_file.read_text()) if stop_file.exists() else None
        if stop is not None and mgr.current_step() >= stop:
            break
        mgr.start_quorum()  # heals this group from a live one when it is behind
        mgr.wait_quorum()  # current_step is the quorum's (a healed group's jumps ahead)
        step = mgr.current_step()
        x, y = batch(step, group, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)  # inside the group
            mgr.allreduce(p.grad).wait()  # across live groups (average over participants)
        committed = mgr.should_commit()
        if committed:
            opt.step()
        # `participating`: False while this group heals (its gradients are zeroed: the step
        # is the other group's), which the test's replay needs to know who trained a step.
        log.write(json.dumps({"step": step, "participants": mgr.num_participants(),
                              "participating": mgr.is_participating(),
                              "committed": committed, "loss": float(loss)}) + "\n")  # fmt: skip
        time.sleep(0.2)  # keep the run long enough to kill and restart a group
    torch.save(model.state_dict(), out / f"final_g{group}_r{rank}.pt")
    mgr.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script
    from tools.cli import run  # exits past gloo's worker threads (tools.cli.exit_process)

    run(main)
