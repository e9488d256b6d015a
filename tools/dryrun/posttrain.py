"""The dry run of one post-training update on the step layer: an RL update, an [[adapters]] round.

tools.dryrun's path for `rl.enabled` and `[[adapters]]` recipes (docs/dryrun.md). RL:
tools.dryrun builds the policy as RL training builds it (torchtitan's Trainer: model, FSDP2,
AdamW) on fake tensors at the job's world size; `RLUpdate` then steps what one update of
rl/loop.py allocates on the trainer's device, with the loop's own objects:

- the generator side (rl.generator = "native"): rl.loop.native_generator's copies (one;
  async adds the probe), built before the step and counted as resident; a KL reference
  (kl_coef > 0) as rl.loop.attach_reference builds it (a fresh float32 copy);
- **push**: the new weights gathered (rl.policy.full_state_dict) and staged on the
  generator (loaded at once into the async probe), as RLRun.push_weights;
- **generation**: one chunk of prompts, as RLRun.generate splits them under the token
  budget (prompts of seq_len - max_new_tokens tokens), through the generator's own prefill
  (its KV cache at full size: prompt + max_new_tokens slots), the sample rows' cache copies
  and two decode steps (later tokens add no memory: the cache is allocated at the prefill);
- **update**: rollouts of seq_len tokens collated by rl.trainer.collate and trained by
  rl.trainer.PolicyTrainer on runtime.steps.StepEngine with the recipe's loss (a custom
  loss: grpo's shape), the path RLRun.train_on takes (rl.loop.on_policy: one forward per
  microbatch; otherwise the pi_old scoring pass, the reference's logprobs, then the
  training pass), then StepEngine.optim_step (clipping, AdamW, the schedule).

sync RL runs these one after another; async overlaps them (the generator thread decodes
while the trainer trains and pushes), so the update runs while the generation's caches and
the staged weights are live (the generator's per-token hook, `Generator.on_token`).

Values are fake: a scalar read (`float(loss)`, `bool(bad.any())`) gives 0 / False, the
finite, nothing-wrong branch (`scalar_reads`). rl.generator = "vllm": the engine is its own
process with its own memory (vLLM's gpu_memory_utilization), not on this device: only the
push's gathered weights are stepped here.

[[adapters]] (`simulate_adapters`): posttrain.adapters.AdapterJob's own frozen base and
per-adapter engines (no data, checkpoints or metrics), then one round of its schedule.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from parallel.memory import GIB
from tools.dryrun.fake_world import Patches
from tools.dryrun.rank import rank_entry, rank_world
from tools.dryrun.trackers import axis_groups, collective_counter_class, memory_tracker_class

# Microbatches of the update stepped: each holds the same (the step layer's budget); the
# update's (B, L) float32 logprob matrices are the only thing that grows with the rest.
MICROBATCHES = 2


def scalar_reads(patches: Any) -> None:
    """Fake tensors refuse reads of their values (`float(loss)`, `bool(bad.any())`,
    `.tolist()`); the step layer reads a few (the non-finite guard, the gradient norm, the
    sampled tokens). Inside the dry run each such read gives 0 (False, 0.0): every guard
    takes its finite branch. Constant tensors (the batch) keep their real values."""
    import torch
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import DataDependentOutputException

    op = torch.ops.aten._local_scalar_dense.default
    real = fake_impls.op_implementations_dict[op]

    def local_scalar_dense(mode: Any, func: Any, arg: Any) -> Any:
        try:
            return real(mode, func, arg)
        except DataDependentOutputException:
            if arg.dtype.is_floating_point:
                return 0.0
            return False if arg.dtype == torch.bool else 0

    patches.set_item(fake_impls.op_implementations_dict, op, local_scalar_dense)


def _chunk_prompts(rl: Any, seq_len: int, budget: int, max_batch: int) -> tuple[int, int]:
    """(prompts of the generation chunk the loop runs, their length): RLRun.generate splits
    prompts_per_step prompts of `prompt + max_new_tokens` slots under budget // group_size
    (runtime.rows.split_rows); the generator prefills at most max_batch // n of them."""
    from runtime.rows import split_rows

    prompt = max(1, seq_len - rl.max_new_tokens)
    slots = prompt + rl.max_new_tokens
    lo, hi = split_rows([slots] * rl.prompts_per_step, max(budget // rl.group_size, 1))[0]
    return min(hi - lo, max(1, max_batch // rl.group_size)), prompt


class RLUpdate:
    """What one RL update allocates on the trainer's device, stepped on fake tensors."""

    def __init__(self, job: Any, trainer: Any, config: Any) -> None:
        import torch

        from rl.loop import fresh_model, native_generator

        self.job, self.trainer = job, trainer
        self.rl = rl = job.recipe.rl
        self.model = trainer.model_parts[0]
        device = torch.device("cpu")  # the dry run's fake device type (tools.dryrun)
        n = (1 + (rl.mode == "async")) if rl.generator == "native" else 0
        self.generators = [native_generator(config, device, rl, 0) for _ in range(n)]
        self.reference = None
        if rl.kl_coef > 0:
            self.reference = fresh_model(config, device).eval().requires_grad_(False)
        self.notes: list[str] = []

    def resident(self) -> list[Any]:
        """Modules that live through the update (counted from the start)."""
        mods = [g.model for g in self.generators]
        return mods + ([self.reference] if self.reference is not None else [])

    def resident_gib(self) -> dict[str, float]:
        def size(m: Any) -> float:
            return sum(p.numel() * p.element_size() for p in m.parameters()) / GIB

        return {
            "generator_copies": sum(size(g.model) for g in self.generators),
            "reference_copy": size(self.reference) if self.reference is not None else 0.0,
        }

    def run(self, memory: Any) -> dict[str, Any]:
        """push -> generation -> update (sync), or the update inside the generation with
        the staged weights live (async); each phase's peak in `memory.phases`."""
        from rl.loop import push_like
        from rl.policy import full_state_dict

        rl = self.rl
        memory.end_phase("start")  # what the update starts from: states, copies
        gen = self.generators[0] if self.generators else None
        sd = full_state_dict(self.model, like=push_like(gen))
        if gen is not None:
            gen.stage_weights(sd, 1)
            for probe in self.generators[1:]:
                probe.update_weights(sd, 1)
        else:
            self.notes.append(
                "rl.generator = vllm: the engine is its own process (its weights and KV "
                "cache are vLLM's, gpu_memory_utilization), not on the trainer's device"
            )
        del sd
        memory.end_phase("push")
        if gen is None:
            self.update()
            memory.end_phase("update")
        elif rl.mode == "async":
            # The generator thread decodes (its caches live, the staged weights not yet
            # applied) while the trainer trains: the update runs inside the generation.
            self.generate(gen, apply=False, during=self.update)
            memory.end_phase("generation + update (async: overlapped)")
        else:
            self.generate(gen, apply=True)
            memory.end_phase("generation")
            self.update()
            memory.end_phase("update")
        live = memory.live_after
        return {
            "phases_gib": {k: round(v, 3) for k, v in memory.phases.items() if k != "start"},
            # the gathered weights the generator holds until its next generation applies them
            "staged_weights_gib": round(live["push"] - live["start"], 3),
            "resident_gib": {k: round(v, 3) for k, v in self.resident_gib().items()},
            "notes": self.notes,
        }

    def generate(self, gen: Any, *, apply: bool, during: Any = None) -> None:
        """One chunk of RLRun.generate through the generator's own prefill and decode."""
        import torch

        from rl.generator import SamplingParams, _forward_cached

        rl, tr = self.rl, self.job.recipe.training
        k, prompt = _chunk_prompts(rl, tr.seq_len, self.job.microbatch_tokens, gen.max_batch)
        if apply:
            gen._apply_pending()  # sync: the staged weights are loaded, then dropped
        seqs = [[1] * prompt for _ in range(k)]
        tokens, positions, lens, key_ok, cache = gen._prefill_inputs(
            seqs, prompt + rl.max_new_tokens
        )
        logits = _forward_cached(gen.model, tokens, positions, cache, 0, key_ok, gather=gen.gather)
        fired: list[int] = []

        def on_token() -> None:
            if during is not None and not fired:
                fired.append(1)
                during()

        gen.on_token = on_token
        params = SamplingParams(max_tokens=min(2, rl.max_new_tokens), n=rl.group_size)
        try:
            gen._decode_rows(list(range(k)), seqs, cache, logits, lens, key_ok, prompt, params,
                             torch.Generator(), 1, None)  # fmt: skip
        finally:
            gen.on_token = None
        self.notes.append(
            f"generation: {k} prompt(s) x {rl.group_size} samples of {prompt} + "
            f"{rl.max_new_tokens} tokens (one chunk under the budget), prefill and "
            f"{params.max_tokens} decode step(s)"
        )

    def update(self) -> None:
        """One update of RLRun.train_on on MICROBATCHES microbatches of full-length rows."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from rl.loop import loss_config, on_policy
        from rl.losses import BUILTIN_LOSSES, get_loss
        from rl.trainer import PolicyTrainer, Rollout, collate
        from runtime.rows import split_rows

        rl, tr = self.rl, self.job.recipe.training
        budget = self.job.microbatch_tokens
        loss_name = rl.loss if rl.loss in BUILTIN_LOSSES else "grpo"
        if loss_name != rl.loss:
            self.notes.append(f"rl.loss = {rl.loss}: stepped with grpo's (same tensors)")
        # dp_group None: the microbatch count's one-integer all-reduce is not run (a value
        # read on fake tensors); every rank runs the same count anyway here.
        policy = PolicyTrainer(self.model, self.trainer.optimizers, self.trainer.lr_schedulers,
                               pad_id=0, reference=self.reference, microbatch_tokens=budget,
                               max_norm=tr.max_norm, temperature=rl.temperature,
                               microbatch_rows=tr.local_batch_size,
                               routing_replay=rl.routing_replay)  # fmt: skip
        total = rl.prompts_per_step * rl.group_size
        per = split_rows([tr.seq_len] * total, budget, tr.local_batch_size)[0][1]
        rows = min(total, MICROBATCHES * per)
        prompt = max(1, tr.seq_len - rl.max_new_tokens)
        done = tr.seq_len - prompt
        rollouts = [Rollout([1] * prompt, [2] * done, [-1.0] * done, advantage=1.0)
                    for _ in range(rows)]  # fmt: skip
        loss_fn = get_loss(loss_name, loss_config(rl))
        with unset_fake_temporarily():  # every rollout at lag 0 (real values: the rule reads them)
            fast = on_policy(replace(rl, loss=loss_name), len(self.generators) > 1,
                             torch.zeros(rows))  # fmt: skip
        if fast:
            c = collate(rollouts, 0, policy.device)
            policy.forward_backward_on_policy(c, loss_fn)
            path = "one forward per microbatch (on-policy)"
        else:
            c, old = policy.score(rollouts)
            batch = policy.loss_batch(c, old)  # the reference's logprobs when kl_coef > 0
            policy.forward_backward(c, batch, loss_fn, logprobs=old)
            path = "scoring pass" + (", reference logprobs" if self.reference else "")
            path += ", training pass"
        policy.optim_step()
        self.notes.append(
            f"update: {rows} of the update's {total} rollouts ({-(-rows // per)} of "
            f"{-(-total // per)} microbatches of {per} row(s); each holds the same), {path}, "
            "optimizer step"
        )


# ------------------------------------------------------------------------------------------
# [[adapters]]: one round of posttrain.adapters.AdapterJob on fake tensors


def _synthetic_batches(rows: int, seq_len: int) -> Any:
    """An adapter's data stream as AdapterJob's `_batches` yields it: (inputs, positions,
    labels), [rows, seq_len] int64, every label trained, as constant fake tensors."""
    import torch
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mode = active_fake_mode()
    assert mode is not None, "the dry run's batches are made under FakeTensorMode"
    while True:
        with unset_fake_temporarily():
            real = (torch.ones(rows, seq_len, dtype=torch.int64),
                    torch.arange(seq_len).repeat(rows, 1),
                    torch.ones(rows, seq_len, dtype=torch.int64))  # fmt: skip
        yield tuple(
            mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True) for t in real
        )


def adapter_job(job: Any, config: Any) -> Any:
    """posttrain.adapters.AdapterJob's base and adapters as the job builds them (its own
    `_init_base` and `_adapter_engine`), without data, checkpoints or metrics; AdamW's moments
    created (steady state)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh

    from posttrain.adapters import AdapterJob, AdapterState

    recipe, tr = job.recipe, job.recipe.training
    mesh = None
    if job.world_size > 1:
        with unset_fake_temporarily():  # rank coordinates are real tensors
            mesh = init_device_mesh("cpu", (job.world_size,), mesh_dim_names=("dp_shard",))
    aj = AdapterJob.__new__(AdapterJob)
    aj._init_base(recipe, config.model_spec.model, device="cpu",
                  schedule=recipe.finetune.adapter_schedule, mesh=mesh,
                  microbatch_tokens=job.microbatch_tokens, load=False)  # fmt: skip
    aj.adapters = []
    for spec in recipe.adapters:
        weights, opt, sched, engine = aj._adapter_engine(spec)
        for p in weights.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        rows = spec.local_batch_size or tr.local_batch_size
        aj.adapters.append(AdapterState(spec, weights, engine, None, None,
                                        _synthetic_batches(rows, tr.seq_len), rows))  # fmt: skip
    return aj


def simulate_adapters(job: Any, rank: int, boundary: Any) -> dict[str, Any]:
    """One round of every adapter (finetune.adapter_schedule: "turns" or "batched") on the
    frozen base, as AdapterJob.train runs it: tools.dryrun.simulate's entry for the rank."""
    import time

    t0 = time.perf_counter()
    with rank_world(job, rank, boundary) as (cfg, kernels):
        aj = adapter_job(job, cfg)
        built = time.perf_counter() - t0
        memory = memory_tracker_class()()
        opts = [o for a in aj.adapters for o in a.engine.optimizers.optimizers]
        memory.track_external(aj.model, *[a.weights for a in aj.adapters], *opts)
        memory.name_modules([aj.model])
        comms = collective_counter_class()(axis_groups(job.layout, rank))
        patches = Patches()
        scalar_reads(patches)
        try:
            with memory, comms:
                memory.end_phase("start")
                step = aj._step_turns if aj.schedule == "turns" else aj._step_batched
                step(list(aj.adapters))
                memory.end_phase(f"round ({aj.schedule}, {len(aj.adapters)} adapters)")
        finally:
            patches.restore()
        figures = memory.figures("peak"), memory.figures("current")
        size = sum(p.numel() * p.element_size() for a in aj.adapters for p in a.params.values())
    rows = [a.batch_size for a in aj.adapters]
    posttrain = {
        "phases_gib": {k: round(v, 3) for k, v in memory.phases.items() if k != "start"},
        "resident_gib": {"adapters": round(size / GIB, 3)},
        "notes": [
            f"[[adapters]]: one {aj.schedule} round of {len(rows)} adapters ({rows} rows "
            f"of {job.recipe.training.seq_len} tokens) on the frozen base, "
            f"{aj.microbatch_tokens:,}-token microbatches (posttrain.adapters.AdapterJob)"
        ],
    }
    return rank_entry(
        job, rank, 0, [0], kernels, figures, memory.peak_where, comms, posttrain, built, t0
    )
