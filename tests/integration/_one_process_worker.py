"""One process, two ways: train.py's Trainer as built (FSDP2 skipped: runtime.build
`unsharded_when_alone`) and the same Trainer with FSDP2 forced back on (torchtitan's
parallelize function unchanged), from the same seed checkpoint on the same tokens.

    python tests/integration/_one_process_worker.py WORKDIR SEED MODE [override ...]

MODE "plain" or "fsdp". Prints one `RESULT {json}` line: the parameter types after
parallelization, the trainable parameter names, and the per-step loss and grad norm from
metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    work, seed, mode, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    import torch
    from torch.distributed.tensor import DTensor

    import runtime.build
    from runtime import session
    from runtime.trainer import TitanscaleTrainer

    if mode == "fsdp":
        # The old behaviour: FSDP2 applied even though it is the identity here.
        runtime.build.fsdp_is_identity = lambda *a, **k: False  # type: ignore[assignment]
    overrides = [
        f"job.output_dir={work}",
        f"checkpoint.load_from={seed}",
        "training.seq_len=128",
        "training.steps=5",
        "metrics.tensorboard=false",
        "metrics.summary_skip_steps=1",
        *extra,
    ]
    job = session.prepare(None, overrides)
    job.platform.apply()
    trainer = TitanscaleTrainer(job.config)
    try:
        params = list(trainer.model_parts[0].named_parameters())
        kinds = sorted(
            {"DTensor" if isinstance(p, DTensor) else type(p).__name__ for _, p in params}
        )
        trainable = sorted(n for n, p in params if p.requires_grad)
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    steps = {}
    for line in (work / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "event" not in rec:
            steps[rec["step"]] = (rec["loss"], rec["grad_norm"])
    print("RESULT " + json.dumps({"kinds": kinds, "trainable": trainable, "steps": steps}))


if __name__ == "__main__":
    main()
