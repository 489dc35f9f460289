"""Named model architectures for capacity planning, and a config-only reader
for a model on disk.

The figures are the `config.json` values of each model's Hugging Face card;
planning needs the shapes, never the weights, so `kvserve plan` and
`kvserve simulate` can size a 70B fleet on a laptop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    """What planning needs of a model: its shapes, and the bytes its weights
    occupy when that is known exactly (a file on disk) rather than
    parameters x bytes per parameter."""

    name: str
    config: ModelConfig
    weight_file_bytes: int | None = None


PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Llama-3.1-8B config.json: hidden_size 4096, intermediate_size
    # 14336, num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 8,
    # vocab_size 128256, rope_theta 500000, max_position_embeddings 131072,
    # tie_word_embeddings false. head_dim = 4096 / 32 = 128.
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rope_theta=500000.0, max_position_embeddings=131072),
    # meta-llama/Llama-3.1-70B config.json: hidden_size 8192, intermediate_size
    # 28672, num_hidden_layers 80, num_attention_heads 64, num_key_value_heads 8,
    # vocab_size 128256, tie_word_embeddings false. head_dim = 8192 / 64 = 128.
    "llama-3.1-70b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        rope_theta=500000.0, max_position_embeddings=131072),
    # Qwen/Qwen2.5-7B config.json: hidden_size 3584, intermediate_size 18944,
    # num_hidden_layers 28, num_attention_heads 28, num_key_value_heads 4,
    # vocab_size 152064, rope_theta 1000000, tie_word_embeddings false, q/k/v
    # projections with bias. head_dim = 3584 / 28 = 128.
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
        attention_bias=True),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json: hidden_size 576,
    # intermediate_size 1536, num_hidden_layers 30, num_attention_heads 9,
    # num_key_value_heads 3, vocab_size 49152, rope_theta 100000,
    # max_position_embeddings 8192, tie_word_embeddings true. head_dim = 64.
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def preset(name: str) -> ModelSpec:
    """The named architecture; ValueError listing the known names otherwise."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return ModelSpec(name=key, config=PRESETS[key])


def resolve_model(preset_name: str | None, model_path: str | None) -> ModelSpec:
    """Exactly one of a preset name or a model path (folder or .gguf file)."""
    if (preset_name is None) == (model_path is None):
        raise ValueError("give exactly one of --preset NAME or --model PATH")
    if preset_name is not None:
        return preset(preset_name)
    return read_model_spec(Path(model_path))


def read_model_spec(path: Path) -> ModelSpec:
    """Shapes of a model on disk without loading a weight: a Hugging Face
    folder's config.json or a GGUF file's metadata. The weight bytes are the
    sizes of the weight files, which already account for quantization."""
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return _read_gguf(path)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(f"{str(path)!r} is neither a .gguf file nor a folder with config.json")
    config = _config_from_hf(json.loads(config_file.read_text()))
    weight_files = list(config_file.parent.glob("*.safetensors")) + list(config_file.parent.glob("*.bin"))
    weight_bytes = sum(f.stat().st_size for f in weight_files) or None
    return ModelSpec(name=config_file.parent.name, config=config, weight_file_bytes=weight_bytes)


def _config_from_hf(raw: dict) -> ModelConfig:
    arch = str(raw.get("model_type", "llama"))
    heads = int(raw["num_attention_heads"])
    eos = raw.get("eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
    )


def _read_gguf(path: Path) -> ModelSpec:
    import gguf  # only this path needs it; a preset plan stays import-light

    reader = gguf.GGUFReader(str(path))
    arch = _gguf_value(reader, "general.architecture")

    def field(key: str, default=None):
        value = _gguf_value(reader, f"{arch}.{key}")
        return default if value is None else value

    heads = int(field("attention.head_count"))
    hidden = int(field("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = field("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = ModelConfig(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(field("feed_forward_length")),
        num_hidden_layers=int(field("block_count")), num_attention_heads=heads,
        num_key_value_heads=int(field("attention.head_count_kv", heads)),
        head_dim=int(field("attention.key_length", hidden // heads)),
        max_position_embeddings=int(field("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
    )
    weight_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return ModelSpec(name=path.stem, config=config, weight_file_bytes=weight_bytes)


def _gguf_value(reader, key: str):
    """A scalar or string metadata value, None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    part = field.parts[field.data[0]]
    if field.types and field.types[0] == _gguf_string_type():
        return bytes(part).decode("utf-8")
    return part[0].item()


def _gguf_string_type():
    import gguf

    return gguf.GGUFValueType.STRING
