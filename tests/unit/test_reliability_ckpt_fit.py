"""A checkpoint that does not fit the model is refused before anything loads.

Checkpoints are written here with DCP (no training, no process group) from the debug
Llama built at other shapes; `train.main` runs in-process and must stop in
`runtime.session.prepare` with exit 2 and one line naming the key and what differs.
The reference for "what differs" is how each checkpoint was built (its layer count, the
tensor whose shape was changed), not the checker's own output. The same check inside the
checkpointer (a live model, no prepare) is tested with a tiny model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from core.atomic import write_manifest
from core.errors import ConfigError
from recipe.loader import load_recipe
from runtime.build import recipe_model_spec
from runtime.checkpoint import PARTIAL, CheckpointError, committed_steps
from runtime.checkpoint_fit import (
    Expected,
    Present,
    expected_from_config,
    expected_from_module,
    mismatch,
    read_present,
)
from tests.helpers.checkpoints import make_manager, save_steps
from tests.helpers.runs import train_main_error
from tools.reliability_report import record_case

LLAMA_KEYS = ("tok_embeddings.weight", "norm.weight", "lm_head.weight")


def debug_model(overrides: list[str]) -> torch.nn.Module:
    spec = recipe_model_spec(load_recipe(None, overrides))
    with torch.device("meta"):
        model = spec.model.build()
    return model.to_empty(device="cpu")


def write_checkpoint(
    path: Path,
    model: torch.nn.Module,
    *,
    optimizer: bool = True,
    edit: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A DCP folder as titanscale writes it: model tensors at the top level, AdamW-like
    per-parameter optimizer state, a train state; then a manifest (no checksums)."""
    sd: dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd.update(edit or {})
    if optimizer:
        sd["optimizer"] = {
            "state": {
                n: {"exp_avg": torch.zeros(p.shape), "step": torch.tensor(1.0)}
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        }
    sd["train_state"] = {"step": 2, "ntokens_seen": 0}
    path.mkdir(parents=True)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path)))
    write_manifest(path, {}, step=2)
    return path


def refused(argv: list[str], capsys, *, key: str, says: list[str]) -> str:
    code, err = train_main_error(argv, capsys)
    assert code == 2 and len(err) == 1, (code, err)
    line = err[0]
    assert f" {key}: " in line and "does not fit the model" in line, line
    for s in says:
        assert s in line, (s, line)
    return line


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Checkpoints of the debug Llama with 3 and 6 layers (written once per module)."""
    base = tmp_path_factory.mktemp("fit")
    return {
        3: write_checkpoint(base / "l3" / "step-2", debug_model(["model.layers=3"])),
        6: write_checkpoint(base / "l6" / "step-2", debug_model([])),
    }


def test_load_from_with_fewer_layers_is_refused(ckpts, tmp_path, capsys):
    """3-layer checkpoint into the 6-layer model: DCP would raise "Missing key" mid-load."""
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", f"checkpoint.load_from={ckpts[3]}"]
    refused(
        argv,
        capsys,
        key="checkpoint.load_from",
        says=["checkpoint has 3 transformer layers, the model 6", "layers.3.* missing"],
    )
    assert not (tmp_path / "metrics.jsonl").exists()
    record_case("checkpoint load", "fewer layers than the model")


def test_load_from_with_more_layers_is_refused_not_partial(ckpts, tmp_path, capsys):
    """6-layer checkpoint into `model.layers = 3`: loaded half of itself silently before."""
    # The silent partial load is real: torchtitan's model load is strict=False and DCP
    # reads only the keys asked for, so layers 3-5 of the checkpoint are simply ignored.
    small = debug_model(["model.layers=3"])
    sd = small.state_dict()
    dcp.load(sd, checkpoint_id=str(ckpts[6]))
    assert not small.load_state_dict(sd, strict=False).unexpected_keys  # nothing noticed
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=3"]
    argv += ["--set", f"checkpoint.load_from={ckpts[6]}"]
    line = refused(
        argv,
        capsys,
        key="checkpoint.load_from",
        says=["checkpoint has 6 transformer layers (layers.5.* present), the model 3"],
    )
    assert "model.layers = 3" in line
    record_case("checkpoint load", "more layers than the model (partial load)")


@pytest.mark.parametrize(("have", "want"), [(6, 3), (3, 6)])
def test_resume_with_another_layer_count_is_refused_and_prunes_nothing(
    ckpts, tmp_path, capsys, have, want
):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    os.symlink(ckpts[have], folder / "step-2")
    (folder / "step-1").mkdir()  # an older committed folder: must survive the failed start
    os.symlink(ckpts[have] / ".metadata", folder / "step-1" / ".metadata")
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", f"model.layers={want}"]
    argv += ["--set", "checkpoint.interval=5"]  # checkpointing on: the folder is resumed
    refused(
        argv,
        capsys,
        key="checkpoint.folder",
        says=[f"checkpoint has {have} transformer layers", f"the model {want}"],
    )
    assert sorted(os.listdir(folder)) == ["step-1", "step-2"]
    record_case("checkpoint load", "resume with another layer count")


def test_a_different_width_names_the_tensor_and_both_shapes(tmp_path, capsys):
    model = debug_model(["model.layers=2"])
    wide = torch.zeros(2048, 512)  # the debug model's embedding is [2048, 256]
    path = write_checkpoint(tmp_path / "w" / "step-2", model, edit={"tok_embeddings.weight": wide})
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=2"]
    argv += ["--set", f"checkpoint.load_from={path}"]
    refused(
        argv,
        capsys,
        key="checkpoint.load_from",
        says=[
            "tok_embeddings.weight is [2048, 512] in the checkpoint, the model expects [2048, 256]"
        ],
    )
    record_case("checkpoint load", "tensor shape differs")


def test_another_family_and_extra_or_missing_tensors_are_refused(tmp_path, capsys):
    """Qwen3's debug model (q/k norms) into Llama; an extra and a missing tensor."""
    qwen = write_checkpoint(
        tmp_path / "q" / "step-2", debug_model(["model.family=qwen3", "model.layers=2"])
    )
    base = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=2"]
    line = refused(
        [*base, "--set", f"checkpoint.load_from={qwen}"],
        capsys,
        key="checkpoint.load_from",
        says=[],
    )
    # Qwen3's debug attention is wider (head_dim 128): the first differing tensor is named.
    assert "in the checkpoint, the model expects" in line and "more tensors differ" in line, line
    record_case("checkpoint load", "another model family")

    llama = debug_model(["model.layers=2"])
    extra = write_checkpoint(
        tmp_path / "x" / "step-2", llama, edit={"layers.1.extra.weight": torch.zeros(4)}
    )
    refused(
        [*base, "--set", f"checkpoint.load_from={extra}"],
        capsys,
        key="checkpoint.load_from",
        says=["layers.1.extra.weight is not in the model", "silently drop"],
    )
    record_case("checkpoint load", "extra tensor in the checkpoint")

    sd_missing = {k: v for k, v in llama.state_dict().items() if k != "norm.weight"}
    path = tmp_path / "m" / "step-2"
    path.mkdir(parents=True)
    dcp.save(sd_missing, storage_writer=dcp.FileSystemWriter(str(path)))
    refused(
        [*base, "--set", f"checkpoint.load_from={path}"],
        capsys,
        key="checkpoint.load_from",
        says=["the model's norm.weight is not in the checkpoint"],
    )
    record_case("checkpoint load", "tensor missing from the checkpoint")


