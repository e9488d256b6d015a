"""One rank's training step on fake tensors: titanscale's Trainer built in the rank's world,
AdamW's moments created, one `train_step` (or a post-training update, tools.dryrun.posttrain)
under the trackers (`simulate`)."""

from __future__ import annotations

import time
from typing import Any

from tools.dryrun.fake_world import Boundary, Patches
from tools.dryrun.job import DryRunJob
from tools.dryrun.rank import rank_entry, rank_world
from tools.dryrun.trackers import axis_groups, collective_counter_class, memory_tracker_class


def _trainer_class():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from parallel.mesh import make_parallel_dims
    from runtime.trainer import TitanscaleTrainer

    class DryRunTrainer(TitanscaleTrainer):
        """Training's Trainer; only the process group differs: the fake one is already
        up, and the start-up placement check (an all_gather_object of host names) has
        nothing real to gather."""

        def init_distributed(self):
            import torch.distributed as dist

            with unset_fake_temporarily():
                pd = make_parallel_dims(self.config.parallelism, dist.get_world_size())
                pd.build_mesh()
            return pd

    return DryRunTrainer


def simulate(job: DryRunJob, rank: int, boundary: Boundary) -> dict[str, Any]:
    """One training step of `rank` on fake tensors: its measured memory and collectives."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if job.recipe.adapters:  # not torchtitan's Trainer: posttrain.adapters' own job
        from tools.dryrun.posttrain import simulate_adapters

        return simulate_adapters(job, rank, boundary)
    t0 = time.perf_counter()
    with rank_world(job, rank, boundary) as (cfg, kernels):
        trainer = _trainer_class()(cfg)
        built = time.perf_counter() - t0
        # Steady state: AdamW's moments exist before the step (created at step 1).
        params = [p for m in trainer.model_parts for p in m.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        trainer.optimizers.step()
        # As the step leaves them: freed, or kept and zeroed under CUDA graphs (RL's step
        # layer frees them: StepEngine.optim_step's zero_grad()).
        trainer.optimizers.zero_grad(
            set_to_none=cfg.training.disable_cuda_graphs or job.recipe.rl.enabled
        )
        trainer.metrics_processor.should_log = lambda step: False  # no loss value to log
        trainer.step = 1
        memory = memory_tracker_class()()
        update = None
        if job.recipe.rl.enabled:  # one RL update on the step layer, not train_step
            from tools.dryrun.posttrain import RLUpdate

            update = RLUpdate(job, trainer, cfg)
            memory.track_external(*update.resident())
        memory.track_external(*trainer.model_parts, *trainer.optimizers.optimizers)
        memory.name_modules(trainer.model_parts)
        comms = collective_counter_class()(axis_groups(job.layout, rank, job.recipe.parallel.ep))
        patches = Patches()
        post_backward = FSDPParamGroup.post_backward

        def tagged_post_backward(group, *a):
            out = post_backward(group, *a)
            for fp in group.fsdp_params:  # the reduce-scattered (sharded) gradients
                if fp.sharded_param.grad is not None:
                    memory.tag(fp.sharded_param.grad, "grad")
            return out

        patches.set(FSDPParamGroup, "post_backward", tagged_post_backward)
        posttrain = None
        try:
            if update is not None:
                from tools.dryrun.posttrain import scalar_reads

                scalar_reads(patches)
            with memory, comms:
                if update is None:
                    trainer.train_step(trainer.batch_generator(trainer.dataloader))
                else:
                    posttrain = update.run(memory)
        finally:
            patches.restore()
        # Read before trainer.close(): "after_step" is what the step left allocated.
        after, peak = memory.figures("current"), memory.figures("peak")
        sched = getattr(trainer, "pp_schedule", None)
        held = getattr(sched, "_stages", None) or [getattr(sched, "_stage", None)]
        stages = sorted(s.stage_index for s in held if s is not None) if sched else [0]
        trainer.close()
    return rank_entry(job, rank, job.pp_rank(rank), stages, kernels, (peak, after),
                      memory.peak_where, comms, posttrain, built, t0)  # fmt: skip
