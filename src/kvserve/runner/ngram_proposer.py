"""Prompt lookup (n-gram) drafts: no second model.

The request's last n tokens are looked up in its own earlier tokens (prompt
and output), n from `prompt_lookup_max` down to `prompt_lookup_min`; at the
latest earlier occurrence of the longest n that matches, the tokens that
followed it are the drafts. It pays off where the answer repeats its
context: retrieval-augmented answers, code edits, summaries, quoting.

Each request keeps an index, per n, of n-gram -> its latest start, extended
with the tokens added since its last proposal: a step costs O(new tokens x
n sizes), not a scan of the whole context, which matters because every
allowed request is asked every step even when nothing ever matches (chat).
The index goes when the request finishes (forget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _NgramIndex:
    # latest_start[n - min][ngram]: latest start of that n-gram among the
    # windows ending before position `indexed_until`
    latest_start: list[dict[tuple[int, ...], int]]
    indexed_until: int = 0
    # the last token indexed, to notice a context that is not an extension
    # of the one indexed (then the index is rebuilt)
    last_token: int | None = field(default=None)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow `token_ids`, the request's whole
        context, which grows between calls (none when no n-gram of the
        allowed sizes recurs)."""
        length = len(token_ids)
        index = self._index_through(request_id, token_ids, length - 1)
        smallest = self.prompt_lookup_min
        for n in range(min(self.prompt_lookup_max, length - 1), smallest - 1, -1):
            start = index.latest_start[n - smallest].get(tuple(token_ids[length - n:]))
            if start is not None:
                return list(token_ids[start + n:start + n + num_tokens])
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _index_through(self, request_id: str, token_ids: Sequence[int], until: int) -> _NgramIndex:
        """The request's index holding every window that ends before `until`
        (the suffix being looked up is never its own match)."""
        index = self._indexes.get(request_id)
        if index is None or index.indexed_until > until or (
                index.indexed_until and token_ids[index.indexed_until - 1] != index.last_token):
            index = _NgramIndex([{} for _ in range(self.prompt_lookup_min, self.prompt_lookup_max + 1)])
            self._indexes[request_id] = index
        smallest = self.prompt_lookup_min
        for end in range(index.indexed_until, until):
            for n in range(smallest, min(self.prompt_lookup_max, end + 1) + 1):
                index.latest_start[n - smallest][tuple(token_ids[end + 1 - n:end + 1])] = end + 1 - n
        if until > index.indexed_until:
            index.indexed_until = until
            index.last_token = token_ids[until - 1]
        return index
