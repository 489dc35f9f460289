"""Streaming token ids -> text, with stop strings.

Two things make this more than `decode(new_id)`:
- byte-level BPE can split one UTF-8 character over several tokens, and a
  tokenizer may decode a token differently depending on its left neighbour;
- a stop string can span tokens, and the text must end right before it.

Each push decodes only a short window of recent tokens (vLLM's
prefix/read-offset technique): `ids[prefix:read]` was already emitted and is
decoded again only as left context, `ids[read:]` is new. Text is released
once it no longer ends in U+FFFD (an incomplete character), and a tail that
could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvserve.model_facts.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first output token: enough for
# tokenizers whose decoding of a token depends on its neighbours.
_PROMPT_CONTEXT_TOKENS = 5
# Drop already-decoded ids from the front once this many have piled up, so
# memory stays bounded by the window, not the output length.
_TRIM_THRESHOLD_TOKENS = 64
_INCOMPLETE_CHAR = "\ufffd"


class DetokenizedDelta(NamedTuple):
    new_text: str  # text released by this push (may be empty)
    stopped: bool  # a stop string was found; nothing more will be released


class IncrementalDetokenizer:
    """Turn one request's output tokens into text deltas.

    Guarantees: concatenated deltas + flush() equal
    `tokenizer.decode(output_ids)` cut before the first stop string; no delta
    ever ends in a character split across tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        # ids: [left context from the prompt] + output ids not yet trimmed.
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded, not yet released: could start a stop string
        self._pieces: list[str] = []
        self._text_cache: str | None = ""
        self.stopped = False

    @property
    def text(self) -> str:
        """All text released so far."""
        if self._text_cache is None:
            self._text_cache = "".join(self._pieces)
        return self._text_cache

    def push(self, token_id: int) -> DetokenizedDelta:
        """Add one output token; return the text it releases. After a stop
        string is found every push returns ("", True)."""
        if self.stopped:
            return DetokenizedDelta("", True)
        self._ids.append(token_id)
        window_text = self._decode(self._ids[self._prefix_offset:])
        if window_text.endswith(_INCOMPLETE_CHAR):
            return DetokenizedDelta("", False)  # wait for the rest of the character
        self._pending += window_text[len(self._prefix_text):]
        self._advance_window()
        return self._release(final=False)

    def flush(self) -> str:
        """Release everything still held back (an incomplete character is
        decoded as U+FFFD, a partial stop string as text); call once when the
        request finishes for any reason other than a stop string."""
        if self.stopped:
            return ""
        window_text = self._decode(self._ids[self._prefix_offset:])
        self._pending += window_text[len(self._prefix_text):]
        self._advance_window()
        return self._release(final=True).new_text

    def _advance_window(self) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        if self._prefix_offset >= _TRIM_THRESHOLD_TOKENS:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _release(self, final: bool) -> DetokenizedDelta:
        stop_at = self._first_stop()
        if stop_at is not None:
            self.stopped = True
            out, self._pending = self._pending[:stop_at], ""
        else:
            keep = 0 if final else self._stop_prefix_length()
            cut = len(self._pending) - keep
            out, self._pending = self._pending[:cut], self._pending[cut:]
        if out:
            self._pieces.append(out)
            self._text_cache = None
        return DetokenizedDelta(out, self.stopped)

    def _first_stop(self) -> int | None:
        # Released text never contains the start of a stop string (see
        # _stop_prefix_length), so searching the pending text is enough.
        hits = [i for i in (self._pending.find(s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the pending text that is a proper
        prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
