"""load_model: one entry point for the embedded default model, a GGUF file or
a Hugging Face folder. Whatever the source, the result is the same: a
ModelConfig, weights under HF parameter names in HF orientation (float32, or
with `quantization` other than "none" a GGUF's Q8_0 / Q4_0 / Q4_1 matrices
kept in their blocks as QuantizedWeights), a Tokenizer, and the versions that
identify what was loaded. Sources, configs
and tokenizers are model_facts/ (torch-free); this module adds the weights."""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.contract import ResolvedVersions
from kvserve.model import hf_folder
from kvserve.model.gguf_file import GGUFModel
from kvserve.model_facts import hf_config
from kvserve.model_facts.config import ModelConfig, ModelLoadError
from kvserve.model_facts.default_model import file_sha256
from kvserve.model_facts.source import guard_malformed, open_gguf, read_hf_tokenizer, resolve_source
from kvserve.model_facts.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "expected_weight_shapes", "load_model"]

log = logging.getLogger(__name__)
# GGUF types the quantized kernels compute on; float types are never "unsupported".
KERNEL_TYPES = frozenset({"Q8_0", "Q4_0", "Q4_1"})
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names ("model.layers.0.self_attn.q_proj.weight", ...) -> float32 tensors
    # in HF orientation ([out_features, in_features]), or QuantizedWeights of that
    # shape; no "lm_head.weight" when config.tie_word_embeddings.
    weights: dict[str, "torch.Tensor | QuantizedWeight"]
    tokenizer: Tokenizer
    versions: ResolvedVersions
    source: str  # the file or folder it was read from


def load_model(path: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
               quantization: str = "none") -> LoadedModel:
    """Read a model into memory (CPU tensors of `dtype`).

    None -> the embedded default model (sha256-verified); a directory -> an HF
    folder; a *.gguf file -> GGUF. Every failure is a ModelLoadError whose
    message says what is wrong and what is supported. quantization "none"
    dequantizes everything; any other value keeps a GGUF's Q8_0 / Q4_0 / Q4_1
    matrices quantized (never expanded to float), and other quantized types
    are dequantized with one log line (model/quantized.prepare_weights then
    applies an explicit type).
    """
    source = resolve_source(path)
    if source.is_dir():
        loaded = _load_hf_folder(source, dtype)
    else:
        loaded = _load_gguf(source, dtype, keep_quantized=quantization != "none")
    check_weights(loaded.config, loaded.weights, source)
    return loaded


def _load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool) -> LoadedModel:
    model = GGUFModel(path, open_gguf(path))
    config = guard_malformed(model.config, path)
    tokenizer = guard_malformed(lambda: model.tokenizer(config), path)
    if keep_quantized:
        weights = guard_malformed(lambda: _quantized_weights(model, config, dtype, path), path)
    else:
        weights = {name: t.to(dtype) for name, t in guard_malformed(lambda: model.weights(config), path).items()}
    return LoadedModel(config, weights, tokenizer, _versions(file_sha256(path), tokenizer), str(path))


def _quantized_weights(model, config: ModelConfig, dtype: torch.dtype, path: Path) -> dict:
    from kvserve.model.quantized import QuantizedWeight

    unsupported = sorted({t for t in model.tensor_types().values() if t not in KERNEL_TYPES | _FLOAT_TYPES})
    if unsupported:
        log.warning("%s: tensor types %s have no quantized kernel: those tensors are dequantized to float "
                    "(supported: %s)", path.name, ", ".join(unsupported), ", ".join(sorted(KERNEL_TYPES)))
    weights = {}
    for name, w in model.quantized_weights(config, KERNEL_TYPES).items():
        if isinstance(w, torch.Tensor):
            weights[name] = w.to(dtype)
        else:
            weights[name] = QuantizedWeight.from_gguf_rows(w.ggml_type.lower(), w.rows, w.shape[1])
    return weights


def _load_hf_folder(folder: Path, dtype: torch.dtype) -> LoadedModel:
    config = hf_config.read_config(folder)
    tokenizer = read_hf_tokenizer(folder, config)
    weights = hf_folder.read_weights(folder, config, dtype)
    return LoadedModel(config, weights, tokenizer, _versions(_folder_revision(folder), tokenizer), str(folder))


def _versions(model_revision: str, tokenizer: Tokenizer) -> ResolvedVersions:
    return ResolvedVersions(model_revision=model_revision, tokenizer_hash=tokenizer.content_hash(),
                            chat_template_hash=tokenizer.chat_template_hash())


def _folder_revision(folder: Path) -> str:
    """sha256 over (relative name, file sha256) of every file that defines the model."""
    manifest = hashlib.sha256()
    for file in hf_folder.manifest_files(folder):
        manifest.update(f"{file.relative_to(folder)}\0{file_sha256(file)}\n".encode())
    return manifest.hexdigest()


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a llama/qwen2 decoder of this config needs, with its shape."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: Path) -> None:
    """Raise ModelLoadError unless `weights` holds exactly the expected
    parameters with the expected shapes (a mismatch would otherwise surface
    as a shape error deep inside the first forward pass)."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    extra = sorted(weights.keys() - expected.keys())
    wrong = [f"{k}: {tuple(weights[k].shape)} != {expected[k]}"
             for k in sorted(expected.keys() & weights.keys()) if tuple(weights[k].shape) != expected[k]]
    problems = [f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}" if missing else "",
                f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}" if extra else "",
                f"wrong shapes {wrong[:5]}" if wrong else ""]
    problems = [p for p in problems if p]
    if problems:
        raise ModelLoadError(f"{source}: weights do not match a {config.architecture} model with this "
                             f"config: {'; '.join(problems)}")
