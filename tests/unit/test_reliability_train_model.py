"""recipe.model_checks against torchtitan's own checks: the same seq_len / vocabulary limits,
but before any process group, as one ConfigError naming the key.

The reference is torchtitan itself: `Decoder.Config.update_from_config` (the RoPE maximum it
enforces inside the Trainer) and the embedding table's size (an id >= vocab_size is an
IndexError in `nn.Embedding`).
"""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.models import model_config
from recipe.loader import check_recipe, load_recipe
from recipe.model_checks import MAX_VOCAB, check_model, check_vocab
from tools.reliability_report import record_case


def _torchtitan_accepts_seq_len(family: str, flavor: str, seq_len: int) -> bool:
    from torchtitan.trainer import Trainer

    cfg = Trainer.Config()
    cfg.training.seq_len = seq_len
    try:
        model_config(flavor, family).update_from_config(config=cfg)
    except ValueError as e:
        assert "RoPE" in str(e), e
        return False
    return True


@pytest.mark.parametrize(
    "family, flavor, seq_len",
    [
        ("llama3", "debugmodel", 131072),
        ("llama3", "debugmodel", 131073),
        ("llama3", "debugmodel", 1_000_000),
        ("qwen3", "debugmodel", 4096),
        ("qwen3", "debugmodel", 4097),
        ("qwen3", "8B", 40961),
    ],
)
def test_seq_len_limit_equals_torchtitans(family, flavor, seq_len):
    recipe = load_recipe(
        None, [f"model.family={family}", f"model.flavor={flavor}", f"training.seq_len={seq_len}"]
    )
    expect_ok = _torchtitan_accepts_seq_len(family, flavor, min(seq_len, 2**40))
    if expect_ok:
        check_model(recipe)
        return
    with pytest.raises(ConfigError) as e:
        check_recipe(recipe, 1)  # check_recipe runs check_model: every tool gets it
    msg = str(e.value)
    assert e.value.key == "training.seq_len" and "model.flavor" in msg, msg
    assert str(model_config(flavor, family).max_seq_len) in msg, msg
    assert "\n" not in msg
    record_case("train.py", "model shape")


def test_vocab_check_matches_the_embedding_table():
    """An id the embedding table cannot index is refused; the largest id it can is accepted."""
    import torch

    recipe = load_recipe(None, ["model.vocab_size=300"])
    emb = torch.nn.Embedding(300, 4)
    emb(torch.tensor([299]))  # the reference: 300 ids fit
    with pytest.raises(IndexError):
        emb(torch.tensor([300]))
    check_vocab(recipe, 300, "tok")
    with pytest.raises(ConfigError) as e:
        check_vocab(recipe, 301, "tok")
    msg = str(e.value)
    assert e.value.key == "model.vocab_size" and "model.tokenizer" in msg and "301" in msg, msg
    record_case("train.py", "model shape")
    # The flavor's own vocabulary (no override) is named as such.
    with pytest.raises(ConfigError, match="vocabulary"):
        check_vocab(load_recipe(None, []), 2049, "tok")
    record_case("train.py", "model shape")


def test_vocab_over_int32_is_refused():
    with pytest.raises(ConfigError) as e:
        check_model(load_recipe(None, [f"model.vocab_size={MAX_VOCAB + 1}"]))
    assert e.value.key == "model.vocab_size"
    record_case("train.py", "model shape")


def test_tokenizer_id_count_counts_added_tokens(tmp_path):
    """The embedded tokenizer's specials are added tokens: the count must include them."""
    from tokenizers import Tokenizer

    from data.tokenizer import resolve_tokenizer, tokenizer_id_count

    folder = resolve_tokenizer("embedded", vocab_size=300)
    tok = Tokenizer.from_file(f"{folder}/tokenizer.json")
    eos = tok.token_to_id("<|end_of_text|>")
    assert eos is not None and tokenizer_id_count(folder) > eos
    assert tokenizer_id_count(str(tmp_path)) is None


