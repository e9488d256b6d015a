"""tinker-cookbook 0.6.1's own recipes, unpatched, against `tools.serve` on a base served from
a Hugging Face folder (CPU, no network).

The base: a 2-layer Qwen3 of torchtitan's debug shape built with `transformers` (random
weights, the independent reference), saved the way `huggingface-cli download` leaves a
model: in a hub cache, `models--Qwen--Qwen3-8B-Base/snapshots/<rev>/`. The service serves
that folder (`checkpoint.load_hf`) under the name the layout carries, `Qwen/Qwen3-8B-Base`,
for which the cookbook picks its role-colon renderer (string stop "\\n\\nUser:"); the
client side loads the same name's tokenizer from the same cache (HF_HUB_OFFLINE=1).

The data: local folders in the datasets' own repository layouts and row formats
(`HuggingFaceH4/no_robots`: data/{train,test}-*.parquet of {prompt, prompt_id, messages,
category}; `openai/gsm8k`: a README declaring config `main`, main/{train,test}-*.parquet of
{question, answer}), in the working directory the recipes run in, where `datasets` resolves
a repository id to a local folder first.

The recipes run as their users run them: `python -m tinker_cookbook.recipes.sl_basic` and
`python -m tinker_cookbook.recipes.math_rl.train` with command-line settings only (tiny
sizes, base_url, no periodic saves: the cookbook's rolling/resume paths call REST routes
this service does not serve yet). math_rl trains with its default loss, stable_reinforce.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")
tinker = pytest.importorskip("tinker")

from tests.helpers.runs import ROOT  # noqa: E402
from tests.helpers.service_server import KEY, start_server  # noqa: E402

pytestmark = pytest.mark.slow

NAME = "Qwen/Qwen3-8B-Base"
REV = "0123456789abcdef0123456789abcdef01234567"
CONTEXT = 1024


def _hf_folder(hub: Path) -> Path:
    """The tiny Qwen3 in a hub-cache layout, with the embedded tokenizer (2048 ids, BOS/EOS)
    as a generic fast tokenizer (the renderer needs only encode/decode/bos/eos)."""
    import torch
    import transformers

    from data.tokenizer import resolve_tokenizer
    from tests.helpers.hf_reference import QWEN3_DEBUG, hub_snapshot

    snap = hub_snapshot(hub, NAME, REV)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**QWEN3_DEBUG, "num_hidden_layers": 2})
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(snap)
    tok = Path(resolve_tokenizer("embedded", vocab_size=QWEN3_DEBUG["vocab_size"]))
    shutil.copy(tok / "tokenizer.json", snap)
    tcfg = json.loads((tok / "tokenizer_config.json").read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (snap / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return snap


def _parquet(path: Path, rows: list[dict]) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


def _datasets(work: Path) -> None:
    chats = []  # sl_basic's batch is no_robots-sized (128): 2 train batches, 1 test batch
    for i in range(384):
        a, b = i % 7 + 1, i % 5 + 2
        q = f"What is {a} + {b}?"
        chats.append(
            {
                "prompt": q,
                "prompt_id": f"p{i}",
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": f"{a + b}"},
                ],
                "category": "Math",
            }
        )
    nr = work / "HuggingFaceH4" / "no_robots" / "data"
    _parquet(nr / "train-00000-of-00001.parquet", chats[:256])
    _parquet(nr / "test-00000-of-00001.parquet", chats[256:])
    gsm = work / "openai" / "gsm8k"
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}",
        }
        for a, b in [(3, 4), (5, 2), (6, 1), (2, 2), (7, 3), (1, 8)]
    ]
    _parquet(gsm / "main" / "train-00000-of-00001.parquet", rows[:4])
    _parquet(gsm / "main" / "test-00000-of-00001.parquet", rows[4:])
    (gsm / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
        "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n"
    )


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cookbook")
    snap = _hf_folder(tmp / "hub")
    work = tmp / "work"
    _datasets(work)
    sets = [
        "model.family=qwen3",
        "model.flavor=debugmodel",
        "model.layers=2",
        f"checkpoint.load_hf={snap}",
        "training.seq_len=256",
    ]
    srv = start_server(tmp / "svc", "--context", str(CONTEXT), sets=sets)
    client_env = dict(
        os.environ,
        TINKER_API_KEY=KEY,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_CACHE=str(tmp / "hub"),
        HF_DATASETS_CACHE=str(tmp / "datasets-cache"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        WANDB_MODE="disabled",
    )
    yield srv, snap, work, client_env
    assert srv.stop() == 0, srv.log_text()[-3000:]


def _run(env, module: str, *args: str) -> subprocess.CompletedProcess:
    srv, _, work, client_env = env
    proc = subprocess.run(
        [sys.executable, "-m", module, f"base_url={srv.url}", f"model_name={NAME}", *args],
        cwd=work,
        env=client_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-6000:], srv.log_text()[-3000:])
    return proc


def _metrics(log: Path) -> list[dict]:
    return [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines() if x.strip()]


GET_TOKENIZER = """
import sys, tinker
sc = tinker.ServiceClient(base_url=sys.argv[1])
tc = sc.create_lora_training_client(base_model=sys.argv[2], rank=4).result()
print(tc.get_info().model_data.tokenizer_id)
print(tc.get_tokenizer().encode(sys.argv[3], add_special_tokens=False))
sc.close("success").result()
"""


def test_hf_base_is_served_under_its_hub_name(env):
    """Listed under the cache layout's name with the chosen context; the SDK's
    get_tokenizer() loads that name's tokenizer from the client's cache (no network); and
    the served weights are the folder's: prompt logprobs equal transformers' on it."""
    from tokenizers import Tokenizer

    from tests.helpers.hf_reference import assert_served_logprobs_are_the_folders

    srv, snap, work, client_env = env
    rest = tinker.RestClient(base_url=srv.url, api_key=KEY)
    caps = rest.get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [
        (NAME, CONTEXT)
    ]
    text = "def add(a, b):\n    return a + b\n"
    out = subprocess.run(
        [sys.executable, "-c", GET_TOKENIZER, srv.url, NAME, text],
        cwd=work, env=client_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    tokenizer_id, ids_line = out.stdout.strip().splitlines()[-2:]
    ids = json.loads(ids_line)
    assert tokenizer_id == NAME
    assert ids == Tokenizer.from_file(str(snap / "tokenizer.json")).encode(text).ids
    sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
    sampler = sc.create_sampling_client(base_model=NAME).result()
    assert_served_logprobs_are_the_folders(sampler, snap, ids)
    sc.close("success").result()


def test_cookbook_sl_basic(env, tmp_path):
    log = tmp_path / "sl"
    _run(
        env,
        "tinker_cookbook.recipes.sl_basic",
        f"log_path={log}",
        "learning_rate=3e-3",
        "num_epochs=2",
        "lora_rank=8",
        "eval_every=3",
        "save_every=0",
    )
    rows = _metrics(log)
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 4, rows  # 256 chats / 128 per batch x 2 epochs
    assert nll[-1] < nll[0], nll  # it learned the answers
    # the cookbook's NLL evaluator scores the test split through sampling clients of the
    # trained weights (compute_logprobs): it sees the same improvement
    test = [r["test/nll"] for r in rows if "test/nll" in r]
    assert len(test) >= 2 and test[-1] < test[0], rows
    final = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert final[-1]["state_path"].startswith("tinker://")
    assert final[-1]["sampler_path"].startswith("tinker://")


def test_cookbook_math_rl_gsm8k_stable_reinforce(env, tmp_path):
    log = tmp_path / "rl"
    srv = env[0]
    before = len(srv.log_text().split("\n"))
    _run(
        env,
        "tinker_cookbook.recipes.math_rl.train",
        "env=gsm8k",
        f"log_path={log}",
        "group_size=2",
        "groups_per_batch=2",
        "max_tokens=12",
        "max_steps=2",
        "lora_rank=8",
        "learning_rate=1e-3",
        "eval_every=0",
        "save_every=0",
        "behavior_if_log_dir_exists=delete",
    )
    rows = _metrics(log)
    assert len([r for r in rows if "env/all/reward/total" in r]) == 2, rows
    assert json.loads((log / "config.json").read_text())["loss_fn"] == "stable_reinforce"
    ops = srv.log_text().split("\n")[before:]
    # every step: the group's samples (string stop "\n\nUser:"), one stable_reinforce
    # forward_backward on provenance the service resolved against its records, one step
    assert sum("kind=forward_backward" in x for x in ops) == 2
    assert sum("kind=optim_step" in x for x in ops) == 2
    assert sum("kind=sample " in x for x in ops) >= 2 * 2 * 2  # steps x groups x group_size
    final = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()]
    assert final[-1]["sampler_path"].startswith("tinker://")
