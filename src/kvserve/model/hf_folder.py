"""Read a Hugging Face model folder: config.json -> ModelConfig, *.safetensors
(single or sharded) -> weights, tokenizer.json + tokenizer_config.json ->
Tokenizer, generation_config.json -> EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from kvserve.model.tokenizer import Tokenizer

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files whose bytes define the model's behaviour: they make up its revision.
MANIFEST_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "*.safetensors")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path.parent}: no {path.name}; an HF model folder needs "
                             "config.json, *.safetensors and tokenizer.json") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def read_config(folder: Path) -> ModelConfig:
    raw = read_json(folder / "config.json")
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{folder}: model_type {arch!r} (architectures {raw.get('architectures')}) is not supported; "
            f"kvserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return _config_from_json(raw, arch, _generation_eos_ids(folder, raw))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder / 'config.json'}: incomplete or invalid ({type(e).__name__}: {e})") from e


def _config_from_json(raw: dict, arch: str, eos_ids: tuple[int, ...]) -> ModelConfig:
    hidden, num_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6 if arch == "qwen2" else 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama only when its config says so.
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling). transformers < 5 writes rope_theta and
    rope_scaling; transformers >= 5 writes one rope_parameters dict."""
    params = dict(raw.get("rope_parameters") or {})
    params_theta = params.pop("rope_theta", 10000.0)
    theta = float(raw.get("rope_theta") or params_theta)
    scaling = dict(raw.get("rope_scaling") or params)
    if "type" in scaling:  # the older spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _generation_eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    generation = folder / "generation_config.json"
    eos = read_json(generation).get("eos_token_id") if generation.is_file() else None
    if eos is None:
        eos = raw.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or ())
    return tuple(int(i) for i in ids)


def read_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (kvserve reads fast-tokenizer files only)")
    return Tokenizer.from_hf_folder(folder, eos_token_ids=config.eos_token_ids)


def read_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in safetensors_files(folder):
        try:
            tensors = load_file(str(shard))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{shard}: not a readable safetensors file ({e})") from e
        weights.update((name, t.to(dtype)) for name, t in tensors.items())
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # a tied head is the embedding itself
    # Rotary caches some exporters include are recomputed by the model.
    return {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in {SAFETENSORS_INDEX} are missing: {missing}")
        return shards
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (PyTorch .bin files are not read)")
    return shards


def manifest_files(folder: Path) -> list[Path]:
    return sorted({p for pattern in MANIFEST_PATTERNS for p in folder.glob(pattern) if p.is_file()})
