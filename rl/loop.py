"""An RL run from a recipe: torchtitan's trainer + our generator + an environment + a loss.

`check(job)` validates what only RL needs (callables, backend, refused keys, memory on this
device) before any process group; `run(job)` trains: the TitanscaleTrainer's model, FSDP,
optimizer, schedule, checkpoints and metrics, each update on the post-training step layer
(runtime.steps, docs/steps.md) under its guard; rollouts replace the data loader.

Weight versions: version v = the weights after v RL updates. A batch trained at update s
(1-based) was sampled by version v <= s - 1; policy_lag = s - 1 - v. `sync` samples with
version s - 1 (lag 0) and the trainer waits for the whole generation; `async` runs the
generator in a thread that samples batch s as soon as version >= s - 1 - max_policy_lag is
available, so generation overlaps training. Off-policy correction: the losses' ratio is taken
against the trainer's own recomputation pi_old, and tis_cap (or dppo) weights each token by
pi_old / mu, truncated.

Failures (docs/rl.md): a raising generation or reward is counted and its group skipped, or
(on_error = "fail") the last completed update is checkpointed and the run stops.

Multi-turn environments (rl.envs.MultiTurnEnv, e.g. rl.env = "chain_sum"): each group is
group_size episodes of one task (rl.multiturn.run_episodes, either generator), each episode
one rollout whose trained tokens are the model's turns only (Rollout.completion_mask); the
reward is the episode's, the advantages per group as for single turns.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from core.errors import ConfigError
from rl.envs import Task, load_callable, make_env
from rl.generator import Generator, SamplingParams
from rl.hooks import GuardedEnv, check_env, load_loss
from rl.losses import BUILTIN_LOSSES, LossConfig, LossFn, get_loss, group_advantages
from rl.mismatch import mismatch_stats
from rl.multiturn import Episode, reference_episode, run_episodes
from rl.policy import full_state_dict
from rl.trainer import PolicyTrainer, Rollout, collate
from rl.vllm_engine import EngineError
from runtime import steps
from runtime.budget import choose_microbatch_tokens
from runtime.build import recipe_optimizer
from runtime.rank_mean import mean_over_ranks
from runtime.rows import split_rows
from runtime.step_guard import StepGuard


def check(job: Any) -> None:
    """RL-only checks before any process group; ConfigError names the key."""
    rl, f = job.recipe.rl, job.recipe.source
    for key in ("env", "reward", "custom_loss"):
        spec = getattr(rl, key)
        if key == "custom_loss" and rl.loss != "custom":
            continue
        if spec and (key != "env" or ":" in spec):
            try:
                load_callable(spec)
            except ValueError as e:
                raise ConfigError(str(e), file=f, key=f"rl.{key}") from None
    # The factory, tasks() and one reward, behind the hook guard (rl.hooks): one line.
    check_env(rl, file=f)
    from rl.vllm_engine import require_engine, resolve_sync

    platform = getattr(job, "platform", None)  # (a bare namespace in some tests: this host)
    cuda = torch.cuda.is_available() if platform is None else not platform.is_cpu
    resolve_sync(rl, cuda=cuda, world_size=int(getattr(job, "world_size", 1)), file=f)
    if rl.generator == "vllm":
        require_engine(file=f, key="rl.generator")


def loss_config(rl: Any) -> LossConfig:
    """The built-in losses' settings from the recipe's [rl] section."""
    return LossConfig(
        clip_low=rl.clip_low, clip_high=rl.clip_high, kl_coef=rl.kl_coef, tis_cap=rl.tis_cap
    )


def fresh_model(config: Any, device: Any) -> torch.nn.Module:
    """An unsharded copy of the trainer's model architecture (weights loaded later): the
    generator's and the KL reference's (torchtitan Trainer.Config `config`)."""
    cfg = config.model_spec.model
    with torch.device(device):
        m = cfg.build()
    m.init_states(buffer_device=device)
    return m


def native_generator(config: Any, device: Any, rl: Any, pad_id: int) -> Generator:
    """The built-in generator over a fresh copy in rl.generator_dtype (weights loaded later)."""
    dtype = torch.bfloat16 if rl.generator_dtype == "bfloat16" else torch.float32
    return Generator(fresh_model(config, device), dtype=dtype, pad_id=pad_id)


def push_like(generator: Any) -> dict[str, torch.Tensor] | None:
    """The tensors a weight push is cast to as it is gathered (rl.policy.full_state_dict):
    the built-in generator's own (its probe shares its dtypes), so no float32 copy of a
    bfloat16 generator's weights is ever staged; None (as trained) for vLLM, whose engine
    takes the trainer's tensors."""
    return generator.model.state_dict() if isinstance(generator, Generator) else None


