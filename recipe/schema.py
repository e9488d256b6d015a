"""The recipe contract: one dataclass per TOML section, every field documented.

Sections: [job] [model] [training] [parallel] [moe] [kernels] [data] [checkpoint] [metrics]
[finetune] [lora] [[adapters]] [validation] [profiling] [rl] [fault_tolerance] [torchtitan].
Field-local checks (ranges, choices) run in `__post_init__` and raise ConfigError with the
key; checks that need several sections or the world size live in `recipe.loader`
(`check_recipe`, `check_layout`).
Extend this contract by adding fields; never rename one (users' recipes depend on them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from core.errors import ConfigError, did_you_mean, shown
from core.linear_backends import LinearChoice
from core.models import FAMILIES, check_flavor
from core.safe_text import check_name, check_path, check_text
from core.typed_toml import doc


def _positive(name: str, value: int | float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        want = "a non-negative" if allow_zero else "a positive"
        raise ConfigError(f"expected {want} value, got {value}", key=name)


@dataclass
class JobSection:
    name: str = field(default="titanscale", metadata=doc("Run name; used in output paths."))
    output_dir: str = field(
        default="outputs/{name}",
        metadata=doc(
            "Folder for metrics, TensorBoard and checkpoints (relative to the working "
            "directory); '{name}' expands to job.name."
        ),
    )
    description: str = field(default="", metadata=doc("Free text, shown in reports."))
    collective_timeout_s: int = field(
        default=100,
        metadata=doc(
            "Seconds a collective may wait after the first step before the job stops with a "
            "message naming the rank that stopped answering (also bounds checkpoint-save "
            "collectives). A training step may take max(this, 4 x its longest step so far)."
        ),
    )
    init_timeout_s: int = field(
        default=0,
        metadata=doc(
            "The same limit for process-group setup and the first step of each (re)start "
            "(compilation, first collectives, checkpoint load). 0 = automatic: 300 s, or "
            "1800 s with training.compile (inductor + flex-attention autotuning + CUDA graph "
            "capture on a cold cache take minutes per graph; docs/reliability.md)."
        ),
    )

    def __post_init__(self) -> None:
        # Both become folder names, an #SBATCH --job-name and paths in the job script
        # (core.safe_text): a newline would write an extra script line.
        check_name(self.name, key="name")
        check_path(self.output_dir, key="output_dir")
        _positive("collective_timeout_s", self.collective_timeout_s)
        _positive("init_timeout_s", self.init_timeout_s, allow_zero=True)


@dataclass
class ModelSection:
    family: str = field(
        default="llama3",
        metadata=doc(
            "Model family (torchtitan's registry): llama3 | qwen3 | deepseek_v3 | gpt_oss | "
            "kimi_k2_7 (text models: Moonlight). qwen3_5 is refused (its gated delta rule "
            "needs the fla GPU kernels). docs/moe.md for the mixture-of-experts families."
        ),
    )
    flavor: str = field(
        default="debugmodel",
        metadata=doc(
            "torchtitan flavor of the family. llama3: debugmodel, 1B, 3B, 8B, 70B, 405B; "
            "qwen3: debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, debugmodel_moe, 30B-A3B, "
            "235B-A22B; deepseek_v3: debugmodel, 16B, 236B, 671B; gpt_oss: debugmodel, 20b, "
            "120b; kimi_k2_7: debugmodel (text tower), moonlight-16B-A3B. deepseek_v3 and "
            "kimi_k2_7 also have titanscale's debugmodel_sigmoid (671B's / Moonlight's "
            "sigmoid routing and RoPE at debug size; core/small_flavors.py)."
        ),
    )
    tokenizer: str = field(
        default="embedded",
        metadata=doc(
            "Tokenizer folder (tokenizer.json [+ tokenizer_config.json]); 'embedded' trains a "
            "byte-level BPE on the standard-library corpus at first use and caches it."
        ),
    )
    vocab_size: int = field(
        default=0,
        metadata=doc(
            "Override the flavor's vocabulary size (0 = the flavor's). The embedded "
            "tokenizer is trained to the flavor's size."
        ),
    )

    layers: int = field(
        default=0,
        metadata=doc(
            "Keep only the first N transformer layers of the flavor (0 = all): a model slice "
            "with the flavor's layer shapes, for benchmarks and memory checks."
        ),
    )

    def __post_init__(self) -> None:
        problem = check_flavor(self.family, self.flavor)
        if problem:
            raise ConfigError(problem, key="family" if self.family not in FAMILIES else "flavor")
        _positive("vocab_size", self.vocab_size, allow_zero=True)
        _positive("layers", self.layers, allow_zero=True)


@dataclass
class TrainingSection:
    seq_len: int = field(default=256, metadata=doc("Tokens per sequence."))
    local_batch_size: int = field(
        default=2, metadata=doc("Sequences per data-parallel rank per microstep.")
    )
    global_batch_size: int = field(
        default=-1,
        metadata=doc(
            "Sequences per optimizer step over all data-parallel ranks; -1 = local batch x "
            "data-parallel size (no gradient accumulation). Must be a multiple of that."
        ),
    )
    steps: int = field(default=10, metadata=doc("Optimizer steps to train."))
    lr: float = field(default=8e-4, metadata=doc("Peak learning rate (AdamW)."))
    warmup_steps: int = field(default=2, metadata=doc("Linear learning-rate warmup steps."))
    lr_schedule: Literal["linear", "cosine", "wsd"] = field(
        default="linear",
        metadata=doc(
            "Decay after warmup (torchtitan's scheduler): linear, cosine, or wsd "
            "(warmup-stable-decay: the peak LR held, then a 1 - sqrt cooldown over the "
            "last decay_ratio of the steps). Formula in docs/schedules.md."
        ),
    )
    min_lr_ratio: float = field(
        default=0.0,
        metadata=doc("The LR decays to lr x min_lr_ratio (0 = to zero); in [0, 1]."),
    )
    decay_ratio: float = field(
        default=-1.0,
        metadata=doc(
            "Fraction of training.steps spent decaying, at the end (the steps between "
            "warmup and decay hold the peak LR); -1 = the schedule's default: every step "
            "after warmup for linear and cosine, the last 20% for wsd. In (0, 1] otherwise."
        ),
    )
    weight_decay: float = field(default=0.1, metadata=doc("AdamW weight decay."))
    max_norm: float = field(default=1.0, metadata=doc("Gradient clipping norm."))
    dtype: Literal["bfloat16", "float32"] = field(
        default="float32",
        metadata=doc(
            "Compute dtype for parameters under FSDP mixed precision (gradients reduce in "
            "float32). GPU recipes use bfloat16; CPU runs use float32."
        ),
    )
    activation_checkpoint: Literal["none", "selective", "full"] = field(
        default="none", metadata=doc("Activation checkpointing mode.")
    )
    compile: bool = field(default=False, metadata=doc("torch.compile the model and loss."))
    cuda_graphs: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=doc(
            "Capture forward+backward in a CUDA graph (torchtitan's training.disable_cuda_graphs "
            "inverted). auto = on where torchtitan allows it: CUDA, pp = 1 and not varlen "
            "attention (whose host-side lengths break capture); on with pp > 1 is an error. "
            "Saves host launch overhead; no effect on CPU."
        ),
    )
    seed: int = field(default=42, metadata=doc("Random seed (same on every rank)."))
    microbatch_tokens: int = field(
        default=0,
        metadata=doc(
            "Post-training (RL, [[adapters]], the service): most padded tokens per "
            "forward/backward microbatch and per generation call; a batch is split into "
            "microbatches under it (rows up to local_batch_size each) and their gradients "
            "accumulated. 0 = the largest that fits the device by the memory model "
            "(parallel.memory.fit_microbatch_tokens). Pretraining and SFT refuse it."
        ),
    )

    def __post_init__(self) -> None:
        for name in ("seq_len", "local_batch_size", "steps"):
            _positive(name, getattr(self, name))
        _positive("microbatch_tokens", self.microbatch_tokens, allow_zero=True)
        if self.global_batch_size != -1:
            _positive("global_batch_size", self.global_batch_size)
        _positive("lr", self.lr)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("weight_decay", self.weight_decay, allow_zero=True)
        _positive("max_norm", self.max_norm)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                f"expected a value in [0, 1], got {self.min_lr_ratio}", key="min_lr_ratio"
            )
        if self.decay_ratio != -1.0 and not 0.0 < self.decay_ratio <= 1.0:
            raise ConfigError(
                f"expected -1 (the schedule's default) or a value in (0, 1], got {self.decay_ratio}",
                key="decay_ratio",
            )
        if self.warmup_steps > self.steps:
            raise ConfigError(
                f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})",
                key="warmup_steps",
            )


@dataclass
class ParallelSection:
    world_size: int = field(
        default=0,
        metadata=doc(
            "Declared number of processes (GPUs). 0 = whatever the launcher provides. When "
            "set, a launch with another world size stops before training."
        ),
    )
    dp_replicate: int = field(default=1, metadata=doc("HSDP replicate degree (DDP-like)."))
    dp_shard: int = field(
        default=-1, metadata=doc("FSDP2 shard degree; -1 = the rest of the world size.")
    )
    tp: int = field(default=1, metadata=doc("Tensor-parallel degree (inside NVLink)."))
    pp: int = field(default=1, metadata=doc("Pipeline-parallel degree."))
    cp: int = field(default=1, metadata=doc("Context-parallel degree."))
    ep: int = field(
        default=1,
        metadata=doc(
            "Expert-parallel degree (MoE models; torchtitan's expert_parallel_degree): the "
            "routed experts are split over ep ranks and tokens reach them by all-to-all. Must "
            "divide the routed experts and dp_shard x cp x tp (EP borrows those ranks; the "
            "experts are FSDP-sharded over the rest). torchtitan 0.3.0 has no separate "
            "expert tensor-parallel degree."
        ),
    )
    pp_schedule: Literal[
        "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = field(default="1F1B", metadata=doc("Pipeline schedule (torchtitan names)."))
    pp_microbatches: int = field(
        default=0,
        metadata=doc(
            "Microbatches per local batch under PP; 0 = one sequence per microbatch. Must "
            "divide training.local_batch_size."
        ),
    )
    async_tp: bool = field(
        default=False,
        metadata=doc(
            "torchtitan's async tensor parallelism (compile.enable_async_tensor_parallel): "
            "micro-pipelines TP all-gathers / reduce-scatters with the matmuls through "
            "symmetric memory. Needs training.compile = true, tp > 1 and CUDA. Under auto it "
            "applies to the plans with tp > 1."
        ),
    )
    pp_stages_per_rank: int = field(
        default=0,
        metadata=doc(
            "Pipeline stages on each rank (Megatron's virtual pipeline size): 0 = the "
            "schedule's default (1 for GPipe/1F1B, 2 for the others); more than 2 only for "
            "Interleaved1F1B and InterleavedZeroBubble. pp x this must split the layers evenly."
        ),
    )
    auto: bool = field(
        default=False,
        metadata=doc(
            "Ignore the degrees, schedule, microbatches, local batch and AC above and train "
            "with the planner's best plan for the launch's world size on `cluster`."
        ),
    )
    cluster: str = field(
        default="",
        metadata=doc(
            "Cluster profile (a name in clusters/ or a path) for auto planning and the "
            "startup placement check; '' = local_cpu on CPU (auto needs one on GPUs)."
        ),
    )

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep"):
            _positive(name, getattr(self, name))
        if self.dp_shard != -1:
            _positive("dp_shard", self.dp_shard)
        _positive("world_size", self.world_size, allow_zero=True)
        _positive("pp_microbatches", self.pp_microbatches, allow_zero=True)
        _positive("pp_stages_per_rank", self.pp_stages_per_rank, allow_zero=True)


LOAD_BALANCE_MODES = ("aux_loss_free", "none")


@dataclass
class MoeSection:
    """Mixture-of-experts training options (docs/moe.md); refused on a dense model."""

    load_balance: str = field(
        default="aux_loss_free",
        metadata=doc(
            "Expert load balancing: aux_loss_free (DeepSeek-V3's bias update: before each "
            "optimizer step every expert's routing bias moves by bias_update_speed toward "
            "equal load; torchtitan's load_balance_coeff) or none. torchtitan 0.3.0 has no "
            "auxiliary load-balancing loss, so 'aux_loss' is refused."
        ),
    )
    bias_update_speed: float = field(
        default=1e-3,
        metadata=doc("Step of the aux_loss_free bias update (torchtitan's default 1e-3)."),
    )
    capacity_factor: float = field(
        default=0.0,
        metadata=doc(
            "0 = dropless routing (every token reaches its top_k experts). Token dropping "
            "exists in torchtitan 0.3.0 only in the HybridEP dispatcher (CUDA, deep_ep), "
            "which titanscale does not run: values > 0 are refused."
        ),
    )
    n_mtp_layers: int = field(
        default=0,
        metadata=doc(
            "Multi-token prediction modules (DeepSeek-V3). torchtitan's MTP needs its own "
            "loss in place of titanscale's chunked loss: not trained yet, values > 0 are "
            "refused."
        ),
    )

    def __post_init__(self) -> None:
        if self.load_balance not in LOAD_BALANCE_MODES:
            why = (
                " (torchtitan 0.3.0 has no auxiliary load-balancing loss)"
                if self.load_balance == "aux_loss"
                else did_you_mean(self.load_balance, LOAD_BALANCE_MODES)
            )
            raise ConfigError(
                f"expected one of {', '.join(LOAD_BALANCE_MODES)}, got "
                f"{shown(self.load_balance)}{why}",
                key="load_balance",
            )
        _positive("bias_update_speed", self.bias_update_speed)
        if self.capacity_factor:
            raise ConfigError(
                "token dropping (capacity_factor > 0) needs torchtitan's HybridEP dispatcher "
                "(CUDA, deep_ep), which titanscale does not run; use 0 (dropless)",
                key="capacity_factor",
            )
        if self.n_mtp_layers:
            raise ConfigError(
                "multi-token prediction is not trained by titanscale yet (torchtitan's "
                "MTPLoss would replace the chunked loss); use 0",
                key="n_mtp_layers",
            )


@dataclass
class KernelsSection:
    attention: Literal["auto", "flex", "varlen", "dense"] = field(
        default="auto",
        metadata=doc(
            "Attention backend: flex (FlexAttention, document masks), varlen (flash varlen, "
            "CUDA), dense (exact masked attention for CPU; memory grows with seq_len^2), "
            "auto (flex on CUDA, dense on CPU)."
        ),
    )
    linear: LinearChoice = field(
        default="bf16",
        metadata=doc(
            "Linear backend: bf16 (plain), fp8_rowwise / fp8_rowwise_gw_hp / fp8_tensorwise "
            "(SM89+; tensorwise gathers FSDP weights in FP8), mxfp8 (SM100+); emulated on CPU. "
            "nvfp4 (SM100+, no CPU emulation). auto = the fastest of torchtitan's default "
            "recipes the hardware supports (never fp8_tensorwise or nvfp4)."
        ),
    )


@dataclass
class DataSourceEntry:
    """One `[[data.sources]]` table: a source in a weighted mix."""

    source: str = field(
        default="",
        metadata=doc(
            "A prepared store (tools.prepare_data), or any data.source value (unprepared "
            "sources are tokenized in memory by every rank: small data only)."
        ),
    )
    weight: float = field(
        default=1.0,
        metadata=doc("Share of rows (weight / sum of weights), exact over each mix_window."),
    )
    text_field: str = field(default="text", metadata=doc("Record field holding the text."))
    subset: str = field(default="", metadata=doc("Hub dataset configuration (name=)."))
    split: str = field(default="train", metadata=doc("Hub dataset split."))
    data_files: list[str] = field(
        default_factory=list, metadata=doc("Hub dataset files (globs) to read.")
    )

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("expected a source (a store folder, file, folder or hub name)",
                              key="source")  # fmt: skip
        if not self.weight > 0:
            raise ConfigError(f"expected a positive weight, got {self.weight}", key="weight")


@dataclass
class DataSection:
    source: str = field(
        default="stdlib",
        metadata=doc(
            "'stdlib' (this Python's standard-library sources, one document per file), a "
            "prepared token store folder (tools.prepare_data: rank r reads only its rows), a "
            "local .jsonl/.json/.parquet/.txt file or folder, or a Hugging Face hub name."
        ),
    )
    subset: str = field(
        default="", metadata=doc("Hub sources: the dataset configuration (e.g. 'en' for C4).")
    )
    split: str = field(default="train", metadata=doc("Hub sources: the split to read."))
    data_files: list[str] = field(
        default_factory=list,
        metadata=doc("Hub sources: only these data files (globs within the dataset repo)."),
    )
    sources: list[DataSourceEntry] = field(
        default_factory=list,
        metadata=doc(
            "[[data.sources]]: a weighted mix of sources (replaces data.source); rows are "
            "interleaved with exact proportions over each mix_window rows."
        ),
    )
    mix_window: int = field(
        default=1000,
        metadata=doc("Rows over which [[data.sources]] proportions are exact."),
    )
    packing: Literal["concat", "bfd", "none"] = field(
        default="concat",
        metadata=doc(
            "concat: concatenate and split (torchtitan's way); bfd: best-fit-decreasing over "
            "a window (no split unless a document exceeds seq_len); none: one document per "
            "row, padded."
        ),
    )
    text_field: str = field(default="text", metadata=doc("Record field holding the text."))
    window: int = field(
        default=256,
        metadata=doc(
            "bfd only: documents packed together per round (memory: their tokens). Larger "
            "windows pad less; 256 pads < 0.1% on the standard-library corpus at 2048."
        ),
    )
    bad_records: Literal["skip", "fail"] = field(
        default="skip",
        metadata=doc(
            "Undecodable lines, records without a string text_field, and empty documents: "
            "skip and count them (reported by tools.packstats and the loader), or stop with "
            "an error naming the record."
        ),
    )
    streaming: Literal["auto", "always", "never"] = field(
        default="auto",
        metadata=doc(
            "Read local files as a stream instead of converting them to a memory-mapped "
            "Arrow cache; auto = stream above 1 GiB. Streaming resumes by re-reading the "
            "records before the saved position."
        ),
    )

    format: Literal["text", "sft"] = field(
        default="text",
        metadata=doc(
            "text: documents (pretraining). sft: JSON Lines of chats ({'messages': [{'role', "
            "'content'}]}) or {'prompt', 'completion'} pairs, optional 'weight'; loss only on "
            "assistant tokens (data.chat, docs/sft.md). Local .jsonl files or folders."
        ),
    )
    chat_template: Literal["auto", "embedded", "hf"] = field(
        default="auto",
        metadata=doc(
            "sft: auto = the tokenizer's own chat template (Hugging Face apply_chat_template) "
            "where it has one, else the documented embedded template; or force either."
        ),
    )
    truncate: bool = field(
        default=False,
        metadata=doc(
            "sft: cut examples longer than seq_len + 1 tokens to fit a row; false = such "
            "examples are bad records ('too_long', skipped and counted or fatal)."
        ),
    )
    eval_source: str = field(
        default="",
        metadata=doc(
            "sft: held-out JSON Lines scored before and after training by exact match of the "
            "assistant answer under greedy decoding (posttrain.evaluate); '' = none."
        ),
    )

    def __post_init__(self) -> None:
        _positive("window", self.window)
        _positive("mix_window", self.mix_window)
        if self.sources and self.source != "stdlib":
            raise ConfigError("set either data.source or [[data.sources]], not both", key="sources")
        if self.sources and self.mix_window < len(self.sources):
            raise ConfigError(
                f"expected at least one row per source ({len(self.sources)}), got "
                f"{self.mix_window}",
                key="mix_window",
            )


@dataclass
class CheckpointSection:
    folder: str = field(
        default="",
        metadata=doc("Checkpoint folder; '' = <job.output_dir>/checkpoint. Relative to cwd."),
    )
    interval: int = field(default=0, metadata=doc("Save every N steps; 0 = never."))
    resume: bool = field(
        default=True, metadata=doc("Resume from the latest complete checkpoint if one exists.")
    )
    keep_latest: int = field(default=2, metadata=doc("Checkpoints kept; 0 = keep all."))
    load_from: str = field(
        default="",
        metadata=doc(
            "A checkpoint folder (a step-N folder) to initialise the model from when no "
            "checkpoint of this run exists (e.g. a seed checkpoint); model weights only."
        ),
    )

    checksums: bool = field(
        default=True,
        metadata=doc(
            "CRC32 of every checkpoint file, written in its manifest and checked on load "
            "(about 1 GB/s per core; each rank reads its share). Sizes are always checked."
        ),
    )
    load_hf: str = field(
        default="",
        metadata=doc(
            "A Hugging Face folder (config.json + *.safetensors) to initialise the model from "
            "when no checkpoint of this run exists, through torchtitan's state-dict adapter. "
            "Its config.json must describe the recipe's model (checked before start)."
        ),
    )
    export_hf: bool = field(
        default=False,
        metadata=doc(
            "Write a Hugging Face folder (safetensors + config.json + tokenizer files) of the "
            "model at the end of training, under export_folder/step-N."
        ),
    )
    export_hf_every_checkpoint: bool = field(
        default=False,
        metadata=doc("With export_hf: also export at every interval checkpoint."),
    )
    export_dtype: Literal["bfloat16", "float32"] = field(
        default="bfloat16", metadata=doc("dtype of exported Hugging Face weights.")
    )
    export_folder: str = field(
        default="",
        metadata=doc("Folder for Hugging Face exports; '' = <job.output_dir>/hf."),
    )
    async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = field(
        default="disabled",
        metadata=doc(
            "torchtitan's checkpoint mode: disabled (save blocks training), async (a thread "
            "writes while training goes on), async_with_pinned_mem (CUDA: staged to pinned "
            "memory, written by a process). Async saves commit atomically (manifest, "
            "rename) once written; the last step's save is always synchronous."
        ),
    )

    def __post_init__(self) -> None:
        _positive("interval", self.interval, allow_zero=True)
        _positive("keep_latest", self.keep_latest, allow_zero=True)
        for key in ("folder", "export_folder", "load_from", "load_hf"):
            check_text(getattr(self, key), key=key, what="a path")
        if self.keep_latest == 1:
            # The newest checkpoint may still be being written; the one before must survive.
            raise ConfigError("expected 0 (keep all) or at least 2, got 1", key="keep_latest")
        if self.load_hf and self.load_from:
            raise ConfigError(
                "load_from and load_hf both set; the model starts from one of them",
                key="load_hf",
            )
        if self.export_hf_every_checkpoint and not self.export_hf:
            raise ConfigError("needs export_hf = true", key="export_hf_every_checkpoint")

    @property
    def enabled(self) -> bool:
        """Whether torchtitan's checkpointer runs (saves at the last step at least)."""
        return self.interval > 0 or bool(self.load_from or self.load_hf) or self.export_hf


