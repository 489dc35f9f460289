"""Read a Hugging Face model folder's weights: *.safetensors (single or
sharded) -> tensors under HF names, and the files that make up its revision.
Its config.json is model_facts/hf_config.py, its tokenizer
model_facts/source.py."""

from __future__ import annotations

from pathlib import Path

import torch

from kvserve.model_facts.config import ModelConfig, ModelLoadError
from kvserve.model_facts.hf_config import read_json

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Files whose bytes define the model's behaviour: they make up its revision.
MANIFEST_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "*.safetensors")


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
