"""Checkpoints that survive crashes and load without running code from disk.

`AtomicCheckpointManager` is torchtitan's DCP `CheckpointManager`, extended at its seams:

- Atomic commit (`dcp_save`): DCP writes into `step-N.partial`; every rank then checksums
  the files it wrote, rank 0 writes `manifest.json` (size and CRC32 of every file), fsyncs
  it and renames the folder to `step-N` (one rename(2): atomic on a POSIX file system). A
  crash or a full disk at any moment before the rename leaves a `.partial` folder, which is
  never loaded and is removed at the next start; the previous `step-M` is untouched.
- Verified load with fallback (`_load`): only committed `step-N` folders count. Newest
  first, each is verified (manifest, metadata, sizes, checksums), compared with the model
  (`runtime.checkpoint_fit`: a checkpoint that does not fit is refused, not skipped) and
  loaded; a damaged one is reported in one log line and the previous one is tried. Once
  one loads, the damaged newer ones are renamed `step-N.damaged` (kept, never counted).
  If every checkpoint is damaged the run stops with one line (`CheckpointError`, a
  ConfigError: exit 2) rather than silently starting over from step 0.
- Pruning (`_purge_stale_checkpoints`) runs only after a save of this process has been
  committed and read back, counts committed folders up to that step, and keeps the newest
  `keep_latest` that pass the cheap checks (a damaged one is moved aside, not counted).
- Failed saves (`_save_failed`): a full disk (ENOSPC/EDQUOT anywhere in DCP's exception
  chain, or torch's "unexpected pos" short write) or another I/O error ends in one line
  naming checkpoint.folder, the disk, its free space and the size needed; the partial
  folder is removed, committed checkpoints are untouched.
- Safe loading (`dcp_load`): through runtime/safe_load.py (DCP metadata unpickled with
  DCP's classes only, non-tensor items with `weights_only=True`): no code runs from a file.
- The commit itself (manifest of sizes and CRC32s, fsync, one rename) is core/atomic.py's,
  shared with every other writer of durable state.

- Async saves (`checkpoint.async_mode`): torchtitan's `dcp.async_save` writes into
  `step-N.partial` while training continues; when rank 0's save future completes (DCP has
  gathered every rank's write results and written `.metadata`, so every file is on disk)
  rank 0 checksums the files, writes the manifest and renames, in the saving thread. The
  next save, the last step and `close` wait for that commit. A crash before it leaves a
  `.partial`, as for a synchronous save. Cost: rank 0 alone reads the checkpoint once for
  the checksums, off the training thread.
- Hugging Face (`runtime.hf`): an HF initial load (`initial_load_in_hf`) goes to torchtitan's
  reader unverified (safetensors hold no code); `export_hf`, after the DCP checkpoint,
  commits `<export_folder>/step-N` as a checkpoint is committed (`.partial`, every rank's
  errors in one line, manifest, rename). What goes into the folder is runtime/hf.py's, the
  same as for a merged LoRA export: `write_hf_weights` (the family's `to_hf` + torch's
  HuggingFaceStorageWriter, as torchtitan's `dcp_save(to_hf=True)`) and `finish_export`
  (config.json, tokenizer files, EXPORT_INFO).

Costs: CRC32 runs at about 1 GB/s per core; each rank checksums only its own files on
save and 1/world of the files on load (`checkpoint.checksums = false` skips it and keeps
the size checks). Remote (fsspec) folders keep torchtitan's behaviour.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from core.atomic import (
    crc32_file,
    folder_crcs,
    move_aside,
    publish_folder,
    read_manifest,
    verify_manifest,
    write_manifest,
)
from core.errors import ConfigError
from runtime import faults
from runtime.safe_load import drop_absent_adapter_keys, load_metadata, safe_dcp_load

PARTIAL = ".partial"
_STEP_DIR = re.compile(r"^step-(\d+)\Z")


class CheckpointError(ConfigError):
    """No loadable checkpoint where one is required, a checkpoint that does not fit the
    model, or a save that could not be written: one line naming the key (exit 2)."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        super().__init__(_one_line(message), file=file or None, key=key)