def test_lora_weights_into_a_model_without_adapters_are_refused(tmp_path, capsys):
    model = debug_model(["model.layers=2"])
    lora = {"layers.0.attention.wo.lora_a.weight": torch.zeros(8, 256)}
    path = write_checkpoint(tmp_path / "l" / "step-2", model, edit=lora)
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=2"]
    argv += ["--set", f"checkpoint.load_from={path}"]
    refused(argv, capsys, key="checkpoint.load_from", says=["LoRA adapter weights"])
    record_case("checkpoint load", "LoRA weights into a model without adapters")


def test_optimizer_state_of_other_parameters_is_refused_on_resume():
    """A full fine-tune's checkpoint resumed with LoRA on: the model tensors fit (a base
    for LoRA) but the optimizer state covers the frozen base, not the adapters."""
    from runtime.build import lora_converter

    recipe = load_recipe(None, ["model.layers=2", "finetune.mode=lora"])
    spec = recipe_model_spec(recipe)
    lora = expected_from_config(lora_converter(recipe).build().convert(spec.model))
    full = expected_from_config(recipe_model_spec(load_recipe(None, ["model.layers=2"])).model)
    assert lora.trainable and all(".lora_" in n for n in lora.trainable)
    present = Present(dict(full.model), set(full.trainable), has_optimizer=True)
    assert mismatch(present, lora, model_only=True) is None  # a base for LoRA: fine
    problem = mismatch(present, lora, model_only=False)
    assert problem and "optimizer state covers" in problem, problem
    assert f"covers {len(full.trainable)} parameters, the model trains {len(lora.trainable)}" in (
        problem
    )
    # And the same checkpoint fits its own model exactly.
    assert mismatch(present, full, model_only=False) is None
    record_case("checkpoint load", "optimizer state of other parameters")


