"""kvserve's Tokenizer against Hugging Face's tokenizer for the same model."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub

import transformers  # noqa: E402

from kvserve.model_facts.default_model import default_model_path  # noqa: E402
from kvserve.model_facts.source import load_tokenizer  # noqa: E402
from kvserve.model_facts.tokenizer import Tokenizer  # noqa: E402

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing   ",
    "tabs\tand\nnewlines\r\n\n\n",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 done",
    "中文字符和日本語のテキスト、한국어도",
    "def f(x):\n    return x ** 2  # square\n\tpass\n",
    "numbers 1234567 3.14159 -42 1e-5",
    "don't won't I'm we'll they've",
    "Ünïcödé ñ ß Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|endoftext|>more<repo_name>x",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "中文?"}],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=True)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(ours, hf, messages, add_generation_prompt):
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_special_tokens_of_the_default_model(ours, hf):
    assert ours.vocab_size == len(hf) == 49152
    assert ours.eos_token_ids == (hf.eos_token_id,) and ours.eos_token_id == 2
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.encode("<|im_end|>") == [2]
    assert ours.special_token_ids == set(hf.all_special_ids) | set(range(17))
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert ours.token_to_id("<|im_start|>") == 1


def test_hf_folder_tokenizer_equals_transformers(tmp_path, hf):
    """A folder written by transformers (tokenizer.json, tokenizer_config.json,
    chat template file) reads back to the same behaviour."""
    hf.save_pretrained(tmp_path)
    folder_tok = Tokenizer.from_hf_folder(tmp_path, eos_token_ids=(2,))
    for text in TEXTS:
        assert folder_tok.encode(text) == hf.encode(text)
    assert folder_tok.eos_token_ids == (2,) and folder_tok.bos_token_id == 1
    for messages in CONVERSATIONS:
        assert folder_tok.apply_chat_template(messages) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_add_bos_token_from_tokenizer_config(tmp_path, ours):
    """Llama-2 style folders ask for BOS in tokenizer_config.json only."""
    ours.save(tmp_path / "tokenizer.json")
    tokenizer_json = json.loads((tmp_path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"add_bos_token": True, "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.encode("Hello") == [1] + ours.encode("Hello")
    assert tok.encode("Hello", add_special_tokens=False) == ours.encode("Hello")
    assert tok.decode(tok.encode("Hello")) == "Hello"


def _with_template(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok._backend, bos_token_id=tok.bos_token_id, eos_token_ids=tok.eos_token_ids,
                     chat_template=template)


def test_chat_template_is_sandboxed(ours):
    evil = _with_template(ours, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_errors_are_value_errors(ours):
    strict = _with_template(ours, "{% if messages[0]['role'] != 'user' %}"
                                  "{{ raise_exception('first message must be from the user') }}{% endif %}ok")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(ours, None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        _with_template(ours, "{% for %}").apply_chat_template([])


def test_template_sees_bos_eos_and_tojson(ours):
    tok = _with_template(ours, "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}")
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == \
        '<|im_start|>[{"role": "user", "content": "é"}]<|im_end|>'


def test_hashes_identify_tokenizer_and_template(ours):
    other_template = _with_template(ours, "{{ messages }}")
    assert other_template.content_hash() == ours.content_hash()
    assert other_template.chat_template_hash() != ours.chat_template_hash()
