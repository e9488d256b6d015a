"""The trainer's side of the vLLM engine: start the engine process, sample, push weights.

vLLM runs in its own environment (.venv-vllm, `bash scripts/setup.sh --vllm`) and process
(rl/vllm_server.py): its torch and transformers pins differ from the trainer's. This module
starts that process on a Unix socket with a random key, sends it token-id prompts and receives
sampled token ids with their logprobs; `VllmGenerator` gives it the `Generator` interface the
RL loop uses (`generate`, `update_weights`, `stage_weights`, `latest_version`, `version`).

Weights travel as files in shared memory (/dev/shm when it exists): the trainer writes the
Hugging Face-named tensors (torchtitan's own state-dict adapter, `to_hf`) to a safetensors file
and the engine loads it into the running model (`load_weights`), or a PEFT adapter folder
(posttrain.lora.export_peft) that the engine loads as a LoRA adapter under a new id per version.
`bytes_sent` counts every byte written for the engine. On CUDA with the engine on its own
GPUs (rl.engine_gpus), full weights may go over NCCL instead (rl.weight_sync, `resolve_sync`):
the trainer's rank and the engine's workers form one group (rl/weight_sync.py, the protocol
both sides run) and each push is a manifest over the socket plus bucketed broadcasts; LoRA
adapters stay PEFT folders (vLLM loads adapters from folders). Unverified on a GPU here.

Failures: a missing environment is a ConfigError naming the setup command (exit 2 before any
process group); an engine process that dies or stops answering is an `EngineError` (one line,
exit 2 from train.py) raised by the call that found it; the RL loop checkpoints the last
completed update first, so the rerun resumes from it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

import torch

from core.errors import ConfigError
from rl.generator import Sample, SamplingParams, StagedWeights
from rl.weight_sync import BUCKET_BYTES

ROOT = Path(__file__).resolve().parent.parent
SETUP = "bash scripts/setup.sh --vllm"
# The engine's Python: .venv-vllm beside this checkout, or TITANSCALE_VLLM_PYTHON.
PYTHON_ENV = "TITANSCALE_VLLM_PYTHON"
SERVER = Path(__file__).resolve().parent / "vllm_server.py"


class EngineError(ConfigError):
    """The engine process died, refused to start or failed a request (one line)."""


def engine_python() -> str | None:
    """The engine environment's python, or None when it is not installed."""
    p = os.environ.get(PYTHON_ENV) or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not os.path.isfile(p) or not (Path(p).parent.parent / ".titanscale-engine").is_file():
        return None
    return p


def require_engine(*, file: str | None, key: str) -> str:
    py = engine_python()
    if py is None:
        raise ConfigError(
            f"the vLLM engine environment is not installed (.venv-vllm); run `{SETUP}`",
            file=file,
            key=key,
        )
    return py


def resolve_sync(rl: Any, *, cuda: bool, world_size: int, file: str | None = None) -> str:
    """rl.weight_sync on this machine: "nccl" or "shm" ("auto": nccl on CUDA with the
    engine on its own GPUs and one trainer rank, else shm). ConfigError names the key when
    "nccl" cannot work (no CUDA, no GPUs of the engine's own: NCCL refuses two ranks on one
    GPU), and rl.engine_gpus when it cannot: without CUDA or vLLM, or with several trainer
    ranks (each starts its own engine, so they would share those GPUs; not built)."""
    want = rl.weight_sync
    if rl.engine_gpus and (rl.generator != "vllm" or not cuda or world_size > 1):
        why = (
            "rl.generator = 'vllm'"
            if rl.generator != "vllm"
            else "CUDA (this machine has none)"
            if not cuda
            else f"one trainer rank (this run has {world_size}, each would start an engine)"
        )
        raise ConfigError(f"engine GPUs need {why}; expected ''", file=file, key="rl.engine_gpus")
    ok = rl.generator == "vllm" and cuda and bool(rl.engine_gpus)
    if want == "nccl" and not ok:
        if not cuda:
            why = "CUDA (this machine has no GPU)"
        elif rl.generator != "vllm":
            why = "rl.generator = 'vllm'"
        else:
            why = (
                "the engine on GPUs of its own (rl.engine_gpus; NCCL refuses two ranks on one GPU)"
            )
        raise ConfigError(
            f"'nccl' needs {why}; expected 'auto' or 'shm'", file=file, key="rl.weight_sync"
        )
    return "nccl" if want == "nccl" or (want == "auto" and ok) else "shm"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else ""