@dataclass
class MetricsSection:
    log_every: int = field(default=1, metadata=doc("Log metrics every N steps."))
    tensorboard: bool = field(default=True, metadata=doc("Write TensorBoard events."))
    jsonl: bool = field(default=True, metadata=doc("Write metrics.jsonl, one object per log."))
    summary_skip_steps: int = field(
        default=2,
        metadata=doc(
            "Warmup steps excluded from the steady-state summary (compilation, allocator "
            "warmup, first collectives)."
        ),
    )

    wandb: bool = field(
        default=False,
        metadata=doc(
            "Log to Weights & Biases (torchtitan's logger) from the metrics rank. "
            "WANDB_MODE=offline writes the run under <output_dir>/tb/ for `wandb sync`. "
            "A restarted or requeued job continues the same run (id kept in "
            "<output_dir>/wandb_run_id)."
        ),
    )
    wandb_project: str = field(default="titanscale", metadata=doc("W&B project."))
    wandb_entity: str = field(
        default="", metadata=doc("W&B entity (team or user); '' = the account's default.")
    )
    wandb_run_name: str = field(default="", metadata=doc("W&B run name; '' = job.name."))
    straggler_ratio: float = field(
        default=1.5,
        metadata=doc(
            "A rank whose step time exceeds this many times the median rank's, for "
            "`straggler_steps` logged steps in a row, is named in metrics.jsonl "
            "(straggler_rank) and the log (runtime.stragglers); 0 = off. > 1 otherwise."
        ),
    )
    straggler_steps: int = field(
        default=3, metadata=doc("Consecutive slow logged steps before a rank is named.")
    )

    def __post_init__(self) -> None:
        _positive("log_every", self.log_every)
        _positive("summary_skip_steps", self.summary_skip_steps, allow_zero=True)
        r = self.straggler_ratio
        if r != 0 and not 1.0 < r <= 100.0:  # nan fails both comparisons
            raise ConfigError(
                f"expected 0 (off) or a ratio in (1, 100], got {r}", key="straggler_ratio"
            )
        _positive("straggler_steps", self.straggler_steps)


