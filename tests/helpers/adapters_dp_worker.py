"""torchrun worker (gloo, CPU) for test_adapters_multiproc: [[adapters]] on 2 processes.

    torchrun --nproc_per_node=2 tests/helpers/adapters_dp_worker.py RECIPE OUT

In one process group: train.py's own entry (train.main) with both adapters, batched; then,
through posttrain.jobs.adapter_job, both adapters taking turns, `a` alone and `b` alone, each
time comparing the full (all-gathered) base before and after training. Rank 0 writes
OUT/<run>/base_unchanged.json; the adapters' final weights are in their checkpoints.
"""

import copy
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import train  # noqa: E402
from posttrain import jobs  # noqa: E402
from posttrain.lora import base_state  # noqa: E402
from runtime import session  # noqa: E402

recipe, out = sys.argv[1], sys.argv[2]
dist.init_process_group(backend="gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
# The user's path: train.py under torchrun (the process group above is reused).
train.main(["--recipe", recipe, "--set", f"job.output_dir={out}/batched-a-b",
            "--set", "finetune.adapter_schedule=batched"])  # fmt: skip
job = session.prepare(recipe, [])
for names in (["a", "b"], ["a"], ["b"]):
    j = copy.deepcopy(job)
    j.recipe.adapters = [a for a in j.recipe.adapters if a.name in names]
    j.recipe.job.output_dir = f"{out}/turns-{'-'.join(names)}"
    aj = jobs.adapter_job(j, mesh)
    before = base_state(aj.model)
    aj.train(export=False)
    after = base_state(aj.model)
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    sharded = sum(hasattr(p, "full_tensor") for p in aj.model.parameters())
    if dist.get_rank() == 0:
        with open(f"{out}/turns-{'-'.join(names)}/base_unchanged.json", "w") as f:
            json.dump({"base_unchanged": same, "keys": len(before), "sharded_params": sharded}, f)
# Checkpoints: `a` stopped after 2 of its 4 steps (saved by rank 0), then a new job resumes
# from that checkpoint on both ranks and finishes (compared with turns-a in the test).
j = copy.deepcopy(job)
j.recipe.adapters = [a for a in j.recipe.adapters if a.name == "a"]
j.recipe.job.output_dir = f"{out}/resumed-a"
aj = jobs.adapter_job(j, mesh)
for _ in range(2):
    aj._step_turns(aj.adapters)
    aj.adapters[0].step += 1
aj.save(aj.adapters[0])
dist.barrier()  # rank 0's file is written before any rank looks for it
jobs.adapter_job(j, mesh).train(export=False)
dist.barrier()
dist.destroy_process_group()

from tools.cli import exit_process  # noqa: E402

exit_process(0)  # past gloo's worker threads (its docstring says why)
