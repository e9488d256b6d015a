"""The collective weight push (rl.weight_sync = "nccl"), run on CPU with gloo standing in for
NCCL: the trainer's `WeightSync`/`VllmGenerator` and the engine process's own request handler
and worker functions (rl/vllm_server.py) run unchanged; only vLLM's `LLM` is replaced, by a
worker whose `reload_weights` copies each received tensor into a dict of the engine's
tensors. The reference for what the engine must hold is torchtitan's own state-dict adapter
(`to_hf`) on the trainer's model, cast to the engine's dtype."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from rl import weight_sync as ws
from rl.policy import full_state_dict
from rl.vllm_engine import HFView, VllmGenerator, WeightSync, resolve_sync


def test_buckets_pack_consecutive_tensors_up_to_the_limit():
    # aligned sizes (16 bytes): 16, 32, 48, 16, 112, 16; limit 64
    sizes = [10, 32, 40, 1, 100, 16]
    assert ws.plan_buckets(sizes, 64) == [[0, 2], [2, 4], [4, 5], [5, 6]]
    assert ws.plan_buckets([], 64) == []
    assert ws.plan_buckets([1000], 64) == [[0, 1]]  # too big: alone


class _Worker:
    """vLLM's worker as the server's functions use it: rank, model_runner.reload_weights."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.rank, self.params, self.model_runner = 0, params, self

    def reload_weights(self, weights_iterator: Any) -> None:
        for name, t in weights_iterator:
            p = self.params[name]  # an unknown name fails, as vLLM's loader does
            assert p.shape == t.shape
            p.copy_(t)


