"""Structured outputs: constraints compiled into grammars, token masks per request."""

from kvserve.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarMatcher,
    bitmask_words,
    fill_next_token_bitmasks,
)

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "bitmask_words", "fill_next_token_bitmasks"]
