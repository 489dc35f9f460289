"""Prompt lookup (n-gram) drafts: no second model.

The request's last n tokens are looked up in its own earlier tokens (prompt
and output), n from `prompt_lookup_max` down to `prompt_lookup_min`; at the
latest earlier occurrence of the longest n that matches, the tokens that
followed it are the drafts. It costs a scan of the context (numpy, per
request) and pays off where the answer repeats its context: retrieval-
augmented answers, code edits, summaries, quoting.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow `token_ids` (none when no
        n-gram of the allowed sizes recurs)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            # Windows starting before the suffix itself: [length - n, n]
            windows = sliding_window_view(tokens[:length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the tokens after the latest match
                return tokens[start:start + num_tokens].tolist()
        return []
