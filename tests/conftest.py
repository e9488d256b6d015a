"""Shared fixtures. Helpers live in `tests/helpers/` (import those, never this file).

The repository root goes on sys.path so tests import the project's packages and
`tests.helpers` from any tier.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# No test reaches the network (a fresh clone's run must not hang on the Hub or fail on it);
# tests of the offline error need these set, and child processes inherit them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tests.helpers.runs import child_env  # noqa: E402


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory) -> str:
    """One seed checkpoint of the debug model, shared by every equivalence test."""
    out = tmp_path_factory.mktemp("seed")
    cmd = [
        sys.executable, "-m", "tools.seed_checkpoint", "--out", str(out / "seed"),
        "--set", f"job.output_dir={out / 'run'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = out / "seed" / "step-0"
    assert (path / ".metadata").exists()
    return str(path)


@pytest.fixture(scope="session")
def fast_reference(tmp_path_factory, seed_checkpoint) -> dict[int, float]:
    """step -> loss of the 1-process reference run every layout test compares with: the debug
    recipe, FAST settings (seq 128, 5 steps), global batch 4, from the seed checkpoint.
    Shared by tests/integration/test_multiproc_layouts.py and test_placed_mesh_multiproc.py."""
    from tests.helpers.runs import FAST, read_losses, run_train

    out = tmp_path_factory.mktemp("fast_reference")
    run_train(
        out, [*FAST, "training.local_batch_size=4", f"checkpoint.load_from={seed_checkpoint}"]
    )
    losses = read_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5]
    return losses


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory, seed_checkpoint) -> Path:
    """Output folder of the uninterrupted 2-process FSDP2 run (FAST, local batch 2, so global
    batch 4, from the seed checkpoint), checkpointing at step 3 (saving changes no loss).
    The fsdp2 layout test reads its losses, the resharding test resumes from its step 3
    (tests/integration/test_multiproc_layouts.py), and the dead-rank restart is held to its
    losses (tests/integration/test_reliability_faults.py): one run for three claims."""
    from tests.helpers.runs import FAST, run_train

    out = tmp_path_factory.mktemp("fsdp2_run")
    sets = [*FAST, "training.local_batch_size=2", f"checkpoint.load_from={seed_checkpoint}",
            "checkpoint.interval=3"]  # fmt: skip
    run_train(out, sets, nproc=2)
    return out


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """One vLLM engine process for the session (start-up ~35-90 s on 2 cores): the tiny LoRA
    Llama of tests/helpers/vllm_models.py, float32, two LoRA slots. Yields (engine, model,
    view). Needs .venv-vllm (`bash scripts/setup.sh --vllm`; scripts/test.sh runs it): in
    CI its absence fails, elsewhere it skips with that command."""
    from posttrain.lora import base_state
    from rl.vllm_engine import (
        SETUP,
        EngineConfig,
        HFView,
        VllmEngine,
        engine_python,
        served_head_dim,
    )
    from tests.helpers.vllm_models import RANK, lora_llama

    if engine_python() is None:
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM engine environment is missing: run `{SETUP}`")
        pytest.skip(f"the vLLM engine environment is not installed: `{SETUP}`")
    model, cfg, sda = lora_llama()
    view = HFView(cfg, sda)
    view.head_dim = served_head_dim(view.heads()[2], cpu=True)  # 16 -> 64 (rl/vllm_engine.py)
    folder = str(tmp_path_factory.mktemp("vllm-base"))
    view.write_folder(folder, base_state(model))
    engine = VllmEngine(EngineConfig(folder, max_model_len=256, max_loras=2, max_lora_rank=RANK))
    yield engine, model, view
    engine.close()


@pytest.fixture(autouse=True)
def _isolated_root_logging():
    """Handlers a test adds to the root logger (torchtitan's init_logger binds one to the
    captured stderr of that test) are removed after it: a later test would otherwise log into a
    closed stream ("--- Logging error ---") and its one-line-error assertions would fail."""
    import logging

    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for h in list(root.handlers):
        if h not in before:
            root.removeHandler(h)


# The integration tier runs in two passes (scripts/test.sh): everything not `serial` on two
# xdist workers with `--dist loadfile` (a whole file per worker: its module fixtures are
# built once), then the `serial` tests alone. Serial: a claim a second worker's load would
# distort (a deadline, a filled disk, a signal's timing, a concurrency or peak-memory
# measurement), the README's commands (scripts/train.sh runs scripts/setup.sh, which may
# reinstall into the .venv the other worker runs from), or the Slurm lab (8 ranks and 4
# slurmd on 2 cores, requeues timed by Slurm). Multi-process tests run on the workers too: measured per test (CPU seconds, own
# and children's, TITANSCALE_TEST_CPU_LOG below) the serial pass used about one core of two.
# Not serial (they assert files, fields and seams, never a figure or a deadline): the
# benchmark tools' smoke tests (test_bench, test_kernel_bench_cpu, test_gpu_check_smoke), the
# crash at the save seam and the stop request.
SERIAL_FILES = frozenset({
    "test_reliability_ckpt_full_tmpfs.py", "test_service_shutdown.py",
    "test_service_admission.py", "test_service_load.py", "test_readme_commands.py",
    "test_reliability_train_extremes.py",
})  # fmt: skip


# CPU-bound files with no deadline and nothing measured from the machine: scripts/test.sh
# runs them beside the serial pass (one process), on the core the serial tests and the Slurm
# lab's jobs leave idle, instead of in the parallel pass.
BESIDE_SERIAL_FILES = frozenset({"test_dryrun_recipes.py"})


def pytest_collection_modifyitems(config, items):
    """`serial` on the Slurm tests and the files in SERIAL_FILES; `beside_serial` on the
    files in BESIDE_SERIAL_FILES."""
    for item in items:
        if item.path.name in SERIAL_FILES or item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.serial)
        if item.path.name in BESIDE_SERIAL_FILES:
            item.add_marker(pytest.mark.beside_serial)


@pytest.fixture(autouse=True)
def _vllm_setup_done(request):
    """scripts/test.sh installs .venv-vllm in the background while the other tests run and
    names, in $TITANSCALE_VLLM_SETUP_RC, the file its exit code lands in: a `vllm` test waits
    for it (about 4 minutes from a fresh machine's start) and fails on a failed install."""
    rc_file = os.environ.get("TITANSCALE_VLLM_SETUP_RC")
    if not rc_file or not request.node.get_closest_marker("vllm"):
        return
    import time

    rc = Path(rc_file)
    deadline = time.monotonic() + 1800
    while not rc.exists() and time.monotonic() < deadline:
        time.sleep(2)
    code = rc.read_text().strip() if rc.exists() else "none after 30 minutes"
    if code != "0":
        log = Path(str(rc) + ".log")
        tail = log.read_text()[-2000:] if log.exists() else ""
        pytest.fail(f"bash scripts/setup.sh --vllm failed (exit {code}):\n{tail}")


_CPU_LOG = os.environ.get("TITANSCALE_TEST_CPU_LOG")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $TITANSCALE_TEST_CPU_LOG set, one JSON line per test: its wall seconds (setup,
    call, teardown) and the CPU seconds it used, its own and its finished child processes'
    (what the suite's time on two cores is made of: a test using one core while the other
    idles can share the machine)."""
    if not _CPU_LOG:
        yield
        return
    import json
    import resource
    import time

    def cpu() -> float:
        a = resource.getrusage(resource.RUSAGE_SELF)
        b = resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    t0, c0 = time.monotonic(), cpu()
    yield
    wall, used = time.monotonic() - t0, cpu() - c0
    with open(_CPU_LOG, "a") as f:
        f.write(
            json.dumps({"test": item.nodeid, "wall_s": round(wall, 2), "cpu_s": round(used, 2)})
            + "\n"
        )


def pytest_configure(config):
    """Under CI=true a missing or broken tinker / peft / transformers fails the run here
    (tests/helpers/deps.py) instead of skipping the tests that importorskip it."""
    from tests.helpers.deps import ci_refusal

    why = ci_refusal()
    if why:
        raise pytest.UsageError(why)


def pytest_sessionfinish(session, exitstatus):
    """The reliability figures this process recorded (tools.reliability_report.record and
    record_case, called by the tests where they measure) are merged into
    $TITANSCALE_RELIABILITY_FIGURES once, here: whatever subset ran, in any order, under
    xdist one merge per worker. Without the variable nothing was kept and nothing is written."""
    from tools.reliability_report import flush

    flush()