def _one_line(text: str, limit: int = 600) -> str:
    """Messages from DCP carry whole tracebacks; keep one line of bounded length."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def describe_error(e: BaseException) -> str:
    """`Type: message` of the innermost failure (DCP wraps each rank's in CheckpointException)."""
    for inner in _chain(e):
        if not isinstance(inner, CheckpointException):
            return _one_line(f"{type(inner).__name__}: {inner}", 300)
    return _one_line(f"{type(e).__name__}: {e}", 300)


def _chain(e: BaseException) -> list[BaseException]:
    """`e`, its causes and contexts, and every rank's failure inside a CheckpointException."""
    out: list[BaseException] = []
    todo: list[BaseException] = [e]
    while todo:
        x = todo.pop(0)
        if x in out or len(out) > 50:
            continue
        out.append(x)
        if isinstance(x, CheckpointException):
            for failure in x.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        for nxt in (x.__cause__, x.__context__):
            if nxt is not None:
                todo.append(nxt)
    return out


# ---------------------------------------------------------------------------- verification


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
    try:
        files = read_manifest(path)
    except ValueError as e:
        return [*problems, str(e)]
    if files is None:
        return problems  # written by stock torchtitan: metadata checks only
    reported = {p.split(" ", 1)[0] for p in problems}
    return problems + verify_manifest(
        path, files, checksums=checksums, share=share, reported=reported
    )


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


def not_a_checkpoint(path: str) -> str | None:
    """Why `path` is not a DCP checkpoint folder at all (None when it looks like one):
    the run's checkpoint folder instead of one of its steps, a Hugging Face folder, a file,
    nothing. Damage inside a checkpoint is `verify_checkpoint`'s business."""
    if not os.path.exists(path):
        return f"checkpoint to load not found: {path}"
    if not os.path.isdir(path):
        return f"{path} is a file; expected a checkpoint folder (a step-N folder)"
    if path.rstrip("/").endswith((PARTIAL, ".replaced")):
        return f"{path} is an interrupted save (never committed, never loaded)"
    if os.path.exists(os.path.join(path, ".metadata")):
        return None
    steps = committed_steps(path)
    if steps:
        return (
            f"{path} is a folder of checkpoints, not a checkpoint: point at one of its step "
            f"folders, e.g. {os.path.join(path, f'step-{steps[-1]}')}"
        )
    if os.path.exists(os.path.join(path, "config.json")) or any(
        n.endswith(".safetensors") for n in os.listdir(path)
    ):
        return f"{path} is a Hugging Face folder, not a DCP checkpoint: use checkpoint.load_hf"
    return None


DAMAGED = ".damaged"


def no_loadable_message(folder: str, rejected: dict[int, str]) -> str:
    listing = "; ".join(f"step-{k}: {v}" for k, v in sorted(rejected.items()))
    return (
        f"no loadable checkpoint in {folder} ({listing}); refusing to start over from step 0 "
        "over them: move the folder away to start fresh"
    )


def set_aside(path: str) -> str:
    """Rename a damaged `step-N` to `step-N.damaged` (or `.damaged-2`, ...): never loaded,
    never counted or pruned, kept for inspection until deleted by hand."""
    dest = path.rstrip("/") + DAMAGED
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = f"{path.rstrip('/')}{DAMAGED}-{n}"
    move_aside(path, dest)
    return dest


# ---------------------------------------------------------------------------- failed saves

# How a failed write surfaces: OSError(ENOSPC / EDQUOT) from DCP's FileSystemWriter (wrapped
# in CheckpointException, one per rank), or torch.save's zip writer reporting the short
# write without an errno ("PytorchStreamWriter failed writing file ...: unexpected pos").
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_SHORT_WRITE = ("unexpected pos", "file write failed", "no space left", "disk quota")


def write_failure(e: BaseException) -> tuple[bool, str] | None:
    """(disk full?, what failed) when `e` is a failed write, None for anything else."""
    chain = _chain(e)
    for x in chain:
        if isinstance(x, OSError) and x.errno in _FULL_ERRNOS:
            return True, f"{os.strerror(x.errno)} (errno {errno.errorcode[x.errno]})"
    for x in chain:
        text = str(x).lower()
        if any(t in text for t in _SHORT_WRITE) and not isinstance(x, CheckpointException):
            return False, _one_line(str(x).splitlines()[-1] if str(x) else type(x).__name__, 200)
    for x in chain:
        if isinstance(x, OSError):
            return False, describe_error(x)
    return None


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file-system type) holding `path` (type '' where /proc/mounts is absent)."""
    p = os.path.realpath(path)
    while not os.path.ismount(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    fstype = ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[1] == p:
                    fstype = parts[2]
    except OSError:
        pass
    return p, fstype


def _gib(n: float) -> str:
    if n >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def folder_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            with contextlib.suppress(OSError):  # deleted meanwhile: an estimate anyway
                total += os.path.getsize(os.path.join(root, n))
    return total


def state_bytes(obj: Any, _depth: int = 0) -> int:
    """Bytes of the tensors in a (nested) state dict; DTensors count their global size."""
    if _depth > 20:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v, _depth + 1) for v in obj)
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        try:
            return state_bytes(obj.state_dict(), _depth + 1)
        except Exception:  # an estimate for a message; never fail the report on it
            return 0
    return 0


def disk_full_message(
    folder: str,
    step: int,
    *,
    full: bool,
    why: str,
    need: int,
    free: int,
    prev: int,
    key: str = "checkpoint.folder",
) -> str:
    mnt, fstype = mount_of(folder)
    disk = f"the file system at {mnt}" + (f" ({fstype})" if fstype else "")
    kept = f"step-{prev} is intact" if prev >= 0 else "no earlier checkpoint exists"
    head = "disk full" if full else "writing failed"
    export = key.endswith("export_folder")
    what = "the Hugging Face export" if export else "checkpoint"
    return (
        f"{head} while saving {what} step-{step} to {folder}: {why}; {disk} has "
        f"{_gib(free)} free, one {'export' if export else 'checkpoint'} needs about "
        f"{_gib(need)}. The partial save was "
        f"removed and {kept}; free space or point {key} at a larger disk"
    )


def commit_folder(
    tmp: str, final: str, step: int, crcs: dict[str, int], *, verify: bool = True
) -> None:
    """Manifest, then one rename of `tmp` to `final` (replacing a damaged one only once the
    new one is complete), fsync of the parent; with `verify`, the committed DCP checkpoint
    is read back (metadata, sizes) and moved aside with an OSError if it fails."""
    write_manifest(tmp, crcs, step=step)
    publish_folder(tmp, final)
    if verify:
        # Read back what was committed (metadata, sizes; the CRC32s were computed from the
        # written files): only a checkpoint that passes counts.
        problems = verify_checkpoint(final, checksums=False)
        if problems:
            aside = set_aside(final)
            raise OSError(
                errno.EIO,
                f"the committed checkpoint fails verification ({'; '.join(problems)}); "
                f"moved aside to {aside}",
            )
    logger.info(f"Checkpoint committed: {final}")


def save_states(
    folder: str,
    states: dict[str, Any],
    *,
    checksums: bool = True,
    key: str = "",
    file: str = "",
    in_place: bool = False,
) -> None:
    """Write `states` (tensors, plain data, Stateful objects) as one verified checkpoint
    folder, committed as the manager commits a step (`.partial`, CRC32s, manifest, fsync,
    rename, read-back): for states outside a run's step-N series (the RL reference policy,
    a service adapter's training state). One process writes it (no collective). A failed
    write is one line naming `key` (CheckpointError), the partial folder removed.
    `in_place`: write into the existing `folder`, which the caller commits with its manifest
    (the service's storage: core.atomic's manifest over every file of the folder)."""
    final = folder.rstrip("/")
    tmp = final if in_place else final + PARTIAL
    if not in_place:
        shutil.rmtree(tmp, ignore_errors=True)
    flat = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in states.items()}
    try:
        with single_process():
            dcp.save(flat, checkpoint_id=tmp, no_dist=True)
        if not in_place:  # in place: the caller writes the manifest as it commits
            commit_folder(tmp, final, -1, folder_crcs(tmp) if checksums else {})
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        if not in_place:
            shutil.rmtree(tmp, ignore_errors=True)
        found = write_failure(e)
        if found is None:
            raise
        raise CheckpointError(
            f"writing {final} failed: {found[1]}", file=file or None, key=key or None
        ) from None


@contextlib.contextmanager
def single_process() -> Any:
    """DCP warns that it assumes one process when told so (no_dist): that is the intent."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_states(
    folder: str, states: dict[str, Any], *, checksums: bool = True, key: str = "", file: str = ""
) -> None:
    """Load a `save_states` folder into `states` after verifying it (manifest, sizes,
    checksums, no code run from the file): a damaged or missing one is one line naming
    `key`. Stateful values get `load_state_dict`, tensors are loaded in place."""
    problems = verify_checkpoint(folder, checksums=checksums)
    if problems:
        raise CheckpointError(
            f"{folder} is damaged: {'; '.join(problems)}", file=file or None, key=key or None
        )
    flat = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in states.items()}
    try:
        with single_process():
            safe_dcp_load(flat, folder, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"{folder} does not load: {describe_error(e)}", file=file or None, key=key or None
        ) from None
    for k, v in states.items():
        if hasattr(v, "load_state_dict"):
            v.load_state_dict(flat[k])


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

        recipe_file: str = ""
        """The recipe, named in one-line errors (a checkpoint that does not fit, a full disk)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.checksums = config.checksums
        self.local = not filesystem.is_remote(getattr(self, "folder", "") or "")
        self.xconfig = config
        self._commit_done: threading.Event | None = None
        # The newest step committed AND verified by this process (rank 0): pruning counts
        # only up to it, so nothing is pruned before a new save is known good.
        self._verified_step: int | None = None

    # --- commit (shared by synchronous and async saves)

    def _commit(
        self, tmp: str, final: str, step: int, crcs: dict[str, int], *, dcp: bool = True
    ) -> None:
        """Rank 0: `commit_folder`; a committed DCP checkpoint (not an HF export) counts as
        verified for pruning."""
        commit_folder(tmp, final, step, crcs, verify=dcp)
        if dcp:
            prev = -1 if self._verified_step is None else self._verified_step
            self._verified_step = max(step, prev)

    def _folder_crcs(self, folder: str) -> dict[str, int]:
        return folder_crcs(folder) if self.checksums else {}

    def _commit_when_written(self, fut: Future, tmp: str, final: str, step: int) -> None:
        """Done-callback of an async save (rank 0, in the saving thread)."""
        done = self._commit_done
        try:
            err = fut.exception()
            if err is not None:
                logger.error(f"Async checkpoint {final} failed ({err}); left as {tmp}")
                return
            self._commit(tmp, final, step, self._folder_crcs(tmp))
        except Exception as e:  # a failed commit must not kill the saving thread silently
            logger.error(f"Committing async checkpoint {final} failed: {e}; left as {tmp}")
        finally:
            if done is not None:
                done.set()

    def _wait_for_saving(self, *, barrier: bool = True) -> None:
        try:
            super()._wait_for_saving()  # re-raises the async write's error, on every rank
        except (Exception, CheckpointException) as e:
            self.save_future = None
            if self._commit_done is not None:
                self._commit_done.wait()  # the saving thread has logged it and stopped
                self._commit_done = None
            final, step = getattr(self, "_async_target", ("", -1))
            if final:
                self._save_failed(e, final, step, {})  # one line when the write failed
            raise
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

    def _save_and_export(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        cfg = self.xconfig
        if saved and cfg.export_hf and (last_step or cfg.export_hf_every_checkpoint):
            self.export_hf(curr_step)
        return saved

    def export_hf(self, step: int) -> str:
        """Write the model as a Hugging Face folder `<export_folder>/step-N` (atomic); a
        failed write is one line naming checkpoint.export_folder (as a failed save)."""
        cfg = self.xconfig
        assert self.sd_adapter is not None, "this model family has no Hugging Face adapter"
        final = os.path.join(cfg.export_folder, f"step-{step}")
        tmp = final + PARTIAL
        from runtime.hf import check_export_target, export_run_id, write_hf_weights

        # Never over another run's export of this step (checked at prepare too; again here:
        # another job may have exported since).
        check_export_target(cfg.export_folder, [step], export_run_id(self.folder),
                            file=cfg.recipe_file)  # fmt: skip
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
        key = "checkpoint.export_folder"
        try:
            hf_state = self.sd_adapter.to_hf(states)
            write_hf_weights(tmp, hf_state, self.sd_adapter.fqn_to_index_mapping)
            del hf_state
            GarbageCollection.collect("GC collection after the Hugging Face export.")
        except (Exception, CheckpointException) as e:  # every rank (DCP gathers the errors)
            self._save_failed(e, final, step, states, key=key)
            raise
        if _dist_on():
            dist.barrier()
        err: BaseException | None = None
        if rank == 0:
            try:
                self._finish_export(tmp, final, step, begin)
            except Exception as e:  # config.json, tokenizer files, manifest, rename
                err = e
        failed = self._gather([describe_error(err)] if err is not None else [])
        if failed:
            cause = err or OSError(errno.EIO, "; ".join(failed))
            self._save_failed(cause, final, step, states, key=key)
            raise CheckpointError(
                f"finishing the export {final} failed: {'; '.join(failed)}",
                file=cfg.recipe_file,
                key=key,
            )
        return final

    def _finish_export(self, tmp: str, final: str, step: int, begin: float) -> None:
        """Rank 0: runtime.hf.finish_export (config.json, tokenizer files, EXPORT_INFO),
        then the manifest and the rename."""
        from runtime.hf import export_run_id, finish_export

        cfg = self.xconfig
        assert self.sd_adapter is not None
        dtype = str(self.export_dtype).removeprefix("torch.")
        finish_export(tmp, model_config=self.sd_adapter.model_config, family=cfg.export_family,
                      dtype=dtype, tokenizer_dir=cfg.tokenizer_dir, step=step,
                      run=export_run_id(self.folder), base_config=cfg.export_base_config)  # fmt: skip
        self._commit(tmp, final, step, self._folder_crcs(tmp), dcp=False)
        logger.info(
            f"Hugging Face export ({dtype}) written to {final} in {time.monotonic() - begin:.1f} s"
        )

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
            self._async_target = (final, step)  # named if the write fails (_wait_for_saving)
            ret = super().dcp_save(state_dict, tmp, async_mode, enable_garbage_collection, False)
            fut = ret if isinstance(ret, Future) else getattr(ret, "upload_completion", None)
            if rank == 0 and fut is not None:
                self._commit_done = threading.Event()
                fut.add_done_callback(lambda f: self._commit_when_written(f, tmp, final, step))
            return ret
        try:
            ret = super().dcp_save(state_dict, tmp, async_mode, enable_garbage_collection, False)
            faults.inject("save", step)
            crcs: dict[str, int] = {}
            if self.checksums:
                own = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_")]
                crcs = {n: crc32_file(os.path.join(tmp, n)) for n in own}
                if rank == 0 and os.path.exists(os.path.join(tmp, ".metadata")):
                    crcs[".metadata"] = crc32_file(os.path.join(tmp, ".metadata"))
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            # DCP gathers every rank's write errors, so every rank is here together.
            self._save_failed(e, final, step, state_dict)
            raise
        if _dist_on():
            gathered: list[dict[str, int] | None] = [None] * world
            dist.all_gather_object(gathered, crcs)
            crcs = {k: v for d in gathered if d for k, v in d.items()}
        err: BaseException | None = None
        if rank == 0:
            try:
                self._commit(tmp, final, step, crcs)
            except Exception as e:  # the manifest write, the rename, the read-back
                err = e
        # Every rank learns the outcome of rank 0's commit (and raises together).
        failed = self._gather([describe_error(err)] if err is not None else [])
        if failed:
            self._save_failed(err or OSError(errno.EIO, "; ".join(failed)), final, step, state_dict)
            raise CheckpointError(
                f"committing checkpoint {final} failed: {'; '.join(failed)}",
                file=self.xconfig.recipe_file,
                key="checkpoint.folder",
            )
        if _dist_on():
            dist.barrier()  # every rank returns after the commit
        return ret

    def _save_failed(
        self,
        e: BaseException,
        final: str,
        step: int,
        state_dict: dict[str, Any],
        *,
        key: str = "checkpoint.folder",
    ) -> None:
        """A save that could not be written (full disk, quota, I/O error) becomes one line
        naming checkpoint.folder, the disk, its free space and the size needed; the partial
        folder is removed (it frees the space) and committed checkpoints are untouched.
        Anything else is re-raised as is by the caller."""
        found = write_failure(e)
        if found is None:
            return
        full, why = found
        folder = os.path.dirname(final)
        tmp = final + PARTIAL
        free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
        done = [s for s in committed_steps(folder) if s != step]
        prev = done[-1] if done else -1
        # The previous checkpoint's size is the best estimate of the next one's.
        need = folder_bytes(os.path.join(folder, f"step-{prev}")) if prev >= 0 else 0
        if need == 0:
            need = state_bytes(state_dict) * max(_rank_world()[1], 1)
        if not full and free < need:
            full = True  # a short write with the disk (nearly) full: say so
        if _rank_world()[0] == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            disk_full_message(
                folder, step, full=full, why=why, need=need, free=free, prev=prev, key=key
            ),
            file=self.xconfig.recipe_file,
            key=key,
        ) from None

    # --- prune

    def _should_purge(self) -> bool:
        return self.keep_latest_k > 0 and _rank_world()[0] == 0 and os.path.isdir(self.folder)

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest `keep_latest` checkpoints that verify, delete older ones.

        Rules (docs/reliability.md, section 3): nothing is pruned until a save of this
        process is committed and read back (`_verified_step`); checkpoints newer than that
        are not counted and never deleted; a kept one that fails the cheap checks (metadata,
        sizes) is moved aside as `step-N.damaged` and an older one is kept in its place, so
        a verified checkpoint is never deleted while a damaged one is kept."""
        if not self.local:
            return super()._purge_stale_checkpoints()
        if not self._should_purge() or self._verified_step is None:
            return
        newest = self._verified_step
        kept = 0
        for s in reversed(committed_steps(self.folder)):
            if s > newest:
                continue
            path = self._create_checkpoint_id(s)
            if kept < self.keep_latest_k:
                problems = [] if s == newest else verify_checkpoint(path, checksums=False)
                if not problems:
                    kept += 1
                else:
                    aside = set_aside(path)
                    logger.error(
                        f"Checkpoint {path} is damaged ({'; '.join(problems)}); moved aside "
                        f"to {aside} instead of counting it as one of the kept checkpoints"
                    )
                continue
            assert self.purge_thread is not None
            self.purge_queue.put(path)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = self._save_and_export(curr_step, last_step)
        if saved and last_step and self.local:
            # torchtitan prunes after interval saves only; keep_latest holds at the end too.
            self._purge_stale_checkpoints()
        return saved

    # --- load

    def newest_step_folder(self) -> str | None:
        """The newest committed `step-N` folder (what a resume tries first), or None."""
        steps = committed_steps(self.folder) if self.local else []
        return self._create_checkpoint_id(steps[-1]) if steps else None

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
                    raise CheckpointError(
                        no_loadable_message(self.folder, self._rejected),
                        file=self.xconfig.recipe_file,
                        key="checkpoint.folder",
                    )
                if self.initial_load_path and not self.initial_load_in_hf:
                    problems = self._verify(self.initial_load_path)
                    if problems:
                        raise CheckpointError(
                            f"checkpoint {self.initial_load_path} is damaged: "
                            + "; ".join(problems),
                            file=self.xconfig.recipe_file,
                            key="checkpoint.load_from",
                        )
                    self._check_fit(
                        self.initial_load_path, self.initial_load_model_only, "checkpoint.load_from"
                    )
                return super()._load(-1)
            path = self._create_checkpoint_id(s)
            problems = self._verify(path)
            if not problems:
                # A checkpoint of another model is not damage: refuse, fall back to nothing
                # and move nothing aside.
                self._check_fit(path, s == 0, "checkpoint.folder")
                err = None
                try:
                    loaded = super()._load(s)
                except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                    err = f"loading failed: {describe_error(e)}"
                # Every rank takes the same branch even if the failure was local to one.
                problems = self._gather([err] if err else [])
                if not problems:
                    self._set_aside_rejected()
                    return loaded
            self._rejected[s] = "; ".join(problems)
            prev = self._find_load_step()
            logger.error(
                f"Checkpoint {path} is damaged ({self._rejected[s]}); "
                + (f"falling back to step-{prev}" if prev != -1 else "no older checkpoint")
            )

    def _set_aside_rejected(self) -> None:
        """After a fallback has loaded: the damaged newer checkpoints are renamed
        `step-N.damaged` so no later save or prune counts them (and no data is deleted).
        Nothing is moved while no checkpoint loads: the folder stays as it was."""
        if self._rejected and _rank_world()[0] == 0:
            for s, why in sorted(self._rejected.items()):
                path = self._create_checkpoint_id(s)
                if os.path.isdir(path):
                    aside = set_aside(path)
                    logger.warning(
                        f"Damaged checkpoint {path} moved aside to {aside} ({why}); "
                        "delete it by hand once inspected"
                    )
        if self._rejected and _dist_on():
            dist.barrier()

    def _check_fit(self, path: str, model_only: bool, key: str) -> None:
        """Refuse (one line, every rank) a checkpoint whose tensors differ from the model's."""
        from runtime.checkpoint_fit import (
            NON_MODEL_STATES,
            Expected,
            expected_from_module,
            mismatch,
            read_present,
        )

        if MODEL not in self.states:
            return
        exp = expected_from_module(self.states[MODEL].model)
        if _dist_on():  # pipeline stages hold different layers: the union is the model
            parts: list[Expected | None] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, exp)
            exp = Expected(
                {k: v for p in parts if p for k, v in p.model.items()},
                {n for p in parts if p for n in p.trainable},
            )
        non_model = (*NON_MODEL_STATES, *(k for k in self.states if k != MODEL))
        problem = mismatch(read_present(path, non_model), exp, model_only=model_only)
        if problem:
            raise CheckpointError(
                f"{path} does not fit the model: {problem}",
                file=self.xconfig.recipe_file,
                key=key,
            )

    def _load_verified(self, step: int, path: str) -> bool:
        problems = self._verify(path)
        if problems:
            raise CheckpointError(
                f"checkpoint {path} is damaged: " + "; ".join(problems),
                file=self.xconfig.recipe_file,
                key="checkpoint.folder",
            )
        self._check_fit(path, step == 0, "checkpoint.folder")
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
