"""Prompt text of a given token length, for the HTTP client only.

With a tokenizer (a local tokenizer.json, GGUF file or model folder, read by
model_facts/source.py as the server reads it) the text is cut at token level and re-checked
until it encodes to exactly the target count (without special tokens; a chat
template adds its own). Without one, the approximation is one common English
word per token: each word below, with its leading space, is a single token in
the GPT-2, Llama and SmolLM BPE vocabularies, so the count is right to within
the tokenizer's first-word and template effects (a few tokens).

Words are drawn at random per request, so unrelated prompts share no prefix
beyond chance; requests of one prefix group start with the same text.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvserve.bench.workload import RequestSpec

if TYPE_CHECKING:
    from kvserve.model_facts.tokenizer import Tokenizer

_COMMON_WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at
which but have an they you were her she there one all we can has been if more when
will would who so no time people year new work day way world life part number water
house city school state family group system program question night point home room
market money story fact month right study book word business issue side kind head
service friend power hour game line end member law car name result change team
minute idea body information back parent face level office door health person art
war history party morning reason research girl moment air teacher force education
"""
WORDS = tuple(f" {w}" for w in dict.fromkeys(_COMMON_WORDS.split()))
MAX_FIT_ROUNDS = 8


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class _PromptTokenizer:
    """A model's tokenizer counting and cutting text without special tokens
    (a chat template or the server adds those)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """The tokenizer of a local tokenizer.json, .gguf file or model folder,
    read by kvserve's one tokenizer loader (model_facts; never downloads)."""
    from kvserve.model_facts.source import load_tokenizer as load_model_tokenizer  # tokenizers, jinja2

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return _PromptTokenizer(load_model_tokenizer(path))


class PromptBuilder:
    """Builds the text of each request; identical prefixes per prefix group."""

    def __init__(self, tokenizer: TextTokenizer | None = None, seed: int = 0, run: str = "") -> None:
        self._tok = tokenizer
        self._seed = seed
        self._run = run  # salts each request's own words, not the shared prefixes
        self._prefixes: dict[int, str] = {}

    def for_run(self, run: str) -> "PromptBuilder":
        """A builder whose requests' own words are new for `run` (a sweep's
        rate), while prefix groups keep their text: a server's prefix cache
        then holds what a real workload shares (system prompts) and not the
        last run's whole prompts, which would make every run after the first
        a cache hit wherever the cache holds them all."""
        builder = PromptBuilder(self._tok, self._seed, run)
        builder._prefixes = self._prefixes
        return builder

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count_tokens(self, text: str) -> int:
        """Tokens of `text`: exact with a tokenizer, else the word count."""
        return len(self._tok.encode(text)) if self._tok else len(text.split())

    def build(self, spec: RequestSpec) -> str:
        rng = random.Random(f"{self._seed}:prompt:{spec.index}" + (f":{self._run}" if self._run else ""))
        prefix = ""
        if spec.prefix_group is not None:
            prefix = self._prefix(spec.prefix_group.group_id, spec.prefix_group.prefix_tokens)
        return self._fit(prefix, spec.prompt_tokens, rng)

    def _prefix(self, group_id: int, num_tokens: int) -> str:
        if group_id not in self._prefixes:
            rng = random.Random(f"{self._seed}:prefix:{group_id}")
            self._prefixes[group_id] = self._fit("", num_tokens, rng)
        return self._prefixes[group_id]

    def _fit(self, prefix: str, target: int, rng: random.Random) -> str:
        """`prefix` + random words, `target` tokens in all."""
        have = self.count_tokens(prefix) if prefix else 0
        words = "".join(rng.choice(WORDS) for _ in range(max(1, target - have)))
        if self._tok is None:
            return (prefix + words).strip()
        return self._fit_tokens(prefix, words, target)

    def _fit_tokens(self, prefix: str, words: str, target: int) -> str:
        """Cut the words at token level until prefix + words encodes to
        `target` tokens; merges across the cut can shift the count by a
        token or two, so re-check and re-cut a few rounds, keeping the best.
        The text is not stripped: trimming a space would change the count."""
        ids = self._tok.encode(words)
        keep = max(1, target - (self.count_tokens(prefix) if prefix else 0))
        best, best_miss = prefix, None
        for _ in range(MAX_FIT_ROUNDS):
            keep = max(1, min(keep, len(ids)))
            text = prefix + self._tok.decode(ids[:keep])
            diff = target - self.count_tokens(text)
            if best_miss is None or abs(diff) < best_miss:
                best, best_miss = text, abs(diff)
            if diff == 0 or (diff > 0 and keep == len(ids)):
                break
            keep += diff
        return best