@dataclass
class RLSection:
    """Reinforcement learning (rl/): a generator samples, an environment rewards, a loss
    trains. Off unless `enabled`; training.steps counts RL updates."""

    enabled: bool = field(default=False, metadata=doc("Train with RL instead of the data loader."))
    env: str = field(
        default="arithmetic",
        metadata=doc(
            "Environment: 'arithmetic', 'letter_sort', 'chain_sum' (multi-turn), or "
            "'module:factory' returning an object with tasks(split, n, seed) and "
            "reward(task, completion), or, multi-turn, reply(task, turns) -> rl.envs.Reply "
            "(the model's turns are trained, the replies are context; docs/rl.md)."
        ),
    )
    reward: str = field(
        default="",
        metadata=doc("'module:function' (task, completion) -> float replacing env's reward."),
    )
    loss: Literal[
        "grpo",
        "cispo",
        "dppo",
        "ppo",
        "importance_sampling",
        "cross_entropy",
        "dro",
        "gspo",
        "stable_reinforce",
        "custom",
    ] = field(default="grpo", metadata=doc("Policy loss (rl/losses.py, docs/rl.md)."))
    custom_loss: str = field(
        default="",
        metadata=doc("loss = 'custom': 'module:function' (logprobs, batch) -> scalar tensor."),
    )
    prompts_per_step: int = field(default=8, metadata=doc("Prompts (groups) per update."))
    group_size: int = field(
        default=4, metadata=doc("Samples per prompt; advantages are normalised per group.")
    )
    max_new_tokens: int = field(
        default=8, metadata=doc("Completion length limit (multi-turn: per turn).")
    )
    max_turns: int = field(
        default=8,
        metadata=doc(
            "Multi-turn environments: most model turns per episode (an episode also ends when "
            "the environment's reply is None or another turn would not fit training.seq_len)."
        ),
    )
    temperature: float = field(default=1.0, metadata=doc("Sampling temperature (> 0)."))
    top_p: float = field(default=1.0, metadata=doc("Nucleus sampling mass in (0, 1]."))
    clip_low: float = field(
        default=0.2,
        metadata=doc(
            "Ratio clip below 1 (ppo/grpo/cispo/dppo/gspo; stable_reinforce: tokens whose "
            "ratio leaves [1 - clip_low, 1 + clip_high] carry no gradient)."
        ),
    )
    clip_high: float = field(default=0.2, metadata=doc("Ratio clip above 1."))
    kl_coef: float = field(
        default=0.0, metadata=doc("GRPO: weight of KL(pi || initial policy); 0 = no reference.")
    )
    normalize_std: bool = field(
        default=True, metadata=doc("Divide group advantages by the group's std (GRPO).")
    )
    tis_cap: float = field(
        default=0.0,
        metadata=doc(
            "Truncated importance weights min(pi_old / mu, cap) on every token's loss: the "
            "correction for train/inference mismatch and policy lag; 0 = off."
        ),
    )
    routing_replay: bool = field(
        default=False,
        metadata=doc(
            "MoE bases: Rollout Routing Replay (R3, arXiv:2510.11370): the trainer's forwards "
            "use the top-k experts the generator chose for each token and MoE layer; gate "
            "weights are still computed from the current router (docs/rl.md). Metrics per "
            "update either way: router_agreement, train_infer_kl_replay / _no_replay."
        ),
    )
    mode: Literal["sync", "async"] = field(
        default="sync",
        metadata=doc(
            "sync: generate, then train, in turn. async: a generator thread runs ahead of the "
            "trainer by at most max_policy_lag weight versions."
        ),
    )
    max_policy_lag: int = field(
        default=1, metadata=doc("async: most weight versions a trained sample may lag.")
    )
    generator_dtype: Literal["float32", "bfloat16"] = field(
        default="float32", metadata=doc("The generator's weight and compute dtype.")
    )
    generator: Literal["native", "vllm"] = field(
        default="native",
        metadata=doc(
            "native: the KV-cache generator on the torchtitan model; vllm: a vLLM engine "
            "process (`bash scripts/setup.sh --vllm` first; docs/vllm.md)."
        ),
    )
    weight_sync: Literal["auto", "shm", "nccl"] = field(
        default="auto",
        metadata=doc(
            "generator = 'vllm': how full-weight pushes reach the engine. shm: a safetensors "
            "file in shared memory; nccl: NCCL broadcasts from the trainer's rank to the "
            "engine's workers (CUDA, and the engine on its own GPUs: rl.engine_gpus); auto: "
            "nccl when both hold, else shm. LoRA adapter pushes are PEFT folders either way "
            "(vLLM loads adapters from folders). docs/vllm.md."
        ),
    )
    engine_gpus: str = field(
        default="",
        metadata=doc(
            "generator = 'vllm' on CUDA: the GPUs the engine process uses, as "
            "CUDA_VISIBLE_DEVICES ('6,7'; its tensor-parallel size is their count), none of "
            "them a trainer rank's; one trainer rank only; '' = the trainer rank's own GPU, "
            "shared."
        ),
    )
    sft_warmup_steps: int = field(
        default=0,
        metadata=doc(
            "Supervised steps on the environment's reference answers before RL (a stand-in "
            "for starting from an SFT checkpoint)."
        ),
    )
    sft_warmup_lr: float = field(
        default=1e-3, metadata=doc("Learning rate of the supervised warmup (AdamW).")
    )
    eval_every: int = field(
        default=10, metadata=doc("Held-out evaluation every N updates (and at start/end).")
    )
    eval_prompts: int = field(default=64, metadata=doc("Held-out prompts per evaluation."))
    on_error: Literal["skip", "fail"] = field(
        default="skip",
        metadata=doc(
            "A rollout or reward function that raises: skip its group and count it in "
            "rollout_errors, or stop the run (after saving a checkpoint)."
        ),
    )
    seed: int = field(default=0, metadata=doc("Seed for prompts and sampling."))
    hook_timeout_s: float = field(
        default=60.0,
        metadata=doc(
            "Seconds a user hook (the environment's tasks(), a reward) may take per call "
            "before it fails like a hook that raised (rl.on_error applies); 0 = no limit, "
            "else 0.001 to 1e6 (rl/hooks.py)."
        ),
    )

    def __post_init__(self) -> None:
        t = self.hook_timeout_s
        if t != 0 and not 1e-3 <= t <= 1e6:  # nan fails both comparisons
            # Below a millisecond the thread hand-off alone overruns it; above 1e6 s (11 days)
            # it is no limit (and past ~1e9 s threading's wait overflows).
            raise ConfigError(
                f"expected 0 (no limit) or 0.001 to 1e6 seconds, got {t}", key="hook_timeout_s"
            )
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_turns", "eval_every"):
            _positive(name, getattr(self, name))
        _positive("eval_prompts", self.eval_prompts, allow_zero=True)
        _positive("temperature", self.temperature)
        _positive("sft_warmup_lr", self.sft_warmup_lr)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"expected a value in (0, 1], got {self.top_p}", key="top_p")
        for name in ("clip_low", "clip_high", "kl_coef", "tis_cap", "sft_warmup_steps"):
            _positive(name, getattr(self, name), allow_zero=True)
        _positive("max_policy_lag", self.max_policy_lag, allow_zero=True)
        if self.loss == "custom" and not self.custom_loss:
            raise ConfigError("loss = 'custom' needs custom_loss = 'module:function'", key="loss")
        gpus = self.engine_gpus.split(",") if self.engine_gpus else []
        if any(not g.strip().isdigit() for g in gpus) or len(set(gpus)) != len(gpus):
            raise ConfigError(
                f"expected distinct GPU indices separated by commas ('6,7'), got "
                f"{self.engine_gpus!r}",
                key="engine_gpus",
            )
        if self.env == "chain_sum" and self.reward:
            raise ConfigError(
                "env 'chain_sum' is multi-turn (its replies give the episode's reward); "
                "expected reward = '' (rl.reward replaces single-turn rewards only)",
                key="reward",
            )


