"""Named model architectures for capacity planning, and the shapes of a
model on disk (read by model_facts/, no weight loaded).

The figures are the `config.json` values of each model's Hugging Face card;
planning needs the shapes, never the weights, so `kvserve plan` and
`kvserve simulate` can size a 70B fleet on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.model_facts.config import ModelConfig
from kvserve.model_facts.hf_config import read_config
from kvserve.model_facts.source import guard_malformed, open_gguf, resolve_source


@dataclass(frozen=True)
class ModelSpec:
    """What planning needs of a model: its shapes, and the bytes its weights
    occupy when that is known exactly (a file on disk) rather than
    parameters x bytes per parameter."""

    name: str
    config: ModelConfig
    weight_file_bytes: int | None = None
    quantized: bool = False  # a GGUF whose layer matrices are Q8_0 / Q4_0 / Q4_1 (computed so, as they are)


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
    folder's (or a config.json file's) config, or a GGUF file's metadata. The
    weight bytes are the sizes of the weight files, which already account
    for quantization."""
    source = resolve_source(path)
    if source.suffix == ".gguf":
        facts = open_gguf(source)
        quantized = any(t.ggml_type.name in ("Q8_0", "Q4_0", "Q4_1") for t in facts.tensors.values())
        return ModelSpec(name=source.stem, config=guard_malformed(facts.config, source),
                         weight_file_bytes=facts.weight_bytes(), quantized=quantized)
    folder = source if source.is_dir() else source.parent
    weight_files = list(folder.glob("*.safetensors")) + list(folder.glob("*.bin"))
    weight_bytes = sum(f.stat().st_size for f in weight_files) or None
    return ModelSpec(name=folder.name, config=read_config(source), weight_file_bytes=weight_bytes)
