"""Checkpoints that survive crashes and load without running code from disk.

`AtomicCheckpointManager` is torchtitan's DCP `CheckpointManager`, extended at its seams:

- Atomic commit (`dcp_save`): DCP writes into `step-N.partial`; every rank then checksums
  the files it wrote, rank 0 writes `manifest.json` (size and CRC32 of every file), fsyncs
  it and renames the folder to `step-N` (one rename(2): atomic on a POSIX file system). A
  crash or a full disk at any moment before the rename leaves a `.partial` folder, which is
  never loaded and is removed at the next start; the previous `step-M` is untouched.
- Verified load with fallback (`_load`): only committed `step-N` folders count. Newest
  first, each is verified (manifest, metadata, sizes, checksums) and loaded; a damaged one
  is reported in one log line and the previous one is tried. If every checkpoint is damaged
  the run stops with the list of problems rather than silently starting over from step 0.
- Pruning (`_purge_stale_checkpoints`) counts committed folders only and runs after the
  commit, so the newest complete checkpoint is never the one deleted.
- Safe loading (`dcp_load`): DCP's stock reader unpickles `.metadata` with `pickle.load`
  and its planner loads non-tensor items with `torch.load(weights_only=False)`; both run
  code from the file. Here the metadata unpickler accepts only DCP's metadata classes,
  and non-tensor items load with `weights_only=True` (tensors already do).

- Async saves (`checkpoint.async_mode`): torchtitan's `dcp.async_save` writes into
  `step-N.partial` while training continues; when rank 0's save future completes (DCP has
  gathered every rank's write results and written `.metadata`, so every file is on disk)
  rank 0 checksums the files, writes the manifest and renames, in the saving thread. The
  next save, the last step and `close` wait for that commit. A crash before it leaves a
  `.partial`, as for a synchronous save. Cost: rank 0 alone reads the checkpoint once for
  the checksums, off the training thread.
- Hugging Face (`runtime.hf`): an HF initial load (`initial_load_in_hf`) goes to torchtitan's
  reader unverified (safetensors hold no code); `export_hf` writes the model through
  torchtitan's `dcp_save(to_hf=True)` into `<export_folder>/step-N.partial`, adds
  config.json, tokenizer files and a manifest, and renames, after the DCP checkpoint.

Costs: CRC32 runs at about 1 GB/s per core; each rank checksums only its own files on
save and 1/world of the files on load (`checkpoint.checksums = false` skips it and keeps
the size checks). Remote (fsspec) folders keep torchtitan's behaviour.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import threading
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from runtime import faults

MANIFEST = "manifest.json"
PARTIAL = ".partial"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 8 * 2**20


class CheckpointError(RuntimeError):
    """No loadable checkpoint where one is required; the message lists what is wrong."""


# ---------------------------------------------------------------------------- safe loading

# Everything a DCP `.metadata` pickle refers to (torch 2.14): DCP's metadata dataclasses,
# torch.Size / dtype / layout / memory format, and pathlib paths (storage_meta). Calling
# any of these with attacker-chosen arguments constructs plain data; nothing else is found.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise pickle.UnpicklingError(
            f"refusing to load global {module}.{name} from checkpoint metadata "
            "(only DCP metadata classes are allowed)"
        )


def load_metadata(data: bytes | io.IOBase) -> Metadata:
    """Unpickle DCP metadata allowing DCP's own classes only."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    md = _MetadataUnpickler(stream).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError(f"metadata is a {type(md).__name__}, not DCP Metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata unpickler only builds DCP metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            md = load_metadata(f)
        meta = getattr(md, "storage_meta", None) or StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            lines = str(e).splitlines()
            why = next(
                (ln.strip() for ln in lines if "Unsupported" in ln), lines[0] if lines else ""
            )
            raise pickle.UnpicklingError(
                f"checkpoint item {read_item.dest_index.fqn!r} is not plain data; refusing "
                f"to run code from it ({why[:200]})"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(state_dict: dict[str, Any], checkpoint_id: str) -> None:
    dcp.load(
        state_dict,
        storage_reader=SafeFileSystemReader(checkpoint_id),
        planner=SafeLoadPlanner(),
    )


def drop_absent_adapter_keys(state_dict: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
    """LoRA fine-tuning starts from a base checkpoint that has no adapter weights: leave the
    model's `lora_a` / `lora_b` entries out of the load (they keep their initialisation,
    B = 0, so the model starts as the base). Every other missing key still fails the load."""
    if not any(".lora_" in k for k in state_dict):
        return state_dict
    present = SafeFileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return {k: v for k, v in state_dict.items() if ".lora_" not in k or k in present}


# ---------------------------------------------------------------------------- verification


def crc32_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _dist_on() else (0, 1)


def verify_checkpoint(
    path: str, *, checksums: bool = True, share: tuple[int, int] = (0, 1)
) -> list[str]:
    """Problems found in checkpoint folder `path` ([] = loadable as far as can be told).

    Checks: DCP metadata present and readable by the safe unpickler; every file the
    metadata refers to present and long enough; with a manifest, every listed file present
    with the recorded size and (if `checksums`) CRC32. `share = (i, n)` checksums only
    every n-th file starting at i, so n ranks split the reading.
    """
    problems: list[str] = []
    if not os.path.isdir(path):
        return [f"{path} is not a folder"]
    meta_path = os.path.join(path, ".metadata")
    try:
        with open(meta_path, "rb") as f:
            md = load_metadata(f)
    except FileNotFoundError:
        return [".metadata is missing (the save did not finish)"]
    except Exception as e:  # any unpickling failure means: not a checkpoint we can trust
        return [f".metadata is unreadable: {type(e).__name__}: {e}"]
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, end in sorted(need.items()):
        fp = os.path.join(path, rel)
        if not os.path.isfile(fp):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(fp) < end:
            problems.append(f"{rel} is truncated ({os.path.getsize(fp)} bytes, need {end})")
    man_path = os.path.join(path, MANIFEST)
    if not os.path.exists(man_path):
        return problems  # written by stock torchtitan: metadata checks only
    try:
        with open(man_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [*problems, f"{MANIFEST} is unreadable: {e}"]
    reported = {p.split(" ", 1)[0] for p in problems}
    for i, (rel, rec) in enumerate(sorted(files.items())):
        fp = os.path.join(path, rel)
        if rel in reported:
            continue
        if not os.path.isfile(fp):
            problems.append(f"{rel} is missing")
            continue
        size = os.path.getsize(fp)
        if size != rec.get("size"):
            problems.append(f"{rel} has {size} bytes, the manifest says {rec.get('size')}")
            continue
        if checksums and rec.get("crc32") is not None and i % share[1] == share[0]:
            crc = crc32_file(fp)
            if crc != rec["crc32"]:
                problems.append(
                    f"{rel} is corrupted (CRC32 {crc:08x}, expected {rec['crc32']:08x})"
                )
    return problems


def write_manifest(path: str, step: int, crcs: dict[str, int]) -> None:
    """Write manifest.json for folder `path` (sizes of all files, CRC32 where given)."""
    files = {}
    for name in sorted(os.listdir(path)):
        fp = os.path.join(path, name)
        if name == MANIFEST or not os.path.isfile(fp):
            continue
        files[name] = {"size": os.path.getsize(fp), "crc32": crcs.get(name)}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "written": time.time(), "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed_steps(folder: str) -> list[int]:
    """Steps with a committed `step-N` folder under `folder`, ascending."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


# ---------------------------------------------------------------------------- the manager


class AtomicCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with atomic commits, verified loads and safe loading."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        checksums: bool = True
        """CRC32 every checkpoint file on save (own files per rank) and verify on load."""

        export_hf: bool = False
        """Write a Hugging Face folder of the model after the last step's checkpoint."""

        export_hf_every_checkpoint: bool = False
        """Also export after every interval checkpoint."""

        export_folder: str = ""
        """Absolute folder for Hugging Face exports (step-N subfolders)."""

        export_family: str = "llama3"
        """Model family, for the exported config.json."""

        export_base_config: str = ""
        """Hugging Face folder the run started from; its config.json is kept on export."""

        tokenizer_dir: str = ""
        """Tokenizer folder whose files are copied into exports."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.checksums = config.checksums
        self.local = not filesystem.is_remote(getattr(self, "folder", "") or "")
        self.xconfig = config
        self._commit_done: threading.Event | None = None

    # --- commit (shared by synchronous and async saves)

    def _commit(self, tmp: str, final: str, step: int, crcs: dict[str, int]) -> None:
        """Rank 0: manifest, then one rename of `tmp` to `final` (replacing a damaged one)."""
        write_manifest(tmp, step, crcs)
        old = None
        if os.path.exists(final):
            # A damaged step-N that a fallback skipped: replace it only once the new
            # one is complete.
            old = final + ".replaced"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final) or ".")
        if old:
            shutil.rmtree(old, ignore_errors=True)
        logger.info(f"Checkpoint committed: {final}")

    def _all_crcs(self, folder: str) -> dict[str, int]:
        if not self.checksums:
            return {}
        return {
            n: crc32_file(os.path.join(folder, n))
            for n in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, n)) and n != MANIFEST
        }

    def _commit_when_written(self, fut: Future, tmp: str, final: str, step: int) -> None:
        """Done-callback of an async save (rank 0, in the saving thread)."""
        done = self._commit_done
        try:
            err = fut.exception()
            if err is not None:
                logger.error(f"Async checkpoint {final} failed ({err}); left as {tmp}")
                return
            self._commit(tmp, final, step, self._all_crcs(tmp))
        except Exception as e:  # a failed commit must not kill the saving thread silently
            logger.error(f"Committing async checkpoint {final} failed: {e}; left as {tmp}")
        finally:
            if done is not None:
                done.set()

    def _wait_for_saving(self, *, barrier: bool = True) -> None:
        super()._wait_for_saving()
        if self._commit_done is not None:
            self._commit_done.wait()
            self._commit_done = None
        if barrier and _dist_on():
            dist.barrier()  # every rank sees the commit before the next save or load

    def _close(self) -> None:
        # Finish (and commit) an async save in flight. No barrier: at shutdown after an
        # error on another rank it could wait forever, and nothing loads after close.
        if self.save_future is not None:
            self._wait_for_saving(barrier=False)
        super()._close()

    # --- Hugging Face export

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        cfg = self.xconfig
        if saved and cfg.export_hf and (last_step or cfg.export_hf_every_checkpoint):
            self.export_hf(curr_step)
        return saved

    def export_hf(self, step: int) -> str:
        """Write the model as a Hugging Face folder `<export_folder>/step-N` (atomic)."""
        from runtime.hf import finish_export, hf_config, special_token_ids

        cfg = self.xconfig
        assert self.sd_adapter is not None, "this model family has no Hugging Face adapter"
        final = os.path.join(cfg.export_folder, f"step-{step}")
        tmp = final + PARTIAL
        rank, _ = _rank_world()
        begin = time.monotonic()
        if rank == 0:
            os.makedirs(cfg.export_folder, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
        if _dist_on():
            dist.barrier()
        # As torchtitan's last-step model-only save: floating tensors cast to export_dtype.
        states = {
            k: v.to(self.export_dtype)
            if isinstance(v, torch.Tensor) and v.is_floating_point()
            else v
            for k, v in self.states[MODEL].state_dict().items()
        }
        CheckpointManager.dcp_save(self, states, tmp, AsyncMode.DISABLED, True, to_hf=True)
        if _dist_on():
            dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(tmp, "sharded"), ignore_errors=True)
            base = None
            if cfg.export_base_config:
                with open(os.path.join(cfg.export_base_config, "config.json")) as f:
                    base = json.load(f)
            dtype = str(self.export_dtype).removeprefix("torch.")
            config = hf_config(
                self.sd_adapter.model_config,
                cfg.export_family,
                dtype,
                base=base,
                token_ids=special_token_ids(cfg.tokenizer_dir),
            )
            finish_export(tmp, config, cfg.tokenizer_dir, step=step)
            self._commit(tmp, final, step, self._all_crcs(tmp))
            logger.info(
                f"Hugging Face export ({dtype}) written to {final} in "
                f"{time.monotonic() - begin:.1f} s"
            )
        if _dist_on():
            dist.barrier()
        return final

    # --- save

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        if to_hf or not self.local:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        final = checkpoint_id.rstrip("/")
        m = _STEP_DIR.match(os.path.basename(final))
        step = int(m.group(1)) if m else -1
        tmp = final + PARTIAL
        rank, world = _rank_world()
        if rank == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a crash in this process's lifetime (e.g. ENOSPC)
        if _dist_on():
            dist.barrier()  # nobody writes into tmp before rank 0 has cleared it
        if async_mode != AsyncMode.DISABLED:
            ret = super().dcp_save(state_dict, tmp, async_mode, enable_garbage_collection, False)
            fut = ret if isinstance(ret, Future) else getattr(ret, "upload_completion", None)
            if rank == 0 and fut is not None:
                self._commit_done = threading.Event()
                fut.add_done_callback(lambda f: self._commit_when_written(f, tmp, final, step))
            return ret
        ret = super().dcp_save(state_dict, tmp, async_mode, enable_garbage_collection, False)
        faults.inject("save", step)
        crcs: dict[str, int] = {}
        if self.checksums:
            own = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
            crcs = {n: crc32_file(os.path.join(tmp, n)) for n in own}
            if rank == 0 and os.path.exists(os.path.join(tmp, ".metadata")):
                crcs[".metadata"] = crc32_file(os.path.join(tmp, ".metadata"))
        if _dist_on():
            gathered: list[dict[str, int] | None] = [None] * world
            dist.all_gather_object(gathered, crcs)
            crcs = {k: v for d in gathered if d for k, v in d.items()}
        if rank == 0:
            self._commit(tmp, final, step, crcs)
        if _dist_on():
            dist.barrier()  # every rank returns after the commit
        return ret

    # --- prune

    def _should_purge(self) -> bool:
        return self.keep_latest_k > 0 and _rank_world()[0] == 0 and os.path.isdir(self.folder)

    def _purge_stale_checkpoints(self) -> None:
        if not self.local:
            return super()._purge_stale_checkpoints()
        if not self._should_purge():
            return
        steps = committed_steps(self.folder)
        for s in steps[: -self.keep_latest_k]:
            assert self.purge_thread is not None
            self.purge_queue.put(self._create_checkpoint_id(s))

    # --- load

    def _find_load_step(self, folder: str = "") -> int:
        if not self.local:
            return super()._find_load_step(folder)
        steps = committed_steps(folder or self.folder)
        rejected = getattr(self, "_rejected", {})
        steps = [s for s in steps if s not in rejected]
        return steps[-1] if steps else -1

    @staticmethod
    def _gather(problems: list[str]) -> list[str]:
        """The union of every rank's problems (the same list on every rank)."""
        if not _dist_on():
            return problems
        gathered: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
        return sorted({p for ps in gathered if ps for p in ps})

    def _verify(self, path: str) -> list[str]:
        rank, world = _rank_world()
        return self._gather(verify_checkpoint(path, checksums=self.checksums, share=(rank, world)))

    def _cleanup_partials(self) -> None:
        if _rank_world()[0] == 0 and os.path.isdir(self.folder):
            for name in os.listdir(self.folder):
                if name.endswith(PARTIAL) or name.endswith(".replaced"):
                    logger.warning(
                        f"Removing incomplete checkpoint {name} (a save was interrupted)"
                    )
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        if _dist_on():
            dist.barrier()

    def _load(self, step: int = -1) -> bool:
        if not self.local:
            return super()._load(step)
        self._cleanup_partials()
        self._rejected: dict[int, str] = {}
        if step != -1:
            return self._load_verified(step, self._create_checkpoint_id(step))
        while True:
            s = self._find_load_step()
            if s == -1:
                if self._rejected:
                    listing = "; ".join(f"step-{k}: {v}" for k, v in sorted(self._rejected.items()))
                    raise CheckpointError(
                        f"no loadable checkpoint in {self.folder} ({listing}); refusing to "
                        "start over from step 0 over them: move the folder away to start fresh"
                    )
                if self.initial_load_path and not self.initial_load_in_hf:
                    problems = self._verify(self.initial_load_path)
                    if problems:
                        raise CheckpointError(
                            f"checkpoint.load_from {self.initial_load_path} is damaged: "
                            + "; ".join(problems)
                        )
                return super()._load(-1)
            path = self._create_checkpoint_id(s)
            problems = self._verify(path)
            if not problems:
                err = None
                try:
                    loaded = super()._load(s)
                except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                    err = f"loading failed: {type(e).__name__}: {str(e)[:500]}"
                # Every rank takes the same branch even if the failure was local to one.
                problems = self._gather([err] if err else [])
                if not problems:
                    return loaded
            self._rejected[s] = "; ".join(problems)
            prev = self._find_load_step()
            logger.error(
                f"Checkpoint {path} is damaged ({self._rejected[s]}); "
                + (f"falling back to step-{prev}" if prev != -1 else "no older checkpoint")
            )

    def _load_verified(self, step: int, path: str) -> bool:
        problems = self._verify(path)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))
        return super()._load(step)

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:
            # safetensors: no pickle involved; torchtitan's HF reader as is.
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        state_dict = drop_absent_adapter_keys(state_dict, checkpoint_id)
        safe_dcp_load(state_dict, checkpoint_id)
        # As torchtitan: model states are flattened into the dict, so load them explicitly.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)