@dataclass
class EngineConfig:
    folder: str  # Hugging Face folder of the base model (config.json + safetensors)
    dtype: str = "float32"
    max_model_len: int = 512
    max_loras: int = 0  # > 0: LoRA adapters may be attached per request
    max_lora_rank: int = 8
    seed: int = 0
    kv_cache_gib: float = 1.0  # the engine's KV cache on CPU (VLLM_CPU_KVCACHE_SPACE, whole GiB)
    # CUDA: the share of the GPU's memory the engine may take (weights + KV cache). The
    # trainer shares the GPU, so not vLLM's default 0.9 (unverified: no GPU run yet).
    gpu_memory_utilization: float = 0.3
    max_num_seqs: int = 256
    # CUDA_VISIBLE_DEVICES for the engine ('' = inherited); tensor parallel over their count
    devices: str = ""
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0


class VllmEngine:
    """One engine process and the connection to it; every call is one request/reply."""

    def __init__(self, cfg: EngineConfig, *, file: str | None = None, key: str = "rl.generator"):
        self.cfg, self.file, self.key = cfg, file, key
        py = require_engine(file=file, key=key)
        self.workdir = tempfile.mkdtemp(prefix="titanscale-vllm-", dir=_shm_dir() or None)
        self.address = os.path.join(self.workdir, "engine.sock")
        authkey = secrets.token_bytes(16)
        env = dict(os.environ)
        env.update(
            TITANSCALE_ENGINE_KEY=authkey.hex(),
            VLLM_CPU_KVCACHE_SPACE=str(max(1, round(cfg.kv_cache_gib))),
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        )
        env.pop("PYTHONPATH", None)  # the trainer's packages are not the engine's
        if cfg.devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.devices
        self.log_path = os.path.join(self.workdir, "engine.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (the engine's, closed in close())
        self.proc = subprocess.Popen(
            [py, str(SERVER), self.address],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C to the trainer is the trainer's to handle
        )
        self._lock = threading.Lock()
        self.conn: Any = None
        deadline = time.monotonic() + cfg.startup_timeout_s
        while self.conn is None:
            self._check_alive("while starting")
            if os.path.exists(self.address):
                with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
                    self.conn = Client(self.address, family="AF_UNIX", authkey=authkey)
            if time.monotonic() > deadline:
                self.close()
                raise EngineError("the vLLM engine did not start in time", file=file, key=key)
            time.sleep(0.1)
        self.info = self.call(
            "init",
            config={
                "folder": cfg.folder,
                "dtype": cfg.dtype,
                "max_model_len": cfg.max_model_len,
                "max_loras": cfg.max_loras,
                "max_lora_rank": cfg.max_lora_rank,
                "seed": cfg.seed,
                "max_num_seqs": cfg.max_num_seqs,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "tensor_parallel_size": len(cfg.devices.split(",")) if cfg.devices else 1,
            },
            timeout=cfg.startup_timeout_s,
        )

    def _tail(self) -> str:
        try:
            lines = Path(self.log_path).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        errs = [x for x in lines if "Error" in x or "error" in x]
        return (errs or lines or [""])[-1][:300]

    def _check_alive(self, when: str) -> None:
        rc = self.proc.poll()
        if rc is not None:
            tail = self._tail()
            raise EngineError(
                f"the vLLM engine process exited (code {rc}) {when}"
                + (f": {tail}" if tail else ""),
                file=self.file,
                key=self.key,
            )

    def call(self, op: str, *, timeout: float | None = None, **kw: Any) -> Any:
        """One request; EngineError when the engine is gone or the request failed."""
        limit = timeout if timeout is not None else self.cfg.request_timeout_s
        with self._lock:
            self._check_alive(f"before '{op}'")
            try:
                self.conn.send({"op": op, **kw})
                deadline = time.monotonic() + limit
                while not self.conn.poll(0.2):
                    self._check_alive(f"during '{op}'")
                    if time.monotonic() > deadline:
                        raise EngineError(
                            f"the vLLM engine did not answer '{op}' in {limit:.0f} s",
                            file=self.file,
                            key=self.key,
                        )
                reply = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                time.sleep(0.2)  # let the exit status arrive
                self._check_alive(f"during '{op}'")
                raise EngineError(
                    f"the connection to the vLLM engine broke during '{op}'",
                    file=self.file,
                    key=self.key,
                ) from None
        if "error" in reply:
            raise EngineError(f"vLLM engine: {op}: {reply['error']}", file=self.file, key=self.key)
        return reply["ok"]

    def close(self) -> None:
        if self.conn is not None and self.proc.poll() is None:
            try:
                with self._lock:
                    self.conn.send({"op": "shutdown"})
                    self.conn.poll(5)
            except (OSError, EOFError):
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


# vLLM's CPU attention kernels take these head sizes only (vllm-cpu 0.32.0,
# CPUAttentionBackend.get_supported_head_sizes); torchtitan's debug models have 16.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def served_head_dim(head_dim: int, *, cpu: bool) -> int:
    """The head size the engine is given: the model's own, or on CPU, when the kernels lack
    it, the smallest head_dim * 4**m they take (a power-of-4 ratio keeps the score scale
    correction, sqrt(ratio), a power of two: exact in floating point). See `pad_heads`."""
    if not cpu or head_dim in CPU_HEAD_SIZES:
        return head_dim
    to = head_dim
    while to not in CPU_HEAD_SIZES:
        to *= 4
        if to > CPU_HEAD_SIZES[-1]:
            raise ValueError(f"head_dim {head_dim} cannot be served by vLLM's CPU kernels")
    return to


def _rope_rows(hd: int, to: int) -> torch.Tensor:
    """Where row r of an HF (rotate-half) q/k head goes in a head of `to` rows: RoPE pairs
    (i, i + hd/2) at frequency theta^(-2i/hd) land on (i*k, i*k + to/2), k = to/hd, whose
    frequency theta^(-2ik/to) is the same; the other rows stay zero and rotate among
    themselves (zero stays zero), so every score q.k is unchanged."""
    k, half = to // hd, hd // 2
    r = torch.arange(hd)
    return (r % half) * k + (r >= half).long() * (to // 2)


def pad_heads(
    hf: dict[str, torch.Tensor], *, n_heads: int, n_kv: int, hd: int, to: int
) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors (weights or PEFT lora_A/lora_B) with attention heads of
    `hd` rows zero-padded to `to` rows: queries scaled by sqrt(to/hd) so that vLLM's
    1/sqrt(to) score scale equals the model's 1/sqrt(hd); values padded at the end and the
    output projection's matching input columns zero. The padded model computes the same
    function (exactly, up to summation order)."""
    if to == hd:
        return hf
    rope = _rope_rows(hd, to)
    scale = float((to / hd) ** 0.5)  # a power of two (served_head_dim)
    out = {}
    for name, t in hf.items():
        which = next((w for w in ("q_proj", "k_proj", "v_proj", "o_proj") if f".{w}." in name), "")
        lora_a, lora_b = ".lora_A." in name, ".lora_B." in name
        if not which or (which != "o_proj" and lora_a) or (which == "o_proj" and lora_b):
            out[name] = t  # A of q/k/v and B of o act on the model width: unchanged
            continue
        heads = n_heads if which in ("q_proj", "o_proj") else n_kv
        rows = rope if which in ("q_proj", "k_proj") else torch.arange(hd)
        if which == "o_proj":  # (width, heads*hd): pad input columns
            w = t.reshape(t.shape[0], heads, hd)
            new = t.new_zeros(t.shape[0], heads, to)
            new[:, :, rows] = w
            out[name] = new.reshape(t.shape[0], heads * to)
            continue
        w = t.reshape(heads, hd, t.shape[-1])
        new = t.new_zeros(heads, to, t.shape[-1])
        new[:, rows] = w * scale if which == "q_proj" else w
        out[name] = new.reshape(heads * to, t.shape[-1])
    return out


@dataclass
class HFView:
    """How the engine sees a torchtitan model: Hugging Face names (torchtitan's state-dict
    adapter), float32, heads padded to `head_dim` (`pad_heads`) when the kernels need it."""

    model_config: Any
    state_dict_adapter: Any
    family: str = "llama3"
    head_dim: int = 0  # served head size; 0: the model's own

    def heads(self) -> tuple[int, int, int]:
        """(query heads, key/value heads, head size) of the model."""
        a = self.model_config.layers[0].attention
        n = a.n_heads
        return n, a.n_kv_heads or n, a.head_dim or self.model_config.dim // n

    def tensors(
        self,
        state_dict: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """The engine's tensors (float32 on the CPU for files; the engine's dtype on the
        trainer's GPU for NCCL)."""
        hf = self.state_dict_adapter.to_hf(
            {k: v for k, v in state_dict.items() if ".lora_" not in k}
        )
        return self.pad(
            {k: v.detach().to(device=device, dtype=dtype).contiguous() for k, v in hf.items()}
        )

    def pad(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF or PEFT tensors with heads padded to the served head size (`pad_heads`)."""
        n, kv, hd = self.heads()
        return pad_heads(hf, n_heads=n, n_kv=kv, hd=hd, to=self.head_dim or hd)

    def config(self) -> dict[str, Any]:
        from runtime.hf import hf_config

        cfg = hf_config(self.model_config, self.family, "float32")
        if self.head_dim:
            cfg["head_dim"] = self.head_dim
        return cfg

    def write_folder(self, folder: str, state_dict: dict[str, torch.Tensor]) -> int:
        """The model as a Hugging Face folder vLLM loads; returns the weight bytes written."""
        import json

        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "model.safetensors")
        save_file(self.tensors(state_dict), path)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.config(), f, indent=1)
        return os.path.getsize(path)

    def write_adapter(
        self, folder: str, adapter: dict[str, torch.Tensor], *, rank: int, alpha: float
    ) -> int:
        """A LoRA adapter (posttrain.lora names) as a PEFT folder (posttrain.lora.export_peft),
        heads padded like the base; returns the bytes written."""
        from safetensors.torch import load_file, save_file

        from posttrain.lora import PEFT_CONFIG, PEFT_WEIGHTS, export_peft

        export_peft(folder, model_config=self.model_config, adapter=adapter,
                    state_dict_adapter=self.state_dict_adapter, rank=rank, alpha=alpha)  # fmt: skip
        path = os.path.join(folder, PEFT_WEIGHTS)
        if self.head_dim and self.head_dim != self.heads()[2]:
            save_file(self.pad(load_file(path)), path)
        return os.path.getsize(path) + os.path.getsize(os.path.join(folder, PEFT_CONFIG))


class VllmGenerator(StagedWeights):
    """The RL loop's generator backed by a `VllmEngine` (rl.generator = "vllm").

    Full-weight updates go to the base model (a shared-memory file, or with `sync` a
    `WeightSync` group's broadcasts); `adapter=True` updates are a LoRA adapter's tensors
    only (posttrain.lora names), sent as a PEFT folder and used for every later request.
    Each sample carries the version of the weights it was drawn with."""

    def __init__(
        self,
        engine: VllmEngine,
        view: HFView,
        *,
        lora_rank: int = 0,
        lora_alpha: float = 0.0,
        sync: WeightSync | None = None,
    ) -> None:
        self.engine, self.view, self.sync = engine, view, sync
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.version = 0
        self.bytes_sent = 0  # weight bytes written for the engine since construction
        # prompt positions sent, and those the engine's prefix cache already held
        self.prompt_tokens = self.cached_prompt_tokens = 0
        self.lora: tuple[str, int, str] | None = None
        self._init_staging()
        self._lock = threading.Lock()

    # -- weights -----------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._send(state_dict, version)

    def _load(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._send(state_dict, version)

    def _send(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        adapter = bool(state_dict) and all(".lora_" in k for k in state_dict)
        if adapter:
            self._send_adapter(state_dict, version)
        elif self.sync is not None:
            self.bytes_sent += self.sync.push(self.view, state_dict, version)
        else:
            from safetensors.torch import save_file

            path = os.path.join(self.engine.workdir, f"weights-{version}.safetensors")
            save_file(self.view.tensors(state_dict), path)
            self.bytes_sent += os.path.getsize(path)
            try:
                self.engine.call("load_weights", path=path)
            finally:
                os.unlink(path)
        self.version = version

    def _send_adapter(self, adapter: dict[str, torch.Tensor], version: int) -> None:
        folder = os.path.join(self.engine.workdir, f"adapter-{version}")
        self.bytes_sent += self.view.write_adapter(
            folder, adapter, rank=self.lora_rank, alpha=self.lora_alpha
        )
        old = self.lora
        # A new id per version: vLLM caches an adapter by id, so reusing one would serve the
        # old tensors.
        self.lora = (f"policy-v{version}", version + 1, folder)
        if old is not None:
            self.engine.call("remove_lora", id=old[1])
            shutil.rmtree(old[2], ignore_errors=True)

    # -- sampling ------------------------------------------------------------------------
    @staticmethod
    def _seed(seed: int | None, i: int) -> int | None:
        """Prompt i's seed: vLLM seeds each request's own generator and its n samples take
        seed + k, so prompts' seeds are spread 65,537 apart to never share a stream."""
        return None if seed is None else (seed * 1_000_003 + i * 65_537) % 2**63

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Sample]:
        if any(not p for p in prompts):
            raise ValueError("empty prompt")
        if params.stop_strings:
            raise ValueError("stop strings are not supported by the vLLM generator (token ids)")
        with self._lock:
            self._apply_pending()
            version = self.version
            reqs = [
                {
                    "prompt": p,
                    "n": params.n,
                    "max_tokens": params.max_tokens,
                    "temperature": params.temperature,
                    "top_p": params.top_p,
                    "top_k": params.top_k,
                    "seed": self._seed(params.seed, i),
                    "stop_token_ids": list(params.stop_tokens),
                    "lora": self.lora,
                }
                for i, p in enumerate(prompts)
            ]
            outs = self.engine.call("generate", requests=reqs)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.cached_prompt_tokens += sum(g[0]["cached"] for g in outs if g)
        return [
            Sample(i, s["tokens"], s["logprobs"], "stop" if s["finish"] == "stop" else "length",
                   version)
            for i, group in enumerate(outs)
            for s in group
        ]  # fmt: skip

    def score(
        self, prompts: list[list[int]], completions: list[list[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """Teacher-forced logprobs of completions through the engine (temperature 1 only:
        vLLM's prompt logprobs are of the raw distribution)."""
        if temperature != 1.0:
            raise ValueError("vLLM scoring is at temperature 1 only")
        with self._lock:
            self._apply_pending()
            seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
            return self.engine.call("score", seqs=seqs, starts=[len(p) for p in prompts])

    def close(self) -> None:
        self.sync = None  # the group before the engine: its peer is about to go
        self.engine.close()


class WeightSync:
    """The trainer's end of the collective weight push (rl.weight_sync = "nccl"): rank 0 of
    a group with the engine's workers (rl/weight_sync.py). Set up once (`open`); each `push`
    sends the manifest over the engine's socket (the engine's workers then receive) while
    this thread broadcasts, both running the one protocol module."""

    def __init__(self, engine: Any, backend: str, dtype: torch.dtype, device: torch.device,
                 group: Any, store: Any) -> None:  # fmt: skip
        self.engine, self.backend, self.dtype, self.device = engine, backend, dtype, device
        self.group, self.store = group, store
        # Bytes per broadcast (rl.weight_sync.plan_buckets): one buffer of this size on each
        # side at a time, one collective per bucket.
        self.bucket_bytes = BUCKET_BYTES

    @classmethod
    def open(
        cls,
        engine: Any,
        *,
        backend: str,
        workers: int,
        dtype: torch.dtype,
        timeout_s: float = 300.0,
    ) -> WeightSync:
        """The group: this process is rank 0 and the TCPStore's master on a free port of
        127.0.0.1; the engine's `workers` join as ranks 1..workers (the engine's
        weight_sync_init runs in a side thread: both sides block until all have joined)."""
        from rl import weight_sync as ws

        world = 1 + workers
        store = ws.rendezvous(0, world, timeout_s=timeout_s)
        cfg = {"folder": str(Path(ws.__file__).parent), "port": int(store.port),
               "world_size": world, "backend": backend, "timeout_s": timeout_s}  # fmt: skip
        group = _beside(
            lambda: engine.call("weight_sync_init", config=cfg, timeout=timeout_s),
            lambda: ws.join(store, backend, 0, world, timeout_s),
        )[1]
        return cls(engine, backend, dtype, ws.device_for(backend), group, store)

    def push(self, view: HFView, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """One full-weight push (the engine's HF names and dtype); returns the bytes sent."""
        from rl import weight_sync as ws

        tensors = view.tensors(state_dict, dtype=self.dtype, device=self.device)
        man = ws.manifest(tensors, version, self.bucket_bytes)
        _beside(
            lambda: self.engine.call("weight_sync_receive", manifest=man),
            lambda: ws.send(self.group, tensors, man),
        )
        return int(man["bytes"])


def _beside(engine_side: Any, ours: Any) -> tuple[Any, Any]:
    """Run the engine's request in a side thread while this thread does its part of the same
    collectives (each blocks until the other arrives); the engine's error wins, as it
    usually explains ours (a timeout)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["ok"] = engine_side()
        except BaseException as e:  # re-raised in the caller's thread
            box["err"] = e

    t = threading.Thread(target=run, name="weight-sync-engine", daemon=True)
    t.start()
    try:
        mine = ours()
    except BaseException:
        t.join(5.0)
        if "err" in box:
            raise box["err"] from None
        raise
    t.join()
    if "err" in box:
        raise box["err"]
    return box["ok"], mine


def _physical_gpu() -> str:
    """This process's CUDA device as CUDA_VISIBLE_DEVICES names it (rl.engine_gpus' terms)."""
    idx = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return visible.split(",")[idx].strip() if visible else str(idx)


def rl_generator(job: Any, state_dict: dict[str, torch.Tensor]) -> VllmGenerator:
    """rl.generator = "vllm": an engine over the recipe's model (rank-local, started here)
    holding `state_dict` as version 0. The engine's dtype is rl.generator_dtype."""
    r = job.recipe
    spec = job.config.model_spec
    cfg = spec.model
    view = HFView(cfg, spec.state_dict_adapter(cfg, None), family=r.model.family)
    hd = view.heads()[2]
    cpu = not torch.cuda.is_available() or job.platform.is_cpu
    try:
        view.head_dim = served_head_dim(hd, cpu=cpu)
    except ValueError as e:
        raise ConfigError(str(e), file=r.source, key="rl.generator") from None
    rl = r.rl
    transport = resolve_sync(rl, cuda=not cpu, world_size=int(job.world_size), file=r.source)
    if transport == "nccl" and _physical_gpu() in rl.engine_gpus.split(","):
        raise ConfigError(  # before the engine's minute of start-up
            f"GPU {_physical_gpu()} is this trainer rank's too: NCCL refuses two ranks on one GPU",
            file=r.source,
            key="rl.engine_gpus",
        )
    folder = tempfile.mkdtemp(prefix="titanscale-vllm-base-", dir=_shm_dir() or None)
    try:
        view.write_folder(folder, state_dict)
        engine = VllmEngine(
            EngineConfig(
                folder,
                dtype=rl.generator_dtype,
                # the model's positions (RoPE's max_seq_len: training.seq_len)
                max_model_len=int(view.config()["max_position_embeddings"]),
                seed=rl.seed,
                devices=rl.engine_gpus,
                # GPUs of its own: most of their memory; sharing the trainer's: a third
                gpu_memory_utilization=0.85 if rl.engine_gpus else 0.3,
            ),
            file=r.source,
        )
    finally:
        # the engine has read the folder (its weights are in its memory) or failed
        shutil.rmtree(folder, ignore_errors=True)
    sync = None
    if transport == "nccl":
        try:
            sync = WeightSync.open(
                engine,
                backend="nccl",
                workers=len(rl.engine_gpus.split(",")),
                dtype=getattr(torch, rl.generator_dtype),
            )
        except BaseException:
            engine.close()
            raise
    return VllmGenerator(engine, view, sync=sync)