@dataclass
class FaultToleranceSection:
    """Per-replica-group fault tolerance with torchft (docs/fault_tolerance.md): HSDP
    replica groups leave and rejoin per step while the others train on."""

    enabled: bool = field(
        default=False,
        metadata=doc(
            "Train as `replica_groups` torchft replica groups (torchtitan's "
            "experiments/torchft components, runtime/fault_tolerance.py): a group that dies "
            "is restarted alone and heals from a live group. Start them with "
            "`tools.launch` (a Slurm job step per group) or `tools.launch --local`; FSDP-only "
            "pretraining, every step synchronous."
        ),
    )
    replica_groups: int = field(
        default=0,
        metadata=doc(
            "Replica groups (each a torchrun of world_size / replica_groups ranks holding one "
            "copy of the model, FSDP-sharded inside); 0 = parallel.dp_replicate. At least 2."
        ),
    )
    lighthouse: str = field(
        default="",
        metadata=doc(
            "torchft lighthouse address (http://host:port) for groups started by hand; "
            "TORCHFT_LIGHTHOUSE wins (tools.launch starts one and sets it)."
        ),
    )
    min_replicas: int = field(
        default=1,
        metadata=doc("Fewest live replica groups a step may commit with (torchft quorum)."),
    )
    quorum_timeout_s: int = field(
        default=60,
        metadata=doc(
            "Seconds a group waits for the quorum (and its collectives for a dead peer) "
            "before the step is abandoned and retried without the missing group."
        ),
    )
    semi_sync: Literal["off", "diloco", "local_sgd"] = field(
        default="off",
        metadata=doc(
            "off: every step all-reduces gradients across groups. diloco / local_sgd "
            "(torchft.local_sgd): groups train alone and synchronise every `sync_steps`."
        ),
    )
    sync_steps: int = field(
        default=5, metadata=doc("Semi-synchronous modes: inner steps between synchronisations.")
    )

    def __post_init__(self) -> None:
        _positive("replica_groups", self.replica_groups, allow_zero=True)
        _positive("min_replicas", self.min_replicas)
        _positive("quorum_timeout_s", self.quorum_timeout_s)
        _positive("sync_steps", self.sync_steps)
        # Written into job scripts and environment variables: host names and a port only.
        if self.lighthouse and not re.fullmatch(
            r"https?://[A-Za-z0-9.\-]+:[0-9]{1,5}", self.lighthouse
        ):
            raise ConfigError(
                f"expected http://host:port, got {shown(self.lighthouse)}", key="lighthouse"
            )


