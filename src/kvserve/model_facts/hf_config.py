"""A Hugging Face model folder's config.json (and generation_config.json's
EOS ids) -> ModelConfig, read the way transformers reads it.

The one reader of config.json: the weight loader, `kvserve plan` and
`kvserve simulate` all go through `read_config`. Where a key is missing or
null it takes transformers' default for that architecture (LlamaConfig,
Qwen2Config), and where transformers ignores a key so does this reader:
Qwen2's attention always has q/k/v biases, whatever `attention_bias` says.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvserve.model_facts.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# transformers' defaults for keys a config.json may omit (LlamaConfig,
# Qwen2Config, transformers 4.46-5.x).
_RMS_NORM_EPS_DEFAULT = {"llama": 1e-6, "qwen2": 1e-6}
_MAX_POSITION_DEFAULT = {"llama": 2048, "qwen2": 32768}
# Qwen2Attention builds q/k/v with bias=True unconditionally; LlamaAttention
# uses config.attention_bias (default False).
_ALWAYS_ATTENTION_BIAS = frozenset({"qwen2"})


def read_json(path: Path) -> dict:
    """A JSON object from `path`; ModelLoadError saying what is wrong otherwise."""
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


def read_config(path: Path) -> ModelConfig:
    """ModelConfig of an HF folder, or of a config.json file itself; EOS ids
    from generation_config.json beside it when there is one."""
    config_file = path if path.is_file() else path / CONFIG_FILE
    raw = read_json(config_file)
    arch = raw.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{config_file}: model_type {arch!r} (architectures {raw.get('architectures')}) is not "
            f"supported; kvserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return config_from_json(raw, _generation_eos_ids(config_file.parent, raw))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_file}: incomplete or invalid ({type(e).__name__}: {e})") from e


def config_from_json(raw: dict, eos_token_ids: tuple[int, ...] | None = None) -> ModelConfig:
    """ModelConfig from config.json's dict (its model_type one of
    SUPPORTED_ARCHITECTURES); `eos_token_ids` default to its eos_token_id.
    KeyError / TypeError / ValueError when a required key is missing or a
    value has the wrong type."""
    arch = raw["model_type"]
    hidden, num_heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    rope_theta, rope_scaling = _rope(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=num_heads,
        # Missing or null: one KV head per query head (multi-head attention).
        num_key_value_heads=int(_value(raw, "num_key_value_heads", num_heads)),
        head_dim=int(_value(raw, "head_dim", hidden // num_heads)),
        rms_norm_eps=float(_value(raw, "rms_norm_eps", _RMS_NORM_EPS_DEFAULT[arch])),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_value(raw, "max_position_embeddings", _MAX_POSITION_DEFAULT[arch])),
        tie_word_embeddings=bool(_value(raw, "tie_word_embeddings", False)),
        attention_bias=arch in _ALWAYS_ATTENTION_BIAS or bool(_value(raw, "attention_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")) if eos_token_ids is None else eos_token_ids,
    )


def _value(raw: dict, key: str, default: object) -> object:
    """raw[key], or `default` when the key is missing or null (transformers
    treats both as "not given")."""
    value = raw.get(key)
    return default if value is None else value


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
    """generation_config.json's eos_token_id (what generate() stops on),
    else config.json's."""
    generation = folder / GENERATION_CONFIG_FILE
    eos = read_json(generation).get("eos_token_id") if generation.is_file() else None
    return _eos_ids(raw.get("eos_token_id") if eos is None else eos)


def _eos_ids(eos: object) -> tuple[int, ...]:
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(i) for i in eos) if isinstance(eos, list) else ()
