"""Every command block of README.md, run (shortened with --set where it trains) or, where it
needs a cluster, GPUs or the network, checked: its flags parse, its files exist, its recipe
validates at its world size.

`readme_commands()` reads the README's indented and fenced blocks; each command is matched
to exactly one case of CASES, and `test_every_readme_command_has_a_case` fails on a command
no case knows, so a new README command cannot go untested.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import child_env, free_port

pytestmark = pytest.mark.slow  # trains, serves and plans: ~3 min on 2 cores

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PY = sys.executable


# The folder map: "name/   what it holds" (a path, then two or more spaces).
MAP_LINE = re.compile(r"^\w+(/|\.py)(\s+[\w.]+/)*\s{2,}\S")


def readme_blocks() -> list[tuple[str, str]]:
    """(kind, text) of every code block: ("shell", one command with its continuation lines
    joined) per command of an indented block, ("python", the source) per fenced block."""
    out: list[tuple[str, str]] = []
    lines = README.read_text().splitlines()
    i, prev_blank = 0, True
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("```python"):
            j = lines.index("```", i + 1)
            out.append(("python", "\n".join(lines[i + 1 : j])))
            i, prev_blank = j + 1, False
            continue
        if ln.startswith("    ") and prev_blank and MAP_LINE.match(ln.strip()):
            j = i
            while j < len(lines) and lines[j].startswith("    "):
                j += 1
            out.append(("map", "\n".join(x.strip() for x in lines[i:j])))
            i, prev_blank = j, False
            continue
        if ln.startswith("    ") and prev_blank:
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                cmd = lines[i].strip()
                while cmd.endswith("\\"):
                    i += 1
                    cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
                if cmd:
                    out.append(("shell", cmd))
                i += 1
            prev_blank = True
            continue
        prev_blank = not ln.strip()
        i += 1
    return out


def _strip_comment(cmd: str) -> str:
    return re.sub(r"\s+#\s.*$", "", cmd)


def case_of(kind: str, text: str) -> str:
    """The one case that covers a README block."""
    if kind == "python":
        return "tinker_script"
    if kind == "map":
        return "folder_map"
    cmd = _strip_comment(text)
    for prefix, case in (
        ("step ", "train_output_sample"),
        ("bash scripts/train.sh", "train_sh"),
        ("bash scripts/test.sh", "test_sh"),
        ("bash scripts/sft_debug.sh", "sft_debug_sh"),
        ("python -m tools.plan ", "planning_tool"),
        ("python -m tools.predict ", "planning_tool"),
        ("python -m tools.dryrun ", "dryrun"),
        ("python -m tools.launch ", "launch"),
        ("huggingface-cli download ", "hf_download"),
        ("python -m tools.torchrun ", "gpu_torchrun"),
        ("python train.py --recipe recipes/rl_debug.toml", "rl_debug"),
        ('python -c "import secrets', "key_file"),
        ("python -m tools.serve ", "serve"),
    ):
        if cmd.startswith(prefix):
            return case
    return "unknown"


def commands(case: str) -> list[str]:
    found = [t for k, t in readme_blocks() if case_of(k, t) == case]
    assert found, f"README has no command of case {case!r} any more: update this test"
    return found


def _argv(cmd: str) -> list[str]:
    """A README command line as argv for this interpreter (`python` -> sys.executable)."""
    argv = shlex.split(_strip_comment(cmd))
    return [PY if a == "python" else a for a in argv]


def _run(argv: list[str], tmp: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    env = child_env(preloaded=False)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return subprocess.run(argv, cwd=kw.pop("cwd", ROOT), env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)  # fmt: skip


def test_every_readme_command_has_a_case():
    blocks = readme_blocks()
    assert len(blocks) >= 10
    unknown = [t for k, t in blocks if case_of(k, t) == "unknown"]
    assert not unknown, f"README commands no case of this test covers: {unknown}"


def test_folder_map_names_what_exists():
    (text,) = commands("folder_map")
    rows = [ln for ln in text.splitlines() if MAP_LINE.match(ln)]  # not continuation lines
    names = [w for ln in rows for w in re.split(r"\s{2,}", ln)[0].split()]
    for extra in re.findall(r"\s{2,}([\w.]+/)\s{2,}", text):  # a second column's folder
        names.append(extra)
    assert len(names) >= 15, names
    missing = [n for n in names if not (ROOT / n).exists()]
    assert not missing, missing


def test_train_sh_trains_and_prints_the_documented_line(tmp_path):
    (cmd,) = commands("train_sh")
    (sample,) = commands("train_output_sample")
    p = _run([*_argv(cmd), "--set", "training.steps=3", "--set", "metrics.log_every=1",
              "--set", f"job.output_dir={tmp_path}/out"], tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr  # the step lines are log lines (stderr)
    steps = [
        ln[ln.index("step") :] for ln in out.splitlines() if re.search(r"step\s+\d+\s+loss", ln)
    ]
    assert steps, out[-2000:]
    # The same fields, in the same order, as the README's sample line.
    fields = [w for w in sample.split() if re.match(r"^[a-z/]+$", w)]
    got = [w for w in steps[-1].split() if re.match(r"^[a-z/]+$", w)]
    assert got == fields, (got, fields)
    assert (tmp_path / "out" / "summary.json").is_file()


def test_test_sh_is_what_ci_runs():
    (cmd,) = commands("test_sh")
    script = ROOT / _argv(cmd)[1]
    text = script.read_text()
    assert "scripts/setup.sh" in text and "pytest" in text and "mypy" in text and "ruff" in text
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_planning_tools_run_as_written(tmp_path):
    for cmd in commands("planning_tool"):
        p = _run(_argv(cmd), tmp_path, timeout=300)
        assert p.returncode == 0 and p.stdout.strip(), (cmd, p.stderr[-2000:])


def test_dryrun_command_prepares_its_ranks():
    """The full step of these ranks is tests/integration/test_dryrun_recipes.py's; here the
    README's flags, recipe, world and ranks go through the tool's own checks."""
    from tools.dryrun.cli import parse_args
    from tools.dryrun.job import prepare

    (cmd,) = commands("dryrun")
    args = parse_args(_argv(cmd)[3:])
    job = prepare(args.recipe, args.overrides, cluster_name=args.cluster, nodes=args.nodes,
                  ranks=args.rank, microbatches=args.microbatches)  # fmt: skip
    assert set(args.rank) <= set(job.ranks) and max(job.ranks) < job.world_size


def test_launch_command_renders_its_job_script(tmp_path):
    """Without sbatch here: the README's command with --dry-run (prints the script) and
    without --dry-run-rank (that refusal is tested by test_dryrun_recipes.py)."""
    (cmd,) = commands("launch")
    argv = _argv(cmd)
    assert "--dry-run-rank" in argv
    k = argv.index("--dry-run-rank")
    argv = argv[:k] + argv[k + 2 :] + ["--dry-run", "--out", str(tmp_path)]
    p = _run(argv, tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "#SBATCH" in p.stdout and "torchrun" in p.stdout


def test_gpu_sft_command_validates_its_recipe_and_download():
    """Needs 8 GPUs and the network: the recipe loads and splits over the README's process
    count, the launcher accepts the flags, and the download lands where the recipe reads."""
    from torch.distributed.run import parse_args as torchrun_args

    from recipe.loader import check_recipe, load_recipe

    (cmd,) = commands("gpu_torchrun")
    argv = _argv(cmd)[3:]
    a = torchrun_args(argv)
    recipe = load_recipe(argv[argv.index("--recipe") + 1])
    check_recipe(recipe, int(a.nproc_per_node))
    (dl,) = commands("hf_download")
    d = _argv(dl)
    assert d[d.index("--local-dir") + 1] == recipe.checkpoint.load_hf == recipe.model.tokenizer


def test_sft_debug_sh_steps_run_shortened(tmp_path, seed_checkpoint):
    """scripts/sft_debug.sh pretrains 200 steps, then fine-tunes 150 (about 15 min): each of
    its commands here, shortened, from the shared seed checkpoint."""
    (cmd,) = commands("sft_debug_sh")
    script = (ROOT / _argv(cmd)[1]).read_text()
    assert "recipes/debug.toml" in script and "posttrain.tasks" in script
    assert "recipes/sft_debug.toml" in script
    data = tmp_path / "letter_sort"
    p = _run([PY, "-m", "posttrain.tasks", "--out", str(data), "--train", "64",
              "--heldout", "16"], tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    p = _run([PY, "train.py", "--recipe", "recipes/sft_debug.toml",
              "--set", "training.steps=2", "--set", "training.warmup_steps=0",
              "--set", f"job.output_dir={tmp_path}/sft",
              "--set", f"checkpoint.load_from={seed_checkpoint}",
              "--set", f"data.source={data}/train.jsonl",
              "--set", f"data.eval_source={data}/heldout.jsonl"], tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert any((tmp_path / "sft" / "export").rglob("adapter_model.safetensors"))


def test_rl_debug_runs_shortened(tmp_path):
    (cmd,) = commands("rl_debug")
    p = _run([*_argv(cmd), "--set", "training.steps=1", "--set", "rl.sft_warmup_steps=1",
              "--set", "rl.eval_prompts=4", "--set", "rl.prompts_per_step=4",
              "--set", "rl.group_size=2", "--set", f"job.output_dir={tmp_path}/rl"],
             tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "rl" / "metrics.jsonl").is_file()


def test_key_file_serve_and_tinker_script(tmp_path, seed_checkpoint):
    """The README's key line, its tools.serve command (a free port, the seed checkpoint as
    the recipe's base) and its Python snippet with the SDK, unchanged but for URL and key."""
    from service.tenants import read_key_file

    (key_cmd,) = commands("key_file")
    p = subprocess.run(key_cmd.replace("python ", f"{PY} ", 1), shell=True, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    keys = tmp_path / "keys.txt"
    assert keys.stat().st_mode & 0o777 == 0o600
    (tenant,) = read_key_file(str(keys))[0].values()
    key = keys.read_text().split()[1]

    (serve,) = commands("serve")
    argv = _argv(serve)
    argv[argv.index("--port") + 1] = str(port := free_port())
    argv[argv.index("--api-key-file") + 1] = str(keys)
    argv += [
        "--storage",
        str(tmp_path / "storage"),
        "--set",
        f"checkpoint.load_from={seed_checkpoint}",
    ]
    env = child_env(preloaded=False)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        (snippet,) = commands("tinker_script")
        url = f"http://127.0.0.1:{port}"
        code = snippet.replace("http://localhost:8000", url).replace('"tml-..."', repr(key))
        code += "\nprint(training.get_info().model_data.model_name)\n"
        code = _wait_for(url) + code
        p = _run([PY, "-c", code], tmp_path, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:] + (tmp_path / "serve.log").read_text()[-3000:]
        assert "sft_debug" in p.stdout, p.stdout
    finally:
        proc.terminate()
        proc.wait(60)
    u = _run([PY, "-m", "tools.usage", "--storage", str(tmp_path / "storage")], tmp_path)
    assert u.returncode == 0 and tenant.name in u.stdout, u.stdout + u.stderr


def _wait_for(url: str) -> str:
    """Python that waits for the server's health route (it builds the model first)."""
    return (
        "import time, httpx\n"
        "for _ in range(360):\n"
        "    try:\n"
        f"        if httpx.get({url + '/api/v1/healthz'!r}, timeout=2).status_code == 200: break\n"
        "    except httpx.HTTPError: pass\n"
        "    time.sleep(0.5)\n"
    )


@pytest.fixture(autouse=True)
def _no_outputs_in_repo():
    """Commands run from the repository root must not leave outputs there."""
    before = set(os.listdir(ROOT))
    yield
    assert set(os.listdir(ROOT)) <= before | {"outputs"}