def test_the_checkpointer_refuses_a_misfit_itself_and_moves_nothing(tmp_path):
    """No prepare (a tool or trainer that builds the manager directly): the live model is
    compared before DCP loads anything; the folder is left exactly as it was."""
    save_steps(tmp_path, [1, 2])
    before = sorted(os.listdir(tmp_path))
    mgr, model, _ = make_manager(tmp_path)
    # The same manager with a wider model: Linear(64, 64) saved, Linear(64, 128) loading.
    from runtime.checkpoint_fit import clean_name

    wide = torch.nn.Linear(64, 128)
    mgr.states["model"].model = [wide]
    with pytest.raises(CheckpointError) as ei:
        mgr.load()
    mgr.close()
    msg = str(ei.value)
    assert ei.value.key == "checkpoint.folder" and "\n" not in msg
    assert "bias is [64] in the checkpoint, the model expects [128]" in msg, msg
    assert "(and 1 more tensors differ)" in msg  # the weight, [64, 64] vs [128, 64]
    assert sorted(os.listdir(tmp_path)) == before and committed_steps(str(tmp_path)) == [1, 2]
    assert clean_name("layers.0._orig_mod.w") == "layers.0.w"
    record_case("checkpoint load", "misfit found by the checkpointer")


def test_misfit_is_a_config_error_with_one_line():
    e = Expected({"layers.0.w": (2,), "layers.1.w": (2,)}, set())
    p = Present({"layers.0.w": (2,)}, set(), has_optimizer=False)
    problem = mismatch(p, e, model_only=True)
    assert problem and "\n" not in problem and "1 transformer layers, the model 2" in problem
    assert issubclass(CheckpointError, ConfigError)
    for k in LLAMA_KEYS:  # the debug model's top-level tensors are what the check reads
        assert k in debug_model(["model.layers=1"]).state_dict()


def test_tools_serve_refuses_a_base_that_does_not_fit(ckpts, tmp_path, capsys):
    """The service loads its base through posttrain.adapters.load_base: the 6-layer
    checkpoint as the base of a 3-layer model is one line and exit 2, before serving."""
    from core.errors import exit_on_config_error
    from tools import serve

    argv = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=3"]
    argv += ["--set", f"checkpoint.load_from={ckpts[6]}", "--port", "65000"]
    with pytest.raises(SystemExit) as e:  # as `python -m tools.serve` (tools.cli.run) does
        exit_on_config_error(serve.main)(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert e.value.code == 2 and len(err) == 1, err
    assert " checkpoint.load_from: " in err[0] and "6 transformer layers" in err[0], err
    record_case("tools.serve", "base checkpoint with more layers")


def test_adapter_base_load_refuses_adapter_weights_and_accepts_its_base(ckpts, tmp_path):
    from posttrain.adapters import load_base

    model = debug_model(["model.layers=6"])
    load_base(model, str(ckpts[6]))  # the exact base loads
    lora = {"layers.0.attention.wo.lora_a.weight": torch.zeros(8, 256)}
    path = write_checkpoint(tmp_path / "a" / "step-2", model, edit=lora)
    with pytest.raises(ConfigError, match="LoRA adapter weights") as ei:
        load_base(model, str(path), file="r.toml")
    assert ei.value.key == "checkpoint.load_from"
    with pytest.raises(ConfigError, match="checkpoint has 3 transformer layers, the model 6"):
        load_base(model, str(ckpts[3]))
    record_case("checkpoint load", "adapter job base that does not fit", n=2)


def test_load_from_that_is_not_a_checkpoint_says_what_it_is(ckpts, tmp_path, capsys):
    """The run's checkpoint folder instead of a step, a Hugging Face folder, a file."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    partial = tmp_path / f"step-4{PARTIAL}"
    shutil.copytree(ckpts[3], partial)  # complete data, but never committed
    cases = {
        str(partial): "is an interrupted save (never committed, never loaded)",
        str(
            ckpts[3].parent
        ): f"not a checkpoint: point at one of its step folders, e.g. {ckpts[3]}",
        str(hf): "is a Hugging Face folder, not a DCP checkpoint: use checkpoint.load_hf",
        str(afile): "is a file; expected a checkpoint folder",
    }
    for path, says in cases.items():
        argv = [
            "--set",
            f"job.output_dir={tmp_path / 'o'}",
            "--set",
            f"checkpoint.load_from={path}",
        ]
        code, err = train_main_error(argv, capsys)
        assert code == 2 and len(err) == 1 and " checkpoint.load_from: " in err[0], err
        assert says in err[0], (says, err)
        record_case("checkpoint load", "load_from is not a checkpoint folder")


def test_resuming_a_model_only_checkpoint_is_refused(tmp_path, capsys):
    """A weights-only folder (an export, stock torchtitan's last_save_model_only) placed as
    step-3 of checkpoint.folder: DCP would fail on the first optimizer key."""
    model = debug_model(["model.layers=2"])
    write_checkpoint(tmp_path / "checkpoint" / "step-3", model, optimizer=False)
    argv = ["--set", f"job.output_dir={tmp_path}", "--set", "model.layers=2"]
    argv += ["--set", "checkpoint.interval=5"]
    refused(argv, capsys, key="checkpoint.folder", says=["model weights only"])
    # As a model-only start (load_from) the same folder fits.
    present = read_present(str(tmp_path / "checkpoint" / "step-3"))
    assert mismatch(present, expected_from_module([model]), model_only=True) is None
    record_case("checkpoint load", "resume of a model-only checkpoint")