class _LLM:
    def __init__(self, worker: _Worker) -> None:
        self.worker, self.resets = worker, 0

    def collective_rpc(self, fn: Any, args: tuple = ()) -> list[Any]:
        return [fn(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


class _Conn:
    """The socket to the engine process, as a direct call of its request handler."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def call(self, op: str, *, timeout: float | None = None, **kw: Any) -> Any:
        import pickle

        # what crosses the real socket: plain picklable values only
        return self.engine.handle(pickle.loads(pickle.dumps({"op": op, **kw})))

    def close(self) -> None:
        pass


def _llama() -> tuple[torch.nn.Module, HFView]:
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:1]
    torch.manual_seed(0)
    model = cfg.build()
    model.init_states()
    return model, HFView(cfg, Llama3StateDictAdapter(cfg, None))


def test_pushes_reach_the_engine_model_bucket_by_bucket():
    from rl.vllm_server import Engine

    model, view = _llama()
    dtype = torch.bfloat16  # the engine's dtype: the push is cast on the trainer's side

    def reference() -> dict[str, torch.Tensor]:  # torchtitan's own HF conversion
        hf = view.state_dict_adapter.to_hf(model.state_dict())
        return {k: v.detach().to(dtype) for k, v in hf.items()}

    worker = _Worker({k: torch.zeros_like(v) for k, v in reference().items()})
    server = Engine()
    server.llm = _LLM(worker)
    conn = _Conn(server)
    sync = WeightSync.open(conn, backend="gloo", workers=1, dtype=dtype, timeout_s=60)
    sync.bucket_bytes = 4096  # many buckets, some tensors alone in theirs
    gen = VllmGenerator(conn, view, sync=sync)  # type: ignore[arg-type]
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p))
            gen.update_weights(full_state_dict(model), version)
            ref = reference()
            assert set(worker.params) == set(ref)
            for k, v in ref.items():
                assert torch.equal(worker.params[k], v), k
            assert gen.version == version and server.llm.resets == version
        per_push = sum(v.numel() * v.element_size() for v in ref.values())
        assert gen.bytes_sent == 2 * per_push
        man = ws.manifest(view.tensors(full_state_dict(model), dtype=dtype), 3, 4096)
        assert len(man["buckets"]) > 3
    finally:
        gen.sync = None
        del worker.titanscale_sync, sync
        import gc

        gc.collect()  # gloo's objects before the interpreter's exit (tools.cli.exit_process)


def test_a_loader_error_ends_the_push_on_both_sides_and_the_group_stays_usable():
    """The engine's model lacks a name the trainer sends (vLLM's loader raises): the trainer
    gets the engine's error once every bucket has gone (not the group's timeout, set short
    here so a hang would fail as one), and the next push succeeds."""
    from rl.vllm_server import Engine

    model, view = _llama()
    full = view.tensors(full_state_dict(model))
    missing = "model.layers.0.mlp.up_proj.weight"
    worker = _Worker({k: torch.zeros_like(v) for k, v in full.items() if k != missing})
    server = Engine()
    server.llm = _LLM(worker)
    conn = _Conn(server)
    sync = WeightSync.open(conn, backend="gloo", workers=1, dtype=torch.float32, timeout_s=30)
    sync.bucket_bytes = 4096
    try:
        with pytest.raises(KeyError, match="up_proj"):
            sync.push(view, full_state_dict(model), 1)
        worker.params[missing] = torch.zeros_like(full[missing])
        sync.push(view, full_state_dict(model), 2)
        assert all(torch.equal(worker.params[k], v) for k, v in full.items())
    finally:
        del worker.titanscale_sync, sync
        import gc

        gc.collect()


def test_a_disagreement_fails_on_both_sides_without_hanging():
    store = ws.rendezvous(0, 2, timeout_s=60)
    groups: dict[int, Any] = {}
    errors: dict[str, BaseException] = {}
    t = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}

    def peer() -> None:
        groups[1] = ws.join(ws.rendezvous(1, 2, port=store.port, timeout_s=60), "gloo", 1, 2, 60)
        try:
            list(ws.receive(groups[1], ws.manifest(t, 4), torch.device("cpu")))
        except ws.WeightSyncError as e:
            errors["receiver"] = e

    th = threading.Thread(target=peer)
    th.start()
    groups[0] = ws.join(store, "gloo", 0, 2, 60)
    with pytest.raises(ws.WeightSyncError, match="disagree"):
        ws.send(groups[0], t, ws.manifest(t, 3))  # version 3 sent, 4 expected
    th.join(30)
    assert not th.is_alive() and "disagree" in str(errors["receiver"])
    groups.clear()
    import gc

    gc.collect()


def _rl(**kw: Any) -> Any:
    base = {"generator": "vllm", "weight_sync": "auto", "engine_gpus": ""}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "rl,cuda,world,want",
    [
        (_rl(), False, 1, "shm"),  # auto on CPU
        (_rl(), True, 1, "shm"),  # auto, the engine sharing the trainer's GPU
        (_rl(engine_gpus="1"), True, 1, "nccl"),
        (_rl(engine_gpus="1,2"), True, 2, "one trainer rank"),  # engines would share them
        (_rl(weight_sync="shm", engine_gpus="1"), True, 1, "shm"),
        (_rl(weight_sync="nccl", engine_gpus="1"), True, 1, "nccl"),
        (_rl(weight_sync="nccl"), False, 1, "CUDA"),
        (_rl(weight_sync="nccl"), True, 1, "GPUs of its own"),
        (_rl(weight_sync="nccl", engine_gpus="1"), True, 2, "one trainer rank"),
        (_rl(generator="native", weight_sync="nccl"), True, 1, "rl.generator"),
        (_rl(engine_gpus="1"), False, 1, "CUDA"),
    ],
)
def test_transport_resolution(rl, cuda, world, want):
    if want in ("shm", "nccl"):
        assert resolve_sync(rl, cuda=cuda, world_size=world) == want
    else:
        with pytest.raises(ConfigError, match=want) as e:
            resolve_sync(rl, cuda=cuda, world_size=world)
        assert e.value.key in ("rl.weight_sync", "rl.engine_gpus")
        assert "\n" not in str(e.value)
