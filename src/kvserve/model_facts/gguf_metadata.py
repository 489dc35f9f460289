"""A llama.cpp GGUF file's metadata: the index of its key/value fields and
tensor table, and what they say about the model (ModelConfig, the embedded
byte-level BPE tokenizer and chat template).

The one reader of GGUF metadata: the weight loader (model/gguf_file.py
dequantizes tensors listed here), `kvserve plan` and `kvserve simulate` all
open a file through `GGUFIndex`. Reading the index maps the file and copies
no tensor data, so sizing a model from its GGUF costs milliseconds.

GGUF lists a tensor's dimensions fastest-first (ne0 = columns); the index
reports shapes row-major [rows, cols], i.e. Hugging Face's [out, in].
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvserve.model_facts.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from kvserve.model_facts.tokenizer import Tokenizer, byte_level_bpe

# Llama-3.x defaults llama.cpp bakes into a rope_freqs tensor instead of metadata.
_LLAMA3_ROPE_GUESS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}
_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


# -- the file format ----------------------------------------------------------
# gguf's GGUFReader builds a numpy view per metadata item, which takes seconds
# for a 49k-token vocabulary; this reads the same layout with struct in
# milliseconds and hands tensor bytes to gguf's dequantizers.
# Layout (v2/v3, little endian): magic "GGUF", u32 version, u64 tensor count,
# u64 kv count, kv pairs, tensor infos, padding to `general.alignment`, data.

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                  7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


class GGUFTensor(NamedTuple):
    name: str
    ggml_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # row-major, HF order ([out, in]); GGUF's dims reversed
    data: np.ndarray  # what gguf.quants.dequantize takes: raw bytes per row or float


class GGUFIndex:
    """Metadata (`fields`: key -> Python value) and tensors of a GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)
        self._pos = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise ModelLoadError(f"{path}: malformed or truncated GGUF header ({type(e).__name__}: {e})") from e

    def _read_header(self) -> None:
        magic, version, num_tensors, num_fields = self._unpack("<4sIQQ")
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.fields = dict(self._read_field() for _ in range(num_fields))
        infos = [self._read_tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        if self._pos + length > len(self._mv):
            raise ValueError("string runs past the end of the file")
        text = bytes(self._mv[self._pos:self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _read_field(self) -> tuple[str, object]:
        key = self._string()
        (value_type,) = self._unpack("<I")
        return key, self._value(value_type)

    def _value(self, value_type: int) -> object:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            return self._array(item_type, count)
        if value_type not in _SCALARS:
            raise ValueError(f"unknown metadata value type {value_type}")
        return self._unpack(_SCALARS[value_type])[0]

    def _array(self, item_type: int, count: int) -> list:
        if item_type in _NUMPY_SCALARS:
            dtype = np.dtype(_NUMPY_SCALARS[item_type])
            end = self._pos + count * dtype.itemsize
            if end > len(self._mv):
                raise ValueError("array runs past the end of the file")
            items = np.frombuffer(self._mv[self._pos:end], dtype=dtype).tolist()
            self._pos = end
            return [bool(x) for x in items] if item_type == 7 else items
        return [self._value(item_type) for _ in range(count)]

    def _read_tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{num_dims}Q")
        ggml_type, offset = self._unpack("<IQ")
        return name, dims, ggml_type, offset

    def _tensor(self, data_start: int, name: str, dims: tuple[int, ...], type_id: int,
                offset: int) -> GGUFTensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError as e:
            raise ModelLoadError(f"{self.path}: tensor {name} has unknown ggml type {type_id}") from e
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        shape = tuple(reversed(dims))
        num_elements = math.prod(dims)
        start, num_bytes = data_start + offset, num_elements * type_size // block_size
        if dims[0] % block_size or start + num_bytes > len(self._buf):
            raise ModelLoadError(f"{self.path}: tensor {name} lies outside the file (truncated download?)")
        raw = self._buf[start:start + num_bytes]
        if ggml_type.name in ("F32", "F16"):
            data = raw.view(np.float32 if ggml_type.name == "F32" else np.float16).reshape(shape)
        else:  # bytes per row; BF16 and block quants dequantize from these
            data = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        return GGUFTensor(name, ggml_type, shape, data)


# -- what the metadata says -----------------------------------------------------

class GGUFFacts:
    """What a GGUF file's metadata says about its model. `GGUFIndex` is the
    file format; this reads its fields by meaning."""

    def __init__(self, index: GGUFIndex) -> None:
        self.index = index
        self.path = index.path
        self.tensors = {t.name: t for t in index.tensors}
        self.architecture = self._str("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"kvserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def _value(self, key: str, default: object = None) -> object:
        return self.index.fields.get(key, default)

    def _str(self, key: str) -> str:
        value = self._value(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: metadata {key} is missing or not a string")
        return value

    def _arch(self, key: str, default: object = None, *, required: bool = False) -> object:
        value = self._value(f"{self.architecture}.{key}", default)
        if required and value is None:
            raise ModelLoadError(f"{self.path}: metadata {self.architecture}.{key} is missing")
        return value

    def tensor(self, name: str) -> GGUFTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        return tensor

    def weight_bytes(self) -> int:
        """Bytes of every tensor as stored (quantized blocks included)."""
        return sum(int(t.data.nbytes) for t in self.index.tensors)

    # -- ModelConfig ----------------------------------------------------------

    def config(self) -> ModelConfig:
        hidden = int(self._arch("embedding_length", required=True))
        num_heads = int(self._arch("attention.head_count", required=True))
        head_dim = int(self._arch("attention.key_length", hidden // num_heads))
        rope_dim = int(self._arch("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise ModelLoadError(f"{self.path}: partial rotary embeddings (rope dim {rope_dim} of "
                                 f"head dim {head_dim}) are not supported")
        tokens = self._value("tokenizer.ggml.tokens") or ()
        vocab_size = self.tensor("token_embd.weight").shape[0]  # [vocab, hidden]
        if tokens and len(tokens) > vocab_size:
            raise ModelLoadError(f"{self.path}: {len(tokens)} tokens but embeddings for {vocab_size}")
        bos = self._value("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=self.architecture,
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(self._arch("feed_forward_length", required=True)),
            num_hidden_layers=int(self._arch("block_count", required=True)),
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._arch("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(head_dim),
            max_position_embeddings=int(self._arch("context_length", 2048)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=self._eos_token_ids(),
        )

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = (self._value(k) for k in _EOS_KEYS)
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def _rope_scaling(self, head_dim: int) -> dict | None:
        kind = self._arch("rope.scaling.type")
        factor = self._arch("rope.scaling.factor")
        original = self._arch("rope.scaling.original_context_length")
        if "rope_freqs.weight" in self.tensors:
            return self._llama3_rope_from_freqs(head_dim)
        if kind in (None, "none") or factor in (None, 1.0):
            return None
        if kind not in ("linear", "yarn"):
            raise ModelLoadError(f"{self.path}: RoPE scaling type {kind!r} is not supported")
        scaling = {"rope_type": kind, "factor": float(factor)}
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def _llama3_rope_from_freqs(self, head_dim: int) -> dict:
        """llama.cpp stores Llama-3 RoPE scaling only as per-frequency divisors
        (rope_freqs). Accept it when it is exactly what the Llama-3 rule gives
        for the usual parameters; otherwise refuse rather than run a wrong RoPE."""
        from gguf.quants import dequantize

        tensor = self.tensors["rope_freqs.weight"]
        stored = dequantize(tensor.data, tensor.ggml_type).astype(np.float64).reshape(-1)
        theta = float(self._arch("rope.freq_base", 10000.0))
        # float32 storage blurs the factor (7.9999995); it is a round number.
        scaling = {"rope_type": "llama3", "factor": round(float(stored.max()), 4), **_LLAMA3_ROPE_GUESS}
        original = self._arch("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        if stored.shape != (head_dim // 2,) or not np.allclose(
                stored, llama3_rope_divisors(scaling, theta, head_dim), rtol=1e-4):
            raise ModelLoadError(
                f"{self.path}: its rope_freqs tensor is not Llama-3 RoPE scaling with "
                f"{_LLAMA3_ROPE_GUESS}; load the model's Hugging Face folder instead")
        return scaling

    # -- tokenizer ------------------------------------------------------------

    def tokenizer(self, config: ModelConfig) -> Tokenizer:
        model = self._value("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"{self.path}: GGUF tokenizer {model!r} is not supported; kvserve reads byte-level BPE "
                "(tokenizer.ggml.model = 'gpt2'), as Llama-3, Qwen2 and SmolLM use")
        tokens = self._value("tokenizer.ggml.tokens")
        merges = self._value("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ModelLoadError(f"{self.path}: GGUF has no tokenizer.ggml.tokens / merges")
        token_types = self._value("tokenizer.ggml.token_type") or ()
        add_bos = bool(self._value("tokenizer.ggml.add_bos_token", False))
        backend = byte_level_bpe(tokens, merges, token_types,
                                 pre_tokenizer=str(self._value("tokenizer.ggml.pre", "default")),
                                 add_bos_token_id=config.bos_token_id if add_bos else None)
        return Tokenizer(backend, bos_token_id=config.bos_token_id,
                         eos_token_ids=config.eos_token_ids,
                         chat_template=self._value("tokenizer.chat_template"))


def llama3_rope_divisors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama-3 RoPE scaling ([head_dim // 2])."""
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blended))