def on_policy(rl: Any, has_probe: bool, lag: torch.Tensor) -> bool:
    """Whether an update takes the one-forward path (RLRun.on_policy says why)."""
    return (
        not has_probe
        and rl.mode == "sync"
        and rl.kl_coef <= 0
        and rl.loss in BUILTIN_LOSSES
        and bool((lag == 0).all())
    )


class RolloutFailure(RuntimeError):
    """A generation or reward failed with rl.on_error = "fail"."""


@dataclass
class Batch:
    step: int
    rollouts: list[Rollout]
    rewards: list[float]
    gen_s: float
    errors: list[str] = field(default_factory=list)
    new_tokens: int = 0
    # multi-turn: the model's turns per episode and the environment's tokens, summed
    extra: dict[str, float] = field(default_factory=dict)


class RLRun:
    def __init__(self, job: Any, trainer: Any) -> None:
        self.job, self.trainer = job, trainer
        self.rl = job.recipe.rl
        self.steps = job.recipe.training.steps
        self.tok = trainer.tokenizer
        self.eos = self.tok.eos_id
        self.env: GuardedEnv = make_env(
            self.rl.env, self.rl.reward, timeout_s=self.rl.hook_timeout_s
        )
        model = trainer.model_parts[0]
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        rl = self.rl
        self.loss_cfg = loss_config(rl)
        self.loss_fn: LossFn = (
            load_loss(rl.custom_loss)  # behind the hook guard: one line naming it
            if rl.loss == "custom"
            else get_loss(rl.loss, self.loss_cfg)
        )
        assert rl.loss == "custom" or rl.loss in BUILTIN_LOSSES
        # The token budget for scoring, reference logprobs, forward_backward and generation.
        self.microbatch_tokens = choose_microbatch_tokens(job.recipe, job.layout, job.platform)
        self.policy = PolicyTrainer(
            model,
            trainer.optimizers,
            trainer.lr_schedulers,
            max_norm=job.recipe.training.max_norm,
            temperature=rl.temperature,
            pad_id=self.eos or 0,
            microbatch_tokens=self.microbatch_tokens,
            microbatch_rows=job.recipe.training.local_batch_size,
            dp_group=dist.group.WORLD if self.world > 1 else None,
            routing_replay=rl.routing_replay,
        )
        self.generator: Any = (
            self._vllm_generator(model) if rl.generator == "vllm" else self._build_generator(model)
        )
        # async: samples are older than the trainer's weights, so the mismatch is measured by a
        # second copy in the generator's numerics that always holds the trainer's version and
        # re-scores each trained batch (one prefill per update; memory: one more model copy).
        # (vLLM: no probe; the mismatch is taken over the lag-0 samples, docs/vllm.md.)
        self.probe = (
            self._build_generator(model)
            if rl.mode == "async" and rl.generator == "native"
            else None
        )
        self.sampling = SamplingParams(
            max_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            top_p=rl.top_p,
            n=rl.group_size,
            stop_tokens=(self.eos,) if self.eos is not None else (),
        )
        self.mp = trainer.metrics_processor

    # -- pieces ------------------------------------------------------------------------
    def _fresh_model(self) -> torch.nn.Module:
        return fresh_model(self.job.config, self.policy.device)

    def _build_generator(self, model: torch.nn.Module) -> Generator:
        gen = native_generator(self.job.config, self.policy.device, self.rl, self.eos or 0)
        gen.update_weights(full_state_dict(model), version=0)
        return gen

    def _vllm_generator(self, model: torch.nn.Module) -> Any:
        """rl.generator = "vllm": the engine process (rl/vllm_engine.py) over this model."""
        from rl.vllm_engine import rl_generator

        return rl_generator(self.job, full_state_dict(model))

    def close(self) -> None:
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    def attach_reference(self) -> None:
        """kl_coef > 0: a frozen copy of the policy RL starts from (after any warmup), saved
        once as a verified folder <output_dir>/rl_reference that a resumed run reloads."""
        if self.rl.kl_coef <= 0:
            return
        from runtime.checkpoint import load_states, save_states

        path, where = os.path.join(self.job.recipe.output_dir, "rl_reference"), self.job.recipe
        if not os.path.isdir(path) and self.rank == 0:
            save_states(path, {"model": full_state_dict(self.policy.model)})
        if self.world > 1:
            torch.distributed.barrier()  # rank 0's folder is committed before anyone reads
        ref = self._fresh_model()
        load_states(path, {"model": ref}, key="job.output_dir", file=where.source)
        self.policy.reference = ref.eval().requires_grad_(False)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_bos=True, add_eos=False)

    def decode(self, toks: list[int]) -> str:
        if toks and toks[-1] == self.eos:
            toks = toks[:-1]
        return self.tok.decode(toks)

    def encode_turn(self, text: str) -> list[int]:
        """A model's answer as it would sample it: the text, then its stop token."""
        return self.tok.encode(text, add_bos=False, add_eos=False) + [self.eos]

    def encode_reply(self, text: str) -> list[int]:
        """An environment's message inside the conversation: no BOS, no EOS."""
        return self.tok.encode(text, add_bos=False, add_eos=False)

    def episodes(self, tasks: list[Task], params: SamplingParams) -> list[Episode]:
        """Multi-turn: one episode per task (rl.multiturn.run_episodes over `generate`, so
        each turn is chunked under the token budget); turn k samples from seed (seed, k);
        conversations stop before outgrowing training.seq_len (the trainer's rows)."""
        outer = self

        class Turns:  # each turn its own seed: turns never replay one random stream
            turn = 0

            def generate(self, prompts: list[list[int]], p: SamplingParams) -> list[Any]:
                seed = None if p.seed is None else p.seed * 65_537 + self.turn
                self.turn += 1
                return outer.generate(prompts, replace(p, seed=seed))

        return run_episodes(Turns(), self.env, tasks, encode=self.encode,  # type: ignore[arg-type]
                            encode_reply=self.encode_reply, decode=self.decode,
                            params=replace(params, n=1), max_turns=self.rl.max_turns,
                            max_len=self.job.recipe.training.seq_len)  # fmt: skip

    @staticmethod
    def episode_rollout(ep: Episode, advantage: float = 0.0, group: int = 0) -> Rollout:
        """An episode as one rollout: its first prompt, then the conversation, the model's
        tokens marked (the environment's are context). Version: its oldest turn's (in async
        mode later turns may be newer), so policy_lag is never understated."""
        p = ep.prompt_len
        return Rollout(ep.tokens[:p], ep.tokens[p:], ep.logprobs, advantage, ep.reward,
                       min(ep.versions, default=0), group=group, routing=ep.routing,
                       completion_mask=ep.model_mask[p:])  # fmt: skip

    def tasks(self, split: str, n: int, key: int) -> list[Task]:
        return self.env.tasks(split, n, seed=(self.rl.seed * 1_000_003 + key) * 64 + self.rank)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Any]:
        """The generator called in chunks of prompts whose rows (n per prompt, left-padded
        to the chunk's longest prompt + max_tokens) fit the token budget: the KV cache holds
        at most microbatch_tokens positions. Chunk k > 0 samples from seed (seed, k)."""
        lens = [len(p) + params.max_tokens for p in prompts]
        out: list[Any] = []
        for lo, hi in split_rows(lens, self.microbatch_tokens // params.n):
            seed = params.seed if not lo or params.seed is None else params.seed * 1_000_003 + lo
            for smp in self.generator.generate(prompts[lo:hi], replace(params, seed=seed)):
                smp.prompt_index += lo
                out.append(smp)
        return out

    def make_batch(self, step: int) -> Batch:
        """Sample and reward prompts_per_step groups for update `step`."""
        rl = self.rl
        t0 = time.perf_counter()
        tasks = self.tasks("train", rl.prompts_per_step, step)
        prompts = [self.encode(t.prompt) for t in tasks]
        errors: list[str] = []
        params = replace(self.sampling, seed=rl.seed * 7919 + step)
        if self.env.multi_turn:
            return self._make_episode_batch(step, tasks, params, t0)
        try:
            samples = self.generate(prompts, params)
        except EngineError:
            raise  # the engine process is gone or broken: no later update can sample either
        except Exception as e:
            if rl.on_error == "fail":
                raise RolloutFailure(f"generation failed at update {step}: {e!r}") from e
            return Batch(step, [], [], time.perf_counter() - t0, [f"generate: {e!r}"] * len(tasks))
        rollouts, rewards = [], []
        G = rl.group_size
        for g, task in enumerate(tasks):
            group = samples[g * G : (g + 1) * G]
            try:
                rs = [float(self.env.reward(task, self.decode(s.tokens))) for s in group]
            except Exception as e:
                if rl.on_error == "fail":
                    raise RolloutFailure(f"reward failed at update {step}: {e!r}") from e
                errors.append(f"reward({task.prompt!r}): {e!r}")
                continue
            adv = group_advantages(torch.tensor(rs), G, normalize_std=rl.normalize_std)
            for s, r, a in zip(group, rs, adv.tolist(), strict=True):
                rollouts.append(Rollout(prompts[g], s.tokens, s.logprobs, a, r, s.version, group=g,
                                        routing=s.routing))  # fmt: skip
            rewards += rs
        new_tokens = sum(len(s.tokens) for s in samples)
        return Batch(step, rollouts, rewards, time.perf_counter() - t0, errors, new_tokens)

    def _make_episode_batch(
        self, step: int, tasks: list[Task], params: SamplingParams, t0: float
    ) -> Batch:
        """make_batch for a multi-turn environment: group_size episodes per task. A failing
        turn or reply (the environment's hook) fails the whole batch's episodes at once (they
        advance together), so it is one error per task under on_error = "skip"."""
        rl, G = self.rl, self.rl.group_size
        try:
            eps = self.episodes([t for t in tasks for _ in range(G)], params)
        except EngineError:
            raise  # the engine process is gone or broken: no later update can sample either
        except Exception as e:
            if rl.on_error == "fail":
                raise RolloutFailure(f"episodes failed at update {step}: {e!r}") from e
            # the same metric keys on every rank (mean_over_ranks reduces them together)
            none = {"episode_turns": 0.0, "env_tokens": 0.0}
            return Batch(step, [], [], time.perf_counter() - t0, [f"episodes: {e!r}"] * len(tasks),
                         extra=none)  # fmt: skip
        rollouts, rewards = [], []
        for g in range(len(tasks)):
            group = eps[g * G : (g + 1) * G]
            rs = [ep.reward for ep in group]
            adv = group_advantages(torch.tensor(rs), G, normalize_std=rl.normalize_std)
            for ep, a in zip(group, adv.tolist(), strict=True):
                if ep.logprobs:  # its first turn did not fit seq_len: nothing to train
                    rollouts.append(self.episode_rollout(ep, a, g))
            rewards += rs
        new_tokens = sum(len(ep.logprobs) for ep in eps)
        extra = {
            "episode_turns": sum(len(ep.turns) for ep in eps) / len(eps),
            "env_tokens": float(
                sum(m is False for ep in eps for m in ep.model_mask[ep.prompt_len :])
            ),
        }
        return Batch(step, rollouts, rewards, time.perf_counter() - t0, [], new_tokens, extra)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy completions on held-out prompts: mean reward and exact-answer rate."""
        n = self.rl.eval_prompts
        if n == 0:
            return {}
        tasks = self.tasks("eval", n, key=-1)
        greedy = SamplingParams(
            max_tokens=self.rl.max_new_tokens, top_p=1e-9, stop_tokens=self.sampling.stop_tokens
        )
        if self.env.multi_turn:  # exact: the episode's last turn is the task's answer
            eps = self.episodes(tasks, greedy)
            rs = [e.reward for e in eps]
            exact = [bool(e.turns) and e.turns[-1].strip() == e.task.answer for e in eps]
        else:
            samples = self.generate([self.encode(t.prompt) for t in tasks], greedy)
            texts = [self.decode(s.tokens) for s in samples]
            rs = [self.env.reward(t, x) for t, x in zip(tasks, texts, strict=True)]
            exact = [x.strip() == t.answer for t, x in zip(tasks, texts, strict=True)]
        return {
            "eval_reward_mean": sum(rs) / len(rs),
            "eval_exact_pct": 100.0 * sum(exact) / len(exact),
        }

    def push_weights(self, version: int) -> None:
        sd = full_state_dict(self.policy.model, like=push_like(self.generator))
        self.generator.stage_weights(sd, version)
        if self.probe is not None:
            self.probe.update_weights(sd, version)

    def sft_warmup(self) -> None:
        """Supervised steps on reference answers: torchtitan's AdamW with the recipe's
        settings at a constant rl.sft_warmup_lr, its own state (dropped after); the RL
        optimizer and schedule untouched."""
        n = self.rl.sft_warmup_steps
        if n == 0:
            return
        from torchtitan.tools.logging import logger

        pol, eng = self.policy, self.policy.engine
        main = eng.optimizers, eng.lr_schedulers
        eng.optimizers, eng.lr_schedulers = recipe_optimizer(
            self.job.recipe, pol.model, lr=self.rl.sft_warmup_lr
        )
        ce = get_loss("cross_entropy")
        try:
            for i in range(n):
                rows = []
                for t in self.tasks("train", self.rl.prompts_per_step * self.rl.group_size, -2 - i):
                    if self.env.multi_turn:  # the conversation of right turns; replies context
                        turns = self.env.reference_turns(t)
                        assert turns is not None  # rl.hooks.check_env refused it before
                        ep = reference_episode(self.env, t, turns, encode=self.encode,
                                               encode_turn=self.encode_turn,
                                               encode_reply=self.encode_reply)  # fmt: skip
                        rows.append(self.episode_rollout(ep))
                        continue
                    ans = self.encode_turn(t.answer)
                    rows.append(Rollout(self.encode(t.prompt), ans, [0.0] * len(ans)))
                c = collate(rows, pol.pad_id, pol.device)
                loss = pol.forward_backward(c, pol.loss_batch(c, None), ce)
                pol.optim_step()
                if (i + 1) % 20 == 0 or i + 1 == n:
                    logger.info(f"rl: sft warmup {i + 1}/{n} loss {loss:.4f}")
        finally:
            eng.optimizers, eng.lr_schedulers = main

    # -- one update ----------------------------------------------------------------------
    def on_policy(self, lag: torch.Tensor) -> bool:
        """pi_old is the training forward's own logprobs, detached, so no scoring pass is
        needed (PolicyTrainer.forward_backward_on_policy): every sample drawn by the current
        weights (sync, lag 0), one optimizer step per batch (the loop's only schedule), no
        KL reference (its own forward either way; kept on the scoring path), a built-in loss
        (rows separable; a custom loss may couple them). TRL skips the same pass when
        num_iterations = 1. Saves one forward of the batch per update (~19% of a CPU update,
        benchmarks/peers.md)."""
        return on_policy(self.rl, self.probe is not None, lag)

    def train_on(self, batch: Batch, step: int) -> dict[str, float]:
        if not batch.rollouts:
            return {"loss": float("nan"), "grad_norm": 0.0}
        lag = (step - 1) - torch.tensor([r.version for r in batch.rollouts])
        if self.on_policy(lag):
            return self._train_on_policy(batch, step, lag)
        c, old = self.policy.score(batch.rollouts)
        lag = lag.to(c.versions.device)
        if self.probe is not None:
            rs, T = batch.rollouts, self.rl.temperature
            spans = split_rows([len(r.prompt + r.completion) for r in rs], self.microbatch_tokens)
            probe = [lp for lo, hi in spans for lp in self.probe.score(
                [r.prompt for r in rs[lo:hi]], [r.completion for r in rs[lo:hi]], T)]  # fmt: skip
            probe = [[lp[j] for j in r.trained()] for lp, r in zip(probe, rs, strict=True)]
            mm = mismatch_stats(
                probe, [row[m > 0].tolist() for row, m in zip(old, c.mask, strict=True)]
            )
        else:
            same = (lag == 0)[:, None] & c.mask.bool()
            mm = mismatch_stats(c.sampling_logprobs, old, same) if bool(same.any()) else {}
        behav = mismatch_stats(c.sampling_logprobs, old, c.mask)
        mm.update(self.policy.routing_metrics(c, old))  # MoE: before the step changes weights
        lb = self.policy.loss_batch(c, old)
        with self._named_non_finite(batch, step):
            # pi_old was scored under these very weights: the engine's first pass is it.
            loss = self.policy.forward_backward(c, lb, self.loss_fn, logprobs=old)
            grad_norm = self.policy.optim_step()
        return self._stats(loss, grad_norm, lag, behav, mm, c)

    def _train_on_policy(self, batch: Batch, step: int, lag: torch.Tensor) -> dict[str, float]:
        """train_on when `on_policy`: one forward per microbatch; pi_old and the mismatch
        statistics come from that forward (the same values the scoring pass would give)."""
        c = collate(batch.rollouts, self.policy.pad_id, self.policy.device,
                    replay=self.policy.routing_replay)  # fmt: skip
        with self._named_non_finite(batch, step):
            loss, old = self.policy.forward_backward_on_policy(c, self.loss_fn)
            moe = self.policy.routing_metrics(c, old)  # MoE: before the step changes weights
            grad_norm = self.policy.optim_step()
        behav = mismatch_stats(c.sampling_logprobs, old, c.mask)
        # Every sample is at lag 0: the train/inference mismatch is over all its tokens.
        mm = dict(behav) if bool(c.mask.any()) else {}
        return self._stats(loss, grad_norm, lag, behav, {**mm, **moe}, c)

    @contextlib.contextmanager
    def _named_non_finite(self, batch: Batch, step: int) -> Iterator[None]:
        """A refused update's NonFiniteError names the update and, when a reward is not
        finite, the completion it came from (the recipe key: rl.reward or rl.env)."""
        try:
            yield
        except steps.NonFiniteError as e:
            bad = [f" (the reward of a completion of {self.decode(r.prompt)!r} is {r.reward})"
                   for r in batch.rollouts if not math.isfinite(r.reward)] + [""]  # fmt: skip
            key = "rl.reward" if self.rl.reward else "rl.env"
            raise steps.NonFiniteError(f"update {step}: {e.detail}{bad[0]}",
                                       file=self.job.recipe.source, key=key) from None  # fmt: skip

    @staticmethod
    def _stats(loss: float, grad_norm: float, lag: torch.Tensor, behav: dict[str, float],
               mm: dict[str, float], c: Any) -> dict[str, float]:  # fmt: skip
        out = {
            "loss": loss,
            "grad_norm": grad_norm,
            "policy_lag": float(lag.float().mean()),
            "policy_lag_max": float(lag.max()),
            "behaviour_kl": behav["train_infer_kl"],
            "trained_tokens": float(c.mask.sum()),
        }
        out.update(mm)
        return out


def run(job: Any) -> dict[str, Any] | None:
    from torchtitan.tools.logging import logger

    from runtime.trainer import TitanscaleTrainer

    job.platform.apply()
    logger.info(
        f"titanscale rl: {job.recipe.source} | {job.recipe.model.flavor} | env {job.recipe.rl.env}"
        f" | loss {job.recipe.rl.loss} | mode {job.recipe.rl.mode}"
    )
    trainer = TitanscaleTrainer(job.config)
    try:
        return _train(job, trainer)
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(job: Any, trainer: Any) -> dict[str, Any] | None:
    trainer.checkpointer.load(step=-1)
    start = trainer.step  # updates already done (restored from a checkpoint)
    r = RLRun(job, trainer)
    try:
        return _train_run(job, trainer, r, start)
    finally:
        r.close()  # the vLLM engine process, when there is one


def _train_run(job: Any, trainer: Any, r: RLRun, start: int) -> dict[str, Any] | None:
    from torchtitan.tools.logging import logger

    from launch.stop_request import save_full_checkpoint

    rl = r.rl
    mp = r.mp
    mp.start(start)  # as TitanscaleTrainer.batch_generator does for pretraining
    if start == 0:
        r.sft_warmup()
    r.attach_reference()
    r.push_weights(start)
    errors_total = skipped = 0
    wait_total = busy_total = 0.0
    q: queue.Queue[Batch | BaseException] = queue.Queue()
    stop = threading.Event()

    def producer() -> None:
        try:
            for s in range(start + 1, r.steps + 1):
                while r.generator.latest_version < s - 1 - rl.max_policy_lag:
                    if stop.wait(0.005):
                        return
                q.put(r.make_batch(s))
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the trainer thread, which raises it
            q.put(e)

    thread = None
    if rl.mode == "async":
        thread = threading.Thread(target=producer, name="rl-generator", daemon=True)
        thread.start()
    eval_stats = r.evaluate()
    if eval_stats:
        logger.info(f"rl: held-out before RL: {eval_stats}")
        mp.write_event("rl_eval", step=start, **eval_stats)
    guard = StepGuard(job.recipe, device=trainer.device)
    done = start  # the weights in memory are exactly version `done`
    stopped = False
    try:
        for step in range(start + 1, r.steps + 1):
            t0 = time.perf_counter()
            with guard.step(step):
                if thread is None:
                    item: Batch | BaseException = r.make_batch(step)
                else:
                    item = q.get()
                if isinstance(item, BaseException):
                    raise item
                batch = item
                t_wait = time.perf_counter() - t0
                # No rollout succeeded on any rank (on_error = "skip"): nothing to train on.
                # The update is skipped and counted, never trained or logged as a NaN loss.
                empty = mean_over_ranks({"n": float(len(batch.rollouts))})["n"] == 0
                if not empty:
                    stats = r.train_on(batch, step)
                done = trainer.step = step
                r.push_weights(step)
            if empty:
                skipped += 1
                errors_total += len(batch.errors)
                for e in batch.errors:
                    mp.write_event("rl_rollout_error", step=step, error=e[:500])
                mp.write_event("rl_update_skipped", step=step, rollout_errors=len(batch.errors))
                logger.warning(f"rl: update {step} skipped: no rollout succeeded "
                               f"({len(batch.errors)} errors, rl.on_error = \"skip\")")  # fmt: skip
                trainer.checkpointer.save(step, last_step=(step == r.steps))
                continue
            t_busy = time.perf_counter() - t0 - t_wait
            wait_total += t_wait
            busy_total += t_busy
            for e in batch.errors:
                mp.write_event("rl_rollout_error", step=step, error=e[:500])
            errors_total += len(batch.errors)
            rewards = batch.rewards
            extra = {
                "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
                "exact_pct": 100.0 * sum(x == 1.0 for x in rewards) / max(len(rewards), 1),
                "rollout_errors": float(len(batch.errors)),
                "generation_s": batch.gen_s,
                "trainer_wait_s": t_wait,
                "trainer_wait_pct": 100.0 * t_wait / (t_wait + t_busy),
                "generated_tokens": float(batch.new_tokens),
                **batch.extra,
                **{k: v for k, v in stats.items() if k not in ("loss", "grad_norm")},
            }
            extra = mean_over_ranks(extra)
            trainer.checkpointer.save(step, last_step=(step == r.steps))
            if step % rl.eval_every == 0 or step == r.steps:
                ev = r.evaluate()
                extra.update(ev)
                if ev:
                    mp.write_event("rl_eval", step=step, **ev)
            mp.data_loading_times.append(t_wait)  # data_loading_pct = rollout wait share
            ntok = int(stats.get("trained_tokens", 0))
            mp.ntokens_since_last_log += ntok
            mp.useful_ntokens_since_last_log += ntok
            if mp.should_log(step):
                mp.log(step, stats["loss"], stats["loss"], stats["grad_norm"], extra_metrics=extra)
                logger.info(
                    f"rl step {step}: reward {extra['reward_mean']:.3f} lag "
                    f"{extra.get('policy_lag', float('nan')):.2f} wait {extra['trainer_wait_pct']:.0f}% "
                    f"kl {extra.get('train_infer_kl', float('nan')):.2e}"
                )
            # The launcher asks (time limit near): a resumable checkpoint of this update, then
            # exit for the requeue (launch/job.sbatch). Without checkpoints: keep training.
            if step < r.steps and guard.stop_here(
                step, partial(save_full_checkpoint, trainer.checkpointer, step)
            ):
                mp.write_event("stopped", step=step)
                stopped = True
                break
    except BaseException:
        stop.set()
        # Nothing trained is lost: keep the last completed update (when checkpoints are on).
        # A step refused by the non-finite guard never touched the weights: `done` is good.
        if done > start and save_full_checkpoint(trainer.checkpointer, done):
            logger.info(f"rl: stopped after update {done}; saved a checkpoint of it")
        raise
    finally:
        stop.set()
        guard.close()
        if thread is not None:
            thread.join(timeout=60)
    mp.write_event(
        "rl_summary",
        mode=rl.mode,
        updates=done - start - skipped,
        skipped_updates=skipped,
        stopped=stopped,
        trainer_wait_pct=100.0 * wait_total / max(wait_total + busy_total, 1e-9),
        rollout_errors=errors_total,
    )
    trainer.summary = mp.finish()
    if skipped and skipped == done - start:  # nothing trained: not a success (exit 2)
        raise ConfigError(
            f"every update of this run ({skipped}) was skipped: no rollout succeeded "
            f"({errors_total} errors; rl_rollout_error events in metrics.jsonl)",
            file=job.recipe.source,
            key="rl.on_error",
        )
    return trainer.summary
