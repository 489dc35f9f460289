"""A request's prompt as token ids, the one way: a completion's prompt (text or
ids), a chat's messages through the chat template (with its tools, when it
has some). Chat and completion requests and vLLM's `/tokenize` all count
with it, so `/tokenize` says exactly what a request would be charged;
`/detokenize` is its inverse."""

from __future__ import annotations

from kvserve.contract import InvalidParameter
from kvserve.model_facts.tokenizer import Tokenizer
from kvserve.server.tools import ToolSet


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict], tool_set: ToolSet | None,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The chat template's rendering of `messages` (and the tools), tokenized.
    The template writes its own special tokens, so none are added by default."""
    template_vars: dict = {}
    if tool_set is not None:
        messages, template_vars = tool_set.prompt(messages, tokenizer.chat_template)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             **template_vars)
    except ValueError as exc:
        raise InvalidParameter("messages", str(exc)) from None
    return _non_empty(tokenizer.encode(text, add_special_tokens=add_special_tokens), "messages")


def completion_prompt_ids(tokenizer: Tokenizer, vocab_size: int, prompt: object,
                          add_special_tokens: bool = True) -> list[int]:
    """A completion prompt: text, token ids, or a batch of one of either."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidParameter("prompt", "batched prompts are not supported; send one prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidParameter("prompt", "must not be empty")
        return _non_empty(tokenizer.encode(prompt, add_special_tokens=add_special_tokens), "prompt")
    return check_token_ids(prompt, vocab_size, "prompt")


def in_vocab(token_ids: list, vocab_size: int) -> bool:
    """The vocabulary rule for token ids a client sends (prompts, /detokenize)."""
    return all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids)


def check_token_ids(ids: object, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not in_vocab(ids, vocab_size):
        raise InvalidParameter(param, f"token ids must be integers in [0, {vocab_size})")
    return _non_empty(list(ids), param)


def tokenize_body(tokenizer: Tokenizer, ids: list[int], max_model_len: int, return_token_strs: bool) -> dict:
    """vLLM's /tokenize response."""
    body: dict = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return body


def detokenize_body(tokenizer: Tokenizer, vocab_size: int, ids: list[int]) -> dict:
    """vLLM's /detokenize response (special tokens kept, as vLLM keeps them)."""
    if not in_vocab(ids, vocab_size):
        raise InvalidParameter("tokens", f"token ids must be integers in [0, {vocab_size})")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}


def _non_empty(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise InvalidParameter(param, "must contain at least one token")
    return ids