def test_dense_attention_memory_against_a_real_allocation():
    """The byte count equals what torch's dense attention allocates for its scores, and a
    seq_len whose matrices exceed the machine is refused naming training.seq_len."""
    import torch

    from recipe.model_checks import check_dense_attention_memory, dense_attention_bytes

    r = load_recipe(None, ["training.seq_len=64", "training.local_batch_size=2"])
    q = torch.zeros(2, 16, 64, 16)
    scores = q @ q.transpose(-1, -2)
    probs = scores.softmax(-1)
    measured = scores.numel() * scores.element_size() + probs.numel() * probs.element_size()
    assert dense_attention_bytes(r) == measured
    check_dense_attention_memory(r, total_bytes=measured)
    with pytest.raises(ConfigError) as e:
        check_dense_attention_memory(r, total_bytes=measured - 1)
    assert e.value.key == "training.seq_len" and "kernels.attention" in str(e.value)
    record_case("train.py", "model shape")


def test_host_memory_check_counts_what_adamw_holds():
    """16 bytes per parameter: what torch's AdamW actually holds after one step (fp32 weight,
    gradient, exp_avg, exp_avg_sq), measured; a model whose state exceeds the machine is
    refused naming the key that sized it."""
    import torch

    from recipe.model_checks import TRAIN_BYTES_PER_PARAM, check_host_memory, effective_shape

    lin = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(1, 8)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in lin.parameters())
    held = sum(p.numel() * p.element_size() for p in lin.parameters())
    held += sum(p.grad.numel() * p.grad.element_size() for p in lin.parameters())
    held += sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for k, t in s.items()
        if k != "step"
    )
    assert held == n * TRAIN_BYTES_PER_PARAM

    r = load_recipe(None, [])
    need = effective_shape(r).total_params * TRAIN_BYTES_PER_PARAM
    check_host_memory(r, need)
    with pytest.raises(ConfigError) as e:
        check_host_memory(r, need - 1)
    assert e.value.key == "model.flavor", str(e.value)
    with pytest.raises(ConfigError) as e:
        check_host_memory(load_recipe(None, ["model.vocab_size=2147483647"]), 24 * 2**30)
    assert e.value.key == "model.vocab_size" and "GiB" in str(e.value)
    record_case("train.py", "model shape", n=2)


def test_vocab_json_tokenizer_id_count(tmp_path):
    """A vocab.json + merges.txt tokenizer (no tokenizer.json): the ids torchtitan's own
    tokenizer loads from it (the reference)."""
    import json

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from data.tokenizer import tokenizer_id_count

    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    ref = HuggingFaceTokenizer(tokenizer_path=str(tmp_path))  # torchtitan's own loading
    assert tokenizer_id_count(str(tmp_path)) == max(ref.get_vocab().values()) + 1


def test_rl_generation_limits():
    """max_new_tokens past the RoPE table is refused; the KV-cache estimate uses the
    generator's own batch limit and cache shape (rows x positions x kv heads x head_dim)."""
    import inspect

    from recipe.model_checks import (
        GENERATOR_MAX_BATCH,
        check_host_memory,
        effective_shape,
        rl_kv_cache_bytes,
    )
    from rl.generator import Generator

    assert inspect.signature(Generator).parameters["max_batch"].default == GENERATOR_MAX_BATCH
    rl = ["rl.enabled=true", "rl.max_new_tokens=1000"]
    r = load_recipe("recipes/rl_debug.toml", rl)
    s = effective_shape(r)
    rows = min(16 * 8, GENERATOR_MAX_BATCH)
    assert rl_kv_cache_bytes(r) == rows * 1000 * s.n_layers * 2 * s.n_kv_heads * s.head_dim * 4
    with pytest.raises(ConfigError) as e:
        check_host_memory(r, rl_kv_cache_bytes(r) - 1)
    assert e.value.key == "rl.max_new_tokens"
    with pytest.raises(ConfigError) as e:
        check_model(load_recipe("recipes/rl_debug.toml", ["rl.max_new_tokens=131072"]))
    assert e.value.key == "rl.max_new_tokens" and "131072" in str(e.value)
    record_case("train.py", "model shape", n=2)
