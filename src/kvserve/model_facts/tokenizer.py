"""Text <-> token ids and chat templates, over the `tokenizers` library.

One class serves both model sources: an HF folder's tokenizer.json is read
as is; a GGUF's vocabulary, merges and token types are rebuilt here into the
byte-level BPE that llama.cpp describes (`byte_level_bpe`). Loading one from
a model path is `model_facts.source.load_tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from kvserve.model_facts.config import ModelLoadError

# Split patterns for GGUF `tokenizer.ggml.pre` values: the regex the vocabulary's
# merges were learned with. None = GPT-2's built-in ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_PRE_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,  # + one token per digit, as SmolLM's tokenizer.json does
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that put every digit in a token of its own before BPE.
_DIGIT_SPLITTING_PRE = frozenset({"smollm"})
# Llama-3 takes a pre-token that is itself in the vocabulary whole, without
# merging (llama.cpp's ignore_merges, "ignore_merges" in its tokenizer.json).
_IGNORE_MERGES_PRE = frozenset({"llama-bpe", "llama3"})

GGUF_TOKEN_TYPE_CONTROL = 3  # llama.cpp's token_type for special tokens (<|im_end|>)
GGUF_TOKEN_TYPE_USER_DEFINED = 4  # added tokens matched whole but decoded as text


class Tokenizer:
    """Encode/decode text and render chat templates for one model.

    Special tokens (the backend's added tokens marked special) are matched
    whole in input text and dropped from `decode` unless asked for.
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], chat_template: str | None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.chat_template = chat_template
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        self._template: jinja2.Template | None = None

    # -- text <-> ids ---------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the model's
        post-processor adds (e.g. BOS), never the chat markup."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """A token's text on its own (for logprobs); may hold U+FFFD for a
        byte that is only part of a UTF-8 character."""
        return self._backend.decode([token_id], skip_special_tokens=False)

    # -- chat -----------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_vars: object) -> str:
        """Render `messages` with the model's chat template (sandboxed Jinja2,
        the variables Hugging Face passes; `template_vars` adds more, e.g.
        `tools`). Raises ValueError for a model without a template or a
        template that rejects the messages."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        try:
            return self._compiled_template().render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._token_or_empty(self.bos_token_id),
                eos_token=self._token_or_empty(self.eos_token_id), **template_vars)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"chat template does not compile: {e}") from e
        return self._template

    def _token_or_empty(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")

    # -- identity -------------------------------------------------------------

    def backend_json(self) -> str:
        """The full tokenizer definition as tokenizer.json text (what grammar
        engines read to map tokens to bytes)."""
        return self._backend.to_str()

    def content_hash(self) -> str:
        """sha256 of the full tokenizer definition (vocab, merges, rules)."""
        return hashlib.sha256(self._backend.to_str().encode()).hexdigest()

    def chat_template_hash(self) -> str:
        return hashlib.sha256((self.chat_template or "").encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        """Write the backend as a tokenizer.json (for debugging and tests)."""
        self._backend.save(str(path))

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, folder: Path, *, eos_token_ids: Sequence[int] = (),
                       tokenizer_file: str = "tokenizer.json") -> Tokenizer:
        """Read tokenizer.json (or `tokenizer_file`) and, where present,
        tokenizer_config.json (chat template, BOS/EOS). `eos_token_ids` (from
        generation_config.json) come first; the tokenizer's own eos token is
        appended."""
        path = folder / tokenizer_file
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ModelLoadError(f"{path}: not a valid tokenizer.json ({e})") from e
        tok_config = _read_json_or_empty(folder / "tokenizer_config.json")
        _add_bos_if_configured(backend, tok_config)
        bos_id = _token_id(backend, tok_config.get("bos_token"))
        eos_ids = list(eos_token_ids)
        own_eos = _token_id(backend, tok_config.get("eos_token"))
        if own_eos is not None:
            eos_ids.append(own_eos)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
                   chat_template=_chat_template(folder, tok_config))


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                   pre_tokenizer: str, add_bos_token_id: int | None = None) -> BackendTokenizer:
    """The GPT-2 style byte-level BPE that a GGUF with tokenizer.ggml.model ==
    "gpt2" describes. `pre_tokenizer` is tokenizer.ggml.pre; control tokens
    become special added tokens, user-defined ones plain added tokens."""
    if pre_tokenizer not in _GGUF_PRE_SPLITS:
        raise ModelLoadError(
            f"GGUF tokenizer pre-tokenizer {pre_tokenizer!r} is not supported; "
            f"kvserve knows: {', '.join(sorted(_GGUF_PRE_SPLITS))}")
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False,
                                          ignore_merges=pre_tokenizer in _IGNORE_MERGES_PRE))
    backend.pre_tokenizer = _gguf_pre_tokenizer(pre_tokenizer)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    _add_gguf_added_tokens(backend, tokens, token_types)
    if add_bos_token_id is not None:
        _prepend_bos(backend, tokens[add_bos_token_id], add_bos_token_id)
    return backend


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    split = _GGUF_PRE_SPLITS[pre]
    if split is None:
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    else:
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    if pre in _DIGIT_SPLITTING_PRE:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: Sequence[str],
                           token_types: Sequence[int]) -> None:
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == GGUF_TOKEN_TYPE_CONTROL]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == GGUF_TOKEN_TYPE_USER_DEFINED]
    # Both already sit in the vocabulary, so adding them keeps their ids and
    # only makes the tokenizer match them whole in raw text.
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _prepend_bos(backend: BackendTokenizer, bos_token: str, bos_id: int) -> None:
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B",
                                      special_tokens=[(bos_token, bos_id)]),
    ])


def _add_bos_if_configured(backend: BackendTokenizer, tok_config: dict) -> None:
    """Older Llama folders say add_bos_token in tokenizer_config.json and have
    no post-processor doing it; newer ones do it in tokenizer.json."""
    if not tok_config.get("add_bos_token") or backend.post_processor is not None:
        return
    bos = _token_content(tok_config.get("bos_token"))
    bos_id = _token_id(backend, bos)
    if bos is not None and bos_id is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _chat_template(folder: Path, tok_config: dict) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _token_content(token: object) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", "__type": "AddedToken", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None


def _token_id(backend: BackendTokenizer, token: object) -> int | None:
    content = _token_content(token)
    return None if content is None else backend.token_to_id(content)


def _read_json_or_empty(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Hugging Face's signature: templates written for it keep non-ASCII as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
