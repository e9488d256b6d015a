"""[metrics] wandb through torchtitan's W&B logger, offline (WANDB_MODE=offline): the run
folder is written with the training losses, and a restart of the same job (what a Slurm
requeue does: same output folder, resume from its checkpoint) logs to the same run id.
Two 1-process runs of 2 steps each, seq 64: ~40-60 s."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from tests.helpers.runs import read_losses, run_train

pytestmark = pytest.mark.slow  # training runs: ~30-120 s on 2 shared cores


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (W&B's LevelDB-style log: 7-byte file header,
    32 KiB blocks, each record chunk with a CRC32 / length / type header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(buf + chunk if kind == 4 else chunk)
            buf = b""
            yield rec
        elif kind == 2:  # FIRST
            buf = chunk
        elif kind == 3:  # MIDDLE
            buf += chunk


def summarize(run_file: Path) -> dict:
    out: dict = {"history": {}}
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, project=r.run.project, name=r.run.display_name)
        elif kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            if "loss" in items:
                out["history"][items["_step"]] = items["loss"]
    return out


def test_wandb_offline_run_and_requeue_keep_one_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    out = tmp_path / "job"
    common = [
        "training.seq_len=64",
        "training.warmup_steps=1",
        "checkpoint.interval=2",
        "metrics.tensorboard=false",
        "metrics.wandb=true",
        "metrics.wandb_project=tsproj",
        "metrics.wandb_run_name=tsrun",
    ]
    run_train(out, [*common, "training.steps=2"])
    run_train(out, [*common, "training.steps=4"])  # the requeued job: resumes at step 2
    run_id = (out / "wandb_run_id").read_text().strip()
    runs = sorted(out.glob("tb/*/wandb/offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    first, second = (summarize(next(r.glob("run-*.wandb"))) for r in runs)
    assert first["id"] == second["id"] == run_id
    assert first["project"] == "tsproj" and first["name"] == "tsrun"
    losses = read_losses(out)
    assert first["history"] == {1: losses[1], 2: losses[2]}
    assert second["history"] == {3: losses[3], 4: losses[4]}