@dataclass
class FinetuneSection:
    mode: Literal["off", "full", "lora"] = field(
        default="off",
        metadata=doc(
            "off: pretraining. full: every weight trained (SFT on a loaded base). lora: the "
            "base frozen, only [lora] adapters trained (torchtitan's LoRA converter); the "
            "optimizer holds adapter parameters only. full/lora need data.format = 'sft' or a "
            "checkpoint.load_from base."
        ),
    )
    export_dir: str = field(
        default="{output_dir}/export",
        metadata=doc(
            "Where exports go after training: <dir>/<adapter>/adapter_model.safetensors + "
            "adapter_config.json (PEFT format) for LoRA; '{output_dir}' = job.output_dir."
        ),
    )
    export_merged: bool = field(
        default=False,
        metadata=doc(
            "Also write the merged model (base + scale * B A) as a Hugging Face folder "
            "(safetensors + index, config.json, tokenizer files: the full export's writer, "
            "runtime.hf.write_hf_weights) in each adapter's merged/ subfolder."
        ),
    )
    eval_every: int = field(
        default=0,
        metadata=doc("Held-out exact match every N steps too (0 = at start and end only)."),
    )
    adapter_schedule: Literal["turns", "batched"] = field(
        default="turns",
        metadata=doc(
            "[[adapters]]: 'turns' = adapters take turns on the shared base (each exactly as "
            "if alone); 'batched' = one forward over every adapter's rows with a segmented "
            "multi-LoRA matmul (benchmarks/adapters.md compares them)."
        ),
    )

    def __post_init__(self) -> None:
        _positive("eval_every", self.eval_every, allow_zero=True)
        check_text(self.export_dir, key="export_dir", what="a path")  # a folder we create


