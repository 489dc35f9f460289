"""model_facts/: one reader per fact, agreeing with transformers and with
itself wherever kvserve reads a model (the weight loader, `kvserve plan`,
`kvserve simulate`, `kvserve serve`, `kvserve bench`)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import transformers

from kvserve.cli import main
from kvserve.model.loader import load_model
from kvserve.model_facts import memory
from kvserve.model_facts.default_model import default_model_path
from kvserve.model_facts.hf_config import config_from_json, read_config
from kvserve.model_facts.source import load_tokenizer, read_model_config
from kvserve.plan.presets import read_model_spec
from tests.test_loader import tiny_hf_folder

# A small config.json as transformers writes it; each case below drops or
# nulls a key the two old readers disagreed on.
BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
CASES = {
    "llama, null KV heads": ("llama", {"num_key_value_heads": None}),
    "llama, no KV heads": ("llama", {"num_key_value_heads": "drop"}),
    "llama, explicit head_dim": ("llama", {"head_dim": 16}),
    "llama, null head_dim": ("llama", {"head_dim": None}),
    "llama, attention_bias": ("llama", {"attention_bias": True}),
    "llama, no optional keys": ("llama", {}),
    "qwen2, attention_bias false": ("qwen2", {"attention_bias": False}),
    "qwen2, no optional keys": ("qwen2", {}),
    "qwen2, null KV heads": ("qwen2", {"num_key_value_heads": None}),
}
HF_CLASSES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def _raw(arch: str, changes: dict) -> dict:
    raw = {"model_type": arch, **BASE}
    for key, value in changes.items():
        if value == "drop":
            raw.pop(key)
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize("case", list(CASES))
def test_config_json_reads_as_transformers_reads_it(case):
    arch, changes = CASES[case]
    raw = _raw(arch, changes)
    ours = config_from_json(raw)
    config_class, model_class = HF_CLASSES[arch]
    hf = config_class(**{k: v for k, v in raw.items() if k != "model_type"})
    attention = model_class(hf).model.layers[0].self_attn
    assert ours.num_key_value_heads == hf.num_key_value_heads
    assert ours.head_dim == attention.head_dim
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    # The biases the model really has, not what the config says it has.
    assert ours.attention_bias == (attention.q_proj.bias is not None)
    assert ours.kv_bytes_per_token(2) == 2 * hf.num_hidden_layers * attention.k_proj.out_features * 2


def test_every_reader_sees_one_config(tmp_path):
    # A Hugging Face folder and the default GGUF: the weight loader, the
    # config-only reader and `kvserve plan`'s spec read the same ModelConfig.
    folder = tiny_hf_folder(tmp_path / "qwen", "qwen2")
    for source in (folder, default_model_path()):
        loaded = load_model(source)
        assert read_model_config(source) == loaded.config
        assert read_model_spec(source).config == loaded.config
    assert read_config(folder / "config.json") == read_config(folder)
    assert read_config(folder).attention_bias is True


def test_one_tokenizer_loader_for_every_source(tmp_path):
    folder = tiny_hf_folder(tmp_path / "llama", "llama")
    text = "hello world, 12 tokens"
    by_folder = load_tokenizer(folder)
    by_file = load_tokenizer(folder / "tokenizer.json")
    assert by_file.encode(text, add_special_tokens=False) == by_folder.encode(text, add_special_tokens=False)
    assert by_folder.eos_token_ids[0] == read_config(folder).eos_token_ids[0]
    gguf = load_tokenizer(default_model_path())
    assert gguf.content_hash() == load_model(None).tokenizer.content_hash() == load_tokenizer().content_hash()


def test_kv_bytes_to_blocks_is_one_rule():
    config = config_from_json(_raw("llama", {}))  # 2 layers x 2 KV heads x 8 dim: 64 elements per token
    assert config.kv_bytes_per_token(4) == 256 and config.kv_bytes_per_token(0.5) == 32
    assert memory.kv_bytes_per_block(config, 16, 2) == 2048
    assert memory.num_kv_blocks(2048 * 10 + 2047, config, 16, 2) == 10  # a partial block is no block
    assert memory.blocks_in(2047, 2048) == 0
    with pytest.raises(ValueError, match="holds no block"):
        memory.num_kv_blocks(2047, config, 16, 2)
    assert memory.dtype_bytes("torch.bfloat16") == memory.dtype_bytes("bf16") == 2


def _serve_num_blocks(folder, *flags: str) -> int:
    """The blocks `kvserve serve` allocates with these flags: its own parser,
    flags -> EngineConfig, the engine's runner."""
    from kvserve.engine.cli import engine_config
    from kvserve.engine.core import EngineCore
    from kvserve.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(folder), "--device", "cpu", *flags])
    loaded = load_model(args.model)
    return EngineCore(loaded.config, loaded.weights, loaded.tokenizer, engine_config(args)).runner.num_blocks


def _simulate_num_blocks(folder, tmp_path, *flags: str) -> int:
    out = tmp_path / "sim"
    assert main(["simulate", "--model", str(folder), "--hardware", "h100", "--workload", "short",
                 "--num-requests", "2", "--rate", "1", "--out", str(out), *flags]) == 0
    return json.loads((out / "report.json").read_text())["config"]["simulation"]["num_blocks"]


@pytest.mark.parametrize("dtype, blocks", [("float32", 512), ("bfloat16", 1024)])
def test_serve_and_simulate_agree_on_blocks_for_the_same_memory_and_dtype(tmp_path, dtype, blocks):
    # The tiny model: 2 layers x 2 KV heads x 16 head dim x 2 (K, V) = 128
    # elements per token, 8 KiB per block of 16 tokens at 4 bytes per
    # element: 4 MiB is 512 blocks in float32, 1024 in bfloat16.
    folder = tiny_hf_folder(tmp_path / "m", "llama")
    served = _serve_num_blocks(folder, "--kv-cache-memory", "4MiB", "--dtype", dtype)
    simulated = _simulate_num_blocks(folder, tmp_path, "--kv-cache-memory", "4MiB", "--kv-dtype", dtype)
    assert served == simulated == blocks
    assert _serve_num_blocks(folder, "--kv-cache-memory", "4MiB", "--dtype", dtype, "--block-size", "8") \
        == _simulate_num_blocks(folder, tmp_path, "--kv-cache-memory", "4MiB", "--kv-dtype", dtype,
                                "--block-size", "8") == 2 * blocks


def test_runner_refuses_a_cache_without_one_block(tmp_path):
    folder = tiny_hf_folder(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match="holds no block"):
        _serve_num_blocks(folder, "--kv-cache-memory", "8191")  # one float32 block is 8 KiB
    assert main(["simulate", "--model", str(folder), "--hardware", "h100", "--kv-cache-memory", "8191",
                 "--kv-dtype", "float32",
                 "--num-requests", "1", "--out", str(tmp_path / "sim")]) == 2


def test_dtype_bytes_match_torch():
    for name in ("float32", "bfloat16", "float16"):
        assert memory.dtype_bytes(name) == getattr(torch, name).itemsize
