"""The post-training token budget: the microbatch size a job steps with on this device.

`choose_microbatch_tokens`: training.microbatch_tokens, or the largest budget the memory
model (parallel.memory) fits into the device's memory (runtime.platform
.device_memory_bytes); a job that does not fit is one line before any process group.
"""

from __future__ import annotations

from typing import Any

from core.errors import ConfigError


def choose_microbatch_tokens(recipe: Any, layout: Any, platform: Any) -> int:
    """The job's token budget: training.microbatch_tokens, or the largest that fits this
    device by the memory model (parallel.memory: the trainer's states and one microbatch,
    the generator's copies and KV cache; on CPU the dense attention's scores). ConfigError
    (before any process group) when the job does not fit, saying what it needs. `layout`
    None: one process. (The service's budget is its resource plan's: parallel/serve.py.)"""
    from dataclasses import replace

    import runtime.platform as platforms
    from core.axes import Layout
    from parallel.memory import fit_microbatch_tokens, posttrain_load, posttrain_memory
    from parallel.workload import workload_from_recipe

    pt = posttrain_load(recipe)
    assert pt is not None, "a post-training recipe (rl or [[adapters]])"
    if platform.is_cpu:
        pt = replace(pt, dense_attention_len=recipe.training.seq_len)
    w = workload_from_recipe(recipe, layout or Layout())
    device, kind = platforms.device_memory_bytes(platform)  # late bound: tests fake it
    chosen = recipe.training.microbatch_tokens
    tokens = chosen or fit_microbatch_tokens(w, pt, device, kind)
    est = posttrain_memory(w, replace(pt, microbatch_tokens=tokens or pt.microbatch_tokens))
    if tokens and est.required_gib_on(kind) * 2**30 <= device:
        return tokens
    what = "this GPU" if kind != "cpu" else "this machine's share per process"
    hint = (
        "lower training.microbatch_tokens"
        if chosen
        else "use more GPUs (FSDP shards the states), a smaller model"
        + (" or a bfloat16 generator (rl.generator_dtype)" if recipe.rl.enabled else "")
    )
    raise ConfigError(
        f"the job needs {est.describe(kind)}; {what} has {device / 2**30:.1f} GiB: {hint}",
        file=recipe.source,
        key="training.microbatch_tokens" if chosen else "model.flavor",
    )