# Last names of the Linear layers in torchtitan's llama3 and qwen3 decoders (fused or
# separate attention projections); tests/unit/test_reliability_adapters.py checks them
# against the models' config trees.
# "experts": the routed experts of MoE layers (runtime.moe_experts: one low-rank pair per
# expert and projection, through the grouped GEMM); w1/w2/w3 also match shared experts.
LORA_TARGETS = ("wqkv", "wq", "wkv", "wk", "wv", "wo", "w1", "w2", "w3", "lm_head", "experts")
MAX_ADAPTER_NAME = 128


@dataclass
class LoraSection:
    rank: int = field(default=8, metadata=doc("Rank r of the adapter matrices A (r x in), B."))
    alpha: float = field(default=16.0, metadata=doc("Scale: the adapter adds alpha/r * B A x."))
    dropout: float = field(
        default=0.0,
        metadata=doc(
            "Dropout on the adapter's input; torchtitan 0.3.0's LoRA layer has none, so only "
            "0.0 is accepted (a non-zero value stops at load instead of being ignored)."
        ),
    )
    target_modules: list[str] = field(
        default_factory=lambda: ["wqkv", "wq", "wkv", "wk", "wv", "wo", "w1", "w2", "w3"],
        metadata=doc(
            "Linear layers to adapt, by the last name in torchtitan's module path (attention "
            "wqkv/wq/wkv/wk/wv/wo, MLP and MoE shared-expert w1/w2/w3, lm_head), and "
            "'experts': every MoE layer's routed experts (one pair per expert, rank a "
            "multiple of 8); other names are refused, names absent from the model are "
            "ignored, and at least one must be in it. MoE routers stay frozen."
        ),
    )

    def __post_init__(self) -> None:
        _positive("rank", self.rank)
        _positive("alpha", self.alpha)
        if self.dropout != 0.0:
            raise ConfigError(
                f"expected 0.0, got {self.dropout}: torchtitan 0.3.0's LoRA layer has no dropout",
                key="dropout",
            )
        if not self.target_modules:
            raise ConfigError("expected at least one module name", key="target_modules")
        if "experts" in self.target_modules and self.rank % 8:
            # torch._grouped_mm: every row stride a multiple of 16 bytes (8 bfloat16 values)
            raise ConfigError(
                f"expected a multiple of 8 with target 'experts' (grouped GEMM), got {self.rank}",
                key="rank",
            )
        for name in self.target_modules:
            # torchtitan's LoRA converter only warns for a name it does not find; with no
            # match at all the optimizer later fails on an empty parameter list.
            if name not in LORA_TARGETS:
                raise ConfigError(
                    f"unknown module {name!r}{did_you_mean(name, LORA_TARGETS)}; known: "
                    f"{', '.join(LORA_TARGETS)}",
                    key="target_modules",
                )


