"""The serving pipeline's last stage: an admitted request's choices (one
engine stream each; `n` of them) -> one JSON body (`collect`) or SSE events
(`sse`), with per-choice indices, tool calls parsed from each choice's
output (whole, or as streamed tool-call deltas), and usage summed.

Both start from the first output each choice gave (the serving layer waits
for them before sending headers, so a request that fails before its first
token still gets an honest status). Usage counts the prompt once (the
choices share it, as OpenAI bills it) and the output tokens of every
choice; `cached_tokens` is the first choice's prefix-cache hit, the prompt
as charged.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from kvserve.engine.async_engine import ENGINE_FAILED, Finished, RequestStream
from kvserve.server import protocol
from kvserve.server.errors import engine_failed
from kvserve.server.prepare import PreparedRequest
from kvserve.server.tools import ToolCallStream, ToolSet, message_tool_calls

TOOL_CALLS_FINISH = "tool_calls"


class Choice:
    """One choice: its engine request's stream and what was read of it."""

    def __init__(self, index: int, request_id: str, stream: RequestStream, wants_logprobs: bool,
                 tool_set: ToolSet | None) -> None:
        self.index = index
        self.request_id = request_id
        self.stream = stream
        self.wants_logprobs = wants_logprobs
        self.tool_set = tool_set
        self.last = None  # the newest RequestOutput
        self.end: Finished | None = None
        self.logprobs: list | None = [] if wants_logprobs else None
        self.pending: list = []  # items read ahead (the first output, read before the headers)
        # streaming state
        self.tool_stream: ToolCallStream | None = tool_set.stream() if tool_set is not None else None
        self.sent_first = False
        self.text_offset = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.last.token_ids) if self.last is not None else 0

    @property
    def num_cached_tokens(self) -> int:
        return int(getattr(self.last, "num_cached_tokens", 0) or 0) if self.last is not None else 0

    @property
    def text(self) -> str:
        return self.last.text if self.last is not None else ""

    def absorb(self, items: list) -> list:
        """Record items read from the stream; returns its outputs (not the Finished)."""
        outputs = []
        for item in items:
            if isinstance(item, Finished):
                self.end = item
                continue
            self.last = item
            outputs.append(item)
            if self.logprobs is not None:
                self.logprobs.extend(new_logprobs(item))
        return outputs

    async def read_to_end(self) -> None:
        self.absorb(self.pending)
        self.pending = []
        while self.end is None:
            self.absorb([await self.stream.next()])

    def finish_reason(self, has_calls: bool) -> str | None:
        return _finish_reason(self.end.finish_reason if self.end is not None else None, has_calls)

    def whole(self, shape: protocol.ResponseShape) -> dict:
        """This choice in a whole response (after read_to_end)."""
        if self.tool_set is None:
            return shape.choice(self.index, self.text, self.finish_reason(False), self.logprobs)
        parsed = self.tool_set.parse(self.text)
        calls = message_tool_calls(parsed.calls)
        return shape.choice(self.index, parsed.content, self.finish_reason(bool(calls)), self.logprobs,
                            tool_calls=calls or None)

    def chunk(self, shape: protocol.ResponseShape, outputs: list) -> dict | None:
        """The chunk choice for outputs that arrived together (None if there is
        nothing to say): one delta of their text, their tool-call deltas, and
        the finish reason when the last of them ends the choice."""
        text = "".join(o.new_text for o in outputs)
        finished = bool(outputs) and outputs[-1].finished
        tool_calls: list[dict] = []
        if self.tool_stream is not None:
            text, tool_calls = self.tool_stream.push(text)
            if finished:
                rest, more = self.tool_stream.finish()
                text, tool_calls = text + rest, tool_calls + more
        lp = [x for o in outputs for x in new_logprobs(o)] if self.wants_logprobs else None
        finish = _finish_reason(outputs[-1].finish_reason if finished else None,
                                self.tool_stream is not None and self.tool_stream.num_calls > 0)
        if not (text or finish or not self.sent_first or lp or tool_calls):
            return None
        chunk = shape.chunk_choice(self.index, text, finish, lp, first=not self.sent_first,
                                   text_offset=self.text_offset, tool_calls=tool_calls or None)
        self.sent_first = True
        self.text_offset += shape.text_length(lp)
        return chunk


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that stopped on its calls."""
    return TOOL_CALLS_FINISH if has_calls and reason == "stop" else reason


def usage(choices: Sequence[Choice], num_prompt_tokens: int) -> dict:
    return protocol.usage(num_prompt_tokens, sum(c.num_output_tokens for c in choices),
                          choices[0].num_cached_tokens)


async def collect(shape: protocol.ResponseShape, choices: Sequence[Choice], p: PreparedRequest) -> dict:
    """The whole response body of a non-streamed request, once every choice finished."""
    await asyncio.gather(*(c.read_to_end() for c in choices))
    for c in choices:
        if c.end.abort_reason == ENGINE_FAILED:
            raise engine_failed(c.end)  # nothing is sent yet: an honest status
    return shape.body([c.whole(shape) for c in choices], usage(choices, p.num_prompt_tokens))


async def sse(shape: protocol.ResponseShape, choices: Sequence[Choice], p: PreparedRequest,
              on_client_left: Callable[[], None]) -> AsyncIterator[str]:
    """One `data:` event per batch of a choice's outputs ready together:
    when the reader falls behind the engine (overload, a slow client), the
    tokens that piled up go out as one multi-token delta instead of one
    event each, which saves the JSON encoding and the socket write per
    token that compete with the engine for the CPU. Logprobs keep one entry
    per token; text_offset counts from the start of the completion.

    `on_client_left` is called when the generator is closed before every
    choice finished (the client went away)."""
    try:
        async for choice, items in ready_batches(choices):
            outputs = choice.absorb(items)
            chunk = choice.chunk(shape, outputs) if outputs else None
            if chunk is not None:
                yield shape.chunks([chunk], p.include_usage)
            if choice.end is not None and choice.end.abort_reason == ENGINE_FAILED:
                # the status is sent: the error goes in the stream
                error = engine_failed(choice.end)
                yield protocol.sse(protocol.error_body(error.message, error.type, error.code))
                yield protocol.SSE_DONE
                return
            if choice.end is not None and (choice.last is None or not choice.last.finished):
                # aborted mid-stream: say so
                ended = shape.chunk_choice(choice.index, None, choice.end.finish_reason, None)
                yield shape.chunks([ended], p.include_usage)
        if p.include_usage:
            yield shape.usage_chunk(usage(choices, p.num_prompt_tokens))
        yield protocol.SSE_DONE
    finally:
        if any(c.stream.finished is None for c in choices):  # the client left before the end
            on_client_left()


async def ready_batches(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, list]]:
    """(choice, items) as items arrive, until every choice has its Finished;
    a choice's items that piled up come together (one delta, not one each).
    One choice is read directly; several through one pending read each."""
    for c in choices:
        if c.pending:
            items, c.pending = c.pending + c.stream.ready(), []
            yield c, items
    if len(choices) == 1:
        c = choices[0]
        while not _ended(c):
            yield c, [await c.stream.next()] + c.stream.ready()
        return
    reads = {asyncio.ensure_future(c.stream.next()): c for c in choices if not _ended(c)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                c = reads.pop(task)
                yield c, [task.result()] + c.stream.ready()
                if not _ended(c):
                    reads[asyncio.ensure_future(c.stream.next())] = c
    finally:
        for task in reads:
            task.cancel()


def _ended(choice: Choice) -> bool:
    return choice.end is not None


def new_logprobs(output) -> list:
    """This output's new logprob entries (a delta, or all of them when the
    output carries no delta)."""
    return list(getattr(output, "new_logprobs", None) or output.logprobs or [])
