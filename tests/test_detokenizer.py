"""IncrementalDetokenizer with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.detokenizer import IncrementalDetokenizer
from kvserve.model_facts.source import load_tokenizer
from kvserve.model_facts.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def stream(tok: Tokenizer, ids: Sequence[int], stop: Sequence[str] = (), prompt: Sequence[int] = (),
           skip_special_tokens: bool = True):
    """Push every id; return (deltas, flushed text, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, stop=stop, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("text", [
    "emoji 😀🎉 family 👩‍👩‍👧 llama 🦙 end",
    "中文字符和日本語のテキスト、한국어도",
    "math Ω≈ç√∫ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
])
def test_split_characters_are_emitted_whole(tok, text):
    ids = tok.encode(text)
    # The test means something only if some character spans tokens.
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas, rest, detok = stream(tok, ids, prompt=tok.encode("User: say it\nAssistant:"))
    assert all(REPLACEMENT not in d.new_text for d in deltas)
    assert not any(d.stopped for d in deltas)
    assert "".join(d.new_text for d in deltas) + rest == tok.decode(ids) == text
    assert detok.text == text


def test_incomplete_character_at_the_end_is_flushed_as_decode_does(tok):
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte never arrives
    assert tok.decode(cut).endswith(REPLACEMENT)
    deltas, rest, _ = stream(tok, cut)
    assert all(REPLACEMENT not in d.new_text for d in deltas)
    assert "".join(d.new_text for d in deltas) + rest == tok.decode(cut)


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("The answer is 42. STOP HERE and then more text")
    stop = "STOP HERE"
    assert not any(stop in tok.decode([i]) for i in ids)  # it really spans tokens
    deltas, rest, detok = stream(tok, ids, stop=[stop])
    emitted = "".join(d.new_text for d in deltas)
    assert emitted == detok.text == "The answer is 42. "
    assert rest == ""
    first_stopped = next(n for n, d in enumerate(deltas) if d.stopped)
    assert tok.decode(ids[:first_stopped + 1]).endswith(stop)  # stopped on the completing token
    assert all(d == ("", True) for d in deltas[first_stopped + 1:])
    assert "S" not in emitted  # no part of the stop string ever leaked


def test_stop_string_inside_one_token_cuts_that_token(tok):
    ids = tok.encode("Hello world")
    deltas, _, detok = stream(tok, ids, stop=["llo"])
    assert detok.text == "He" and deltas[0].stopped


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    _, _, detok = stream(tok, ids, stop=["delta", "beta g", "gamma"])
    assert detok.text == "alpha "
    assert detok.stopped


def test_stop_string_made_of_a_split_emoji(tok):
    ids = tok.encode("party 🎉 time")
    _, _, detok = stream(tok, ids, stop=["🎉"])
    assert detok.text == "party "


def test_unfinished_stop_prefix_is_released_at_flush(tok):
    ids = tok.encode("Final answer: ST")
    deltas, rest, detok = stream(tok, ids, stop=["STOP"])
    emitted = "".join(d.new_text for d in deltas)
    assert emitted == "Final answer: "  # "ST" could still become "STOP"
    assert rest == "ST"
    assert detok.text == "Final answer: ST" and not detok.stopped


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hi there") + [tok.eos_token_id]
    _, rest, skipped = stream(tok, ids)
    assert skipped.text == "Hi there" and rest == ""
    _, _, kept = stream(tok, ids, skip_special_tokens=False)
    assert kept.text == "Hi there<|im_end|>"


class CountingTokenizer(Tokenizer):
    """Records how many ids each decode call had to look at."""

    def __init__(self, inner: Tokenizer) -> None:
        super().__init__(inner._backend, bos_token_id=inner.bos_token_id,
                         eos_token_ids=inner.eos_token_ids, chat_template=inner.chat_template)
        self.window_sizes: list[int] = []

    def decode(self, ids, skip_special_tokens=True):
        self.window_sizes.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_work_per_token_does_not_grow_with_output_length(tok):
    counting = CountingTokenizer(tok)
    text = ("The quick brown fox jumps over the lazy dog. 😀 中文 " * 60)
    ids = tok.encode(text)
    assert len(ids) > 900
    deltas, rest, detok = stream(counting, ids, stop=["never appears"], prompt=tok.encode("long prompt " * 200))
    assert detok.text == text
    assert max(counting.window_sizes) <= 12  # a few tokens of context, not the whole output
    assert sum(counting.window_sizes) <= 10 * len(ids)


# Pieces whose concatenations split characters over tokens in many ways.
_PIECES = st.sampled_from(["a", "b", " ", "ab", "\n", "😀", "🎉", "中", "文", "é", "ß", "x y", "<|im_end|>", "!!"])


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(_PIECES, min_size=1, max_size=25), stop_pieces=st.lists(_PIECES, min_size=1, max_size=3))
def test_deltas_equal_decode_cut_before_first_stop(tok, pieces, stop_pieces):
    text = "".join(pieces)
    ids = tok.encode(text)
    stop = "".join(stop_pieces).replace("<|im_end|>", "") or "a"
    deltas, rest, detok = stream(tok, ids, stop=[stop])
    full = tok.decode(ids)
    at = full.find(stop)
    expected = full if at < 0 else full[:at]
    assert all(REPLACEMENT not in d.new_text for d in deltas)
    assert "".join(d.new_text for d in deltas) + rest == detok.text == expected
    assert detok.stopped == (at >= 0)