@dataclass
class AdapterSection:
    name: str = field(default="", metadata=doc("Adapter name (export folder, metrics prefix)."))
    source: str = field(default="", metadata=doc("This adapter's SFT data (JSON Lines)."))
    eval_source: str = field(default="", metadata=doc("Held-out JSON Lines ('' = none)."))
    lr: float = field(default=1e-3, metadata=doc("Peak learning rate (AdamW, own state)."))
    steps: int = field(default=10, metadata=doc("Optimizer steps for this adapter."))
    warmup_steps: int = field(default=0, metadata=doc("Linear warmup steps."))
    local_batch_size: int = field(
        default=0, metadata=doc("Rows per step and process; 0 = training's.")
    )
    seed: int = field(default=0, metadata=doc("Adapter initialisation seed."))

    def __post_init__(self) -> None:
        # A folder name under <output_dir>/adapters and an export folder: ASCII (a letter
        # may take 4 bytes in UTF-8) and at most MAX_ADAPTER_NAME characters (file names
        # end at 255 bytes: 300 characters was "OSError: File name too long").
        plain = self.name.replace("_", "").replace("-", "")
        if not plain or not plain.isascii() or not plain.isalnum():
            raise ConfigError(
                f"expected a name of ASCII letters, digits, _ or -, got {shown(self.name)}",
                key="name",
            )
        if len(self.name) > MAX_ADAPTER_NAME:
            raise ConfigError(
                f"expected at most {MAX_ADAPTER_NAME} characters, got {len(self.name)}",
                key="name",
            )
        if not self.source:
            raise ConfigError("expected a data source", key="source")
        _positive("lr", self.lr)
        _positive("steps", self.steps)
        _positive("warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("local_batch_size", self.local_batch_size, allow_zero=True)
        if self.warmup_steps > self.steps:  # as [training] refuses it
            raise ConfigError(
                f"warmup_steps ({self.warmup_steps}) exceeds steps ({self.steps})",
                key="warmup_steps",
            )


@dataclass
class ValidationSection:
    enable: bool = field(default=False, metadata=doc("Run torchtitan's validator."))
    source: str = field(
        default="",
        metadata=doc(
            "Held-out data, in the forms [data] source takes; '' = data.source read from its "
            "start (measures fit to seen data, not generalisation)."
        ),
    )
    text_field: str = field(default="text", metadata=doc("Record field holding the text."))
    every: int = field(
        default=100, metadata=doc("Validate at step 1 and every N steps (torchtitan's freq).")
    )
    steps: int = field(
        default=10,
        metadata=doc(
            "Batches (of training.local_batch_size sequences per data-parallel rank) per "
            "validation; the same rows every time."
        ),
    )

    def __post_init__(self) -> None:
        _positive("every", self.every)
        _positive("steps", self.steps)


@dataclass
class ProfilingSection:
    trace: bool = field(
        default=False,
        metadata=doc(
            "torch.profiler traces (torchtitan's profiler): one active step every `every` "
            "steps after `warmup` profiled-but-discarded steps, written to "
            "<output_dir>/profiling/traces/iteration_N/rankR_trace.json.gz (chrome://tracing, "
            "Perfetto)."
        ),
    )
    every: int = field(default=100, metadata=doc("Steps between traces (and snapshots)."))
    warmup: int = field(
        default=3, metadata=doc("Profiler warmup steps before each traced step; < every.")
    )
    memory_snapshot: bool = field(
        default=False,
        metadata=doc(
            "CUDA allocator snapshots every `memory_snapshot_every` steps and at an out-of-"
            "memory error, to <output_dir>/profiling/memory_snapshot "
            "(https://pytorch.org/memory_viz). CUDA only."
        ),
    )
    memory_snapshot_every: int = field(
        default=0, metadata=doc("Steps between memory snapshots; 0 = `every`.")
    )

    def __post_init__(self) -> None:
        _positive("every", self.every)
        _positive("warmup", self.warmup, allow_zero=True)
        _positive("memory_snapshot_every", self.memory_snapshot_every, allow_zero=True)
        if self.trace and self.warmup + 1 > self.every:
            raise ConfigError(
                f"a trace needs warmup ({self.warmup}) + 1 traced step <= every ({self.every})",
                key="warmup",
            )


@dataclass
class Recipe:
    """A whole recipe. `source` is the file it came from (for error messages)."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    moe: MoeSection = field(default_factory=MoeSection)
    kernels: KernelsSection = field(default_factory=KernelsSection)
    data: DataSection = field(default_factory=DataSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    rl: RLSection = field(default_factory=RLSection)
    fault_tolerance: FaultToleranceSection = field(default_factory=FaultToleranceSection)
    finetune: FinetuneSection = field(default_factory=FinetuneSection)
    lora: LoraSection = field(default_factory=LoraSection)
    adapters: list[AdapterSection] = field(
        default_factory=list,
        metadata=doc(
            "[[adapters]]: several LoRA adapters trained on one frozen base in one job "
            "(finetune.mode = 'lora'), each with its own data, lr, steps, optimizer state, "
            "metrics and exports (posttrain.adapters)."
        ),
    )
    validation: ValidationSection = field(default_factory=ValidationSection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
    torchtitan: dict[str, Any] = field(
        default_factory=dict,
        metadata=doc(
            "Escape hatch: dotted keys into torchtitan's Trainer.Config (e.g. "
            "'training.gc_freq' = 50), applied last, over what the sections above set; "
            "each checked against torchtitan's dataclasses before start (unknown key or "
            "wrong type: exit 2). For options without a titanscale key."
        ),
    )
    source: str = field(default="<defaults>", init=False, compare=False)
    # dotted key -> where its value came from (this file, a base file, `--set k=v`), for
    # error messages (recipe.loader.blame).
    origins: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def output_dir(self) -> str:
        return self.job.output_dir.replace("{name}", self.job.name)

    @property
    def checkpoint_dir(self) -> str:
        import os

        return self.checkpoint.folder or os.path.join(self.output_dir, "checkpoint")

    @property
    def export_dir(self) -> str:
        import os

        return self.checkpoint.export_folder or os.path.join(self.output_dir, "hf")
