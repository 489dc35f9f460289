"""A llama.cpp GGUF file's tensors -> float32 weights under Hugging Face
names in HF orientation. The metadata (ModelConfig, tokenizer) and the
file's index of tensors are model_facts/gguf_metadata.py; this module reads
the tensor data the index points at.

GGUF lists a tensor's dimensions fastest-first (ne0 = columns); the index's
numpy arrays are already row-major [rows, cols], i.e. HF's [out, in].
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvserve.model_facts.config import ModelConfig, ModelLoadError
from kvserve.model_facts.gguf_metadata import GGUFFacts, GGUFIndex, GGUFTensor
from kvserve.model_facts.tokenizer import Tokenizer

# GGUF tensor name (after "blk.N.") -> HF parameter name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class RawQuantized(NamedTuple):
    """A matrix kept in its GGUF blocks: rows [out_features, bytes per row] uint8."""

    ggml_type: str  # "Q4_1", "Q8_0", ...
    rows: np.ndarray
    shape: tuple[int, int]  # [out_features, in_features]


class GGUFModel:
    """An open GGUF file. Construction reads only metadata (the index, or the
    `facts` already read from it); `weights()` dequantizes every tensor
    (float32, ~4 bytes per parameter)."""

    def __init__(self, path: Path, facts: GGUFFacts | None = None) -> None:
        self.path = path
        self._facts = GGUFFacts(GGUFIndex(path)) if facts is None else facts
        self._file = self._facts.index
        self._tensors = self._facts.tensors
        self.architecture = self._facts.architecture

    def config(self) -> ModelConfig:
        return self._facts.config()

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        return self._facts.tokenizer(config)

    # -- tensors --------------------------------------------------------------

    def _tensor(self, name: str) -> GGUFTensor:
        return self._facts.tensor(name)

    def weights(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """Every tensor dequantized to float32 under its HF name. Llama Q/K
        rows are un-permuted from llama.cpp's interleaved RoPE layout back to
        HF's rotate_half layout."""
        return {name: torch.from_numpy(array) for name, _, array in self._hf_arrays(config, frozenset())}

    def tensor_types(self) -> dict[str, str]:
        """GGUF tensor name -> its ggml type name ("Q4_1", "F32", ...)."""
        return {name: tensor.ggml_type.name for name, tensor in self._tensors.items()}

    def quantized_weights(self, config: ModelConfig, keep_types: frozenset[str]
                          ) -> dict[str, "torch.Tensor | RawQuantized"]:
        """Like `weights`, except that matrices whose ggml type is in `keep_types`
        come back as their raw GGUF blocks (`RawQuantized`, Q/K rows un-permuted
        like the float ones) instead of being dequantized."""
        return {name: RawQuantized(tensor.ggml_type.name, array, tensor.shape) if kept
                else torch.from_numpy(array)
                for name, tensor, array in self._hf_arrays(config, keep_types)
                for kept in [tensor.ggml_type.name in keep_types and len(tensor.shape) == 2]}

    def _hf_arrays(self, config: ModelConfig, keep_types: frozenset[str]):
        """(HF name, tensor, array) for every model tensor: the raw rows of blocks
        [out, bytes per row] for 2-D tensors whose type is in keep_types, else the
        dequantized float32 array."""
        for name, tensor in self._tensors.items():
            if name == "rope_freqs.weight":
                continue  # folded into config.rope_scaling
            hf_name = hf_tensor_name(name)
            if hf_name is None:
                raise ModelLoadError(f"{self.path}: unexpected tensor {name!r} for a "
                                     f"{config.architecture} model")
            keep = tensor.ggml_type.name in keep_types and len(tensor.shape) == 2
            array = np.array(tensor.data, copy=True) if keep else self._dequantize(tensor)
            if config.architecture == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
                array = unpermute_rope_rows(array, heads)  # whole rows move: raw blocks stay intact
            yield hf_name, tensor, array

    def _dequantize(self, tensor) -> np.ndarray:
        from gguf.quants import dequantize

        try:
            array = dequantize(tensor.data, tensor.ggml_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path}: tensor {tensor.name} has type {tensor.ggml_type.name}, "
                                 f"which the gguf package cannot dequantize") from e
        # copy: the dequantizer may return a read-only view of the mapped file.
        return np.array(array, dtype=np.float32, copy=True).reshape(tensor.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF parameter name of a GGUF tensor name; None when it has no place in a
    llama/qwen2 decoder."""
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match:
        layer, part, kind = match.groups()
        hf_part = _LAYER_TENSORS.get(part)
        return None if hf_part is None else f"model.layers.{layer}.{hf_part}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    hf_stem = _GLOBAL_TENSORS.get(stem)
    return None if hf_stem is None or kind != "weight" else f"{hf_stem}.weight"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows.

    weight: [num_heads * head_dim, hidden]. llama.cpp stores each head's rows
    as interleaved (even, odd) RoPE pairs; HF's rotate_half wants the first
    half of a head's rows, then the second half.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weight.shape))
