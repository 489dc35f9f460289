"""Structured outputs on llguidance: a StructuredOutput compiled once into a
grammar for the model's tokenizer, and per request a matcher that says which
tokens may come next and is advanced by each accepted token.

Why llguidance (docs/structured-outputs.md, benchmarks/grammar_engines.py):
it enforces a JSON Schema keyword or refuses the schema with a message, never
ignores one silently (xgrammar 0.2.9 ignores `allOf`, `not`, `uniqueItems`),
compiles in about 1-7 ms where xgrammar takes up to ~90 ms, reads any
`tokenizers` tokenizer.json, and pulls in no dependency (xgrammar pulls
transformers, triton and its FFI runtime).

Compiling happens on a worker thread (`GrammarCompiler.submit` returns a
future), so a large schema never stalls an engine step; results are cached
by the constraint's hash, failures too, so a bad schema sent again is refused
at once. Torch-free: masks are numpy int32 bitmasks, one bit per token id.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.numpy
import numpy as np

from kvserve.contract import InvalidParameter, StructuredOutput

if TYPE_CHECKING:
    from kvserve.model_facts.tokenizer import Tokenizer

# JSON without free whitespace: a model may otherwise loop on spaces and
# newlines inside an object until max_tokens. The separators are the ones
# json.dumps writes, which byte-level BPE vocabularies tokenize well.
# `lenient: False`: a keyword llguidance cannot enforce refuses the schema
# instead of being ignored. Overrides win over a schema's own "x-guidance".
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": False}
ANY_JSON_OBJECT = '{"type": "object"}'
MAX_ERROR_CHARS = 500
DEFAULT_MAX_CACHED = 256
# Fill masks on the grammar engine's thread pool only from this batch and core count on.
PARALLEL_FILL_MIN_BATCH = 32
PARALLEL_FILL_MIN_CPUS = 8


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine
    thread alone fills its mask and advances it."""

    __slots__ = ("_matcher", "_executor")

    def __init__(self, matcher: llguidance.LLMatcher, executor: llguidance.LLExecutor) -> None:
        self._matcher = matcher
        self._executor = executor  # shared by every matcher of one compiler

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (then
        the matcher stays in an error state)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_finished(self) -> bool:
        """The constraint is complete: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was accepted so far is a whole answer (EOS allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None


def fill_next_token_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> None:
    """Write each matcher's allowed next tokens into bitmask[i] (int32
    [len(matchers), bitmask_words(vocab)], C-contiguous); bit t of a row is 1
    when token t is allowed.

    On the caller's thread, one matcher after another (~30-50 us each), unless
    the batch is large and the machine has cores to spare: the engine's
    thread pool would otherwise compete with torch's for the same cores (on 2
    cores, 16 matchers: 0.43 ms in turn vs 0.9-1.1 ms in parallel)."""
    if len(matchers) >= PARALLEL_FILL_MIN_BATCH and (os.cpu_count() or 1) >= PARALLEL_FILL_MIN_CPUS:
        pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
        llguidance.numpy.fill_next_token_bitmask_par(matchers[0]._executor, pairs, bitmask)
        return
    for row, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher._matcher, bitmask, row)


class CompiledGrammar:
    """A constraint compiled for one tokenizer. Its template matcher keeps the
    lexer states that requests build lazily, and every request's matcher is a
    copy of it, so the second request of a schema masks at warm speed."""

    def __init__(self, template: llguidance.LLMatcher, executor: llguidance.LLExecutor,
                 constraint_hash: str) -> None:
        self._template = template
        self._executor = executor
        self.constraint_hash = constraint_hash

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._executor)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer off the caller's thread,
    with an LRU cache of results keyed by the constraint's hash.

    `vocab_size` is the model's logits width (may exceed the tokenizer's).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, max_cached: int = DEFAULT_MAX_CACHED,
                 num_workers: int = 1) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()  # guards the cache; never held while compiling
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.5 s)
        self._executor: llguidance.LLExecutor | None = None

    def submit(self, constraint: StructuredOutput) -> Future[CompiledGrammar]:
        """A future of the compiled grammar: done at once on a cache hit; a
        constraint the engine cannot enforce fails with InvalidParameter."""
        key = constraint.hash
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        """Blocking `submit(...).result()`: raises InvalidParameter for a bad constraint."""
        return self.submit(constraint).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, constraint: StructuredOutput) -> CompiledGrammar:
        tokenizer, executor = self._engine_tokenizer()
        grammar = _grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise _invalid(constraint, messages[0] if messages else "is not a valid grammar")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _invalid(constraint, template.get_error())
        return CompiledGrammar(template, executor, constraint.hash)

    def _engine_tokenizer(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        # Only worker threads get here; the first builds the tokenizer.
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids) or None)
                self._executor = llguidance.LLExecutor()
            assert self._executor is not None
            return self._ll_tokenizer, self._executor


def _grammar_text(constraint: StructuredOutput) -> str:
    """llguidance's grammar for a constraint. Raises InvalidParameter for a
    grammar that cannot even be parsed."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json", "json_object"):
            schema = ANY_JSON_OBJECT if kind == "json_object" else spec
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise _invalid(constraint, str(e)) from None


def _invalid(constraint: StructuredOutput, message: str) -> InvalidParameter:
    text = " ".join(message.split())[:MAX_ERROR_CHARS]
    what = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[constraint.kind]
    return InvalidParameter("structured_output", f"{what} cannot be enforced: {text}")
