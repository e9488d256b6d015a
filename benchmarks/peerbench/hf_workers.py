"""The TRL / transformers sides (one per process, `peers.py --worker NAME ARGS_JSON`): TRL
SFTTrainer + PEFT (LoRA SFT, packed or not), transformers Trainer (full fine-tune),
TRL GRPOTrainer (arithmetic) and TRL DPOTrainer + PEFT, each with titanscale's schedule and
optimizer settings and a per-step clock; the raw loss of every step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import ADAM, LORA, PEFT_TARGETS
from benchmarks.peerbench.measure import StepClock


def _callback(clock: StepClock):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock.start()

        def on_step_end(self, args, state, control, **kw):
            clock.tick()

    return Clock()


def _hf_args(a: dict, **extra: Any) -> dict[str, Any]:
    """TrainingArguments both trainer peers share (titanscale's schedule: no warmup, linear
    decay to 0 at the last step, torchtitan's AdamW betas, clipping at 1, float32 on CPU)."""
    return dict(
        output_dir=str(Path(a["work"]) / f"hf_out_{os.getpid()}"),
        max_steps=a["steps"],
        learning_rate=a["lr"],
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=ADAM["beta1"],
        adam_beta2=ADAM["beta2"],
        adam_epsilon=ADAM["eps"],
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=device() == "cpu",
        bf16=False,
        fp16=False,
        seed=0,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def device() -> str:
    """Where the peers run: CUDA when this machine has it, as train.py and tools.serve choose
    (only the CPU path has run: no GPU was lent)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )


def _peft_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA["rank"],
        lora_alpha=LORA["alpha"],
        lora_dropout=0.0,
        target_modules=PEFT_TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _recording(trainer_cls: type, losses: list[float], after=None) -> type:
    """`trainer_cls` (a transformers/TRL trainer) appending the raw loss of every
    compute_loss call to `losses` (the loss itself, not the log's running mean); `after(self)`,
    if given, runs after each call (DPO reads its chosen/rejected log-probs there)."""

    class Recorded(trainer_cls):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, *args, **kw):
            out = super().compute_loss(model, inputs, *args, **kw)
            loss = out[0] if isinstance(out, tuple) else out
            losses.append(float(loss.detach()))
            if after is not None:
                after(self)
            return out

    return Recorded


def w_trl_sft(a: dict) -> dict:
    """TRL SFTTrainer (+ PEFT LoRA) on the pre-tokenized examples."""
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(x) for x in Path(a["data"]).read_text().splitlines()]
    ds = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses = StepClock(), []

    Recorded = _recording(SFTTrainer, losses)

    cfg = SFTConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        max_length=a["max_length"],
        packing=a["packed"],
        packing_strategy="bfd",
        completion_only_loss=True,
        shuffle_dataset=False,
        train_sampling_strategy="sequential",
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]),
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        peft_config=_peft_config() if a["lora"] else None,
        callbacks=[_callback(clock)],
    )
    first = trainer.get_train_dataloader().__iter__().__next__()
    trainer.train()
    return {
        "step_times": clock.times,
        "cpu_marks": clock.cpu_marks,
        "losses": losses,
        "first_batch_shape": list(first["input_ids"].shape),
    }


def w_hf_full(a: dict) -> dict:
    """transformers Trainer, full fine-tune, on the pre-tokenized examples (padded per batch)."""
    import datasets
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

    rows = []
    for x in Path(a["data"]).read_text().splitlines():
        r = json.loads(x)
        ids, m = r["input_ids"], r["completion_mask"]
        rows.append(
            {"input_ids": ids, "labels": [t if k else -100 for t, k in zip(ids, m, strict=True)]}
        )
    ds = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses = StepClock(), []

    Recorded = _recording(Trainer, losses)

    args = TrainingArguments(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]),
        args=args,
        train_dataset=ds,
        data_collator=DataCollatorForSeq2Seq(tok, padding=True),
        callbacks=[_callback(clock)],
    )
    trainer.train()
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "losses": losses}


def _heldout_reward(model, tok, env) -> float:
    """Greedy decoding (transformers generate, KV cache) on every held-out prompt; the mean
    reward (what titanscale's rl_eval reports for its own model)."""
    import torch

    tasks = env.tasks("eval", 10_000, seed=0)
    prompts = [
        [tok.bos_token_id] + tok(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks
    ]
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
        mask[i, P - len(p) :] = 1
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
            max_new_tokens=4, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    rs = []
    for t, row in zip(tasks, out[:, P:].tolist(), strict=True):
        text = tok.decode(row, skip_special_tokens=True)
        rs.append(env.reward(t, text))
    return sum(rs) / len(rs)


def w_trl_grpo(a: dict) -> dict:
    """TRL GRPOTrainer on the arithmetic environment of rl/envs.py, full weights."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rl.envs import Task, make_env

    env = make_env("arithmetic", timeout_s=0)  # the whole split below: no 60 s hook guard
    tok = AutoTokenizer.from_pretrained(a["hf"])
    tasks = env.tasks("train", 100_000, seed=0)
    ds = datasets.Dataset.from_list(
        [{"prompt": tok.bos_token + t.prompt, "answer": t.answer} for t in tasks]
    )
    rewards: list[float] = []

    def reward(prompts, completions, answer, **kw):
        rs = [
            env.reward(Task(p, x), c) for p, c, x in zip(prompts, completions, answer, strict=True)
        ]
        rewards.extend(rs)
        return rs

    model = _hf_model(a["hf"])
    before = _heldout_reward(model, tok, env)
    clock = StepClock()
    cfg = GRPOConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["prompts"] * a["group"],
        num_generations=a["group"],
        steps_per_generation=1,
        max_completion_length=4,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch: rl.losses' token_mean
        scale_rewards="group",
        num_iterations=1,
    )
    model.train()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
        callbacks=[_callback(clock)],
    )  # fmt: skip
    trainer.train()
    after = _heldout_reward(trainer.model, tok, env)
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "heldout_before": before,
            "heldout_after": after, "rewards": rewards}  # fmt: skip


def w_trl_dpo(a: dict) -> dict:
    """TRL DPOTrainer + PEFT LoRA (reference = the base, adapters disabled)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    data = json.loads(Path(a["data"]).read_text())
    ds = datasets.Dataset.from_list(
        [{k: d[k] for k in ("prompt", "chosen", "rejected")} for d in data]
    )
    tok = AutoTokenizer.from_pretrained(a["hf"])
    clock, losses, metrics = StepClock(), [], []

    def logps(trainer: Any) -> None:
        m = trainer._metrics["train"]
        metrics.append({k: m[k][-1] for k in ("logps/chosen", "logps/rejected")})

    Recorded = _recording(DPOTrainer, losses, logps)

    cfg = DPOConfig(
        **_hf_args(a),
        per_device_train_batch_size=a["batch"],
        beta=a["beta"],
        loss_type=["sigmoid"],
        train_sampling_strategy="sequential",
    )
    trainer = Recorded(
        model=_hf_model(a["hf"]), args=cfg, train_dataset=ds, processing_class=tok,
        peft_config=_peft_config(), callbacks=[_callback(clock)],
    )  # fmt: skip
    # Same tokens as the service side: TRL's own tokenization of the first pair.
    first = trainer.train_dataset[0]
    for k in ("prompt_ids", "chosen_ids", "rejected_ids"):
        if list(first[k]) != data[0][k]:
            raise AssertionError(f"TRL tokenized {k} differently: {list(first[k])} vs {data[0][k]}")
    trainer.train()
    return {
        "step_times": clock.times,
        "cpu_marks": clock.cpu_marks,
        "losses": losses,
        "logps_chosen": metrics[0]["logps/chosen"],
        "logps_rejected": metrics[0]["logps/rejected"],
    }
