"""The serving pipeline's last stage: an admitted request's stream of
outputs -> one JSON body (`collect`) or SSE events (`sse`).

Both start from the first item the stream gave (the serving layer waits for
it before sending headers, so a request that fails before its first token
still gets an honest status)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from kvserve.engine.async_engine import ENGINE_FAILED, Finished, RequestStream
from kvserve.server import protocol
from kvserve.server.errors import engine_failed
from kvserve.server.prepare import PreparedRequest


async def collect(shape: protocol.ResponseShape, stream: RequestStream, first, p: PreparedRequest) -> dict:
    """The whole response body of a non-streamed request, once it finished."""
    last, logprobs = None, [] if p.params.logprobs is not None else None
    item = first
    while not isinstance(item, Finished):
        last = item
        if logprobs is not None:
            logprobs.extend(_new_logprobs(item))
        item = await stream.next()
    if item.abort_reason == ENGINE_FAILED:
        raise engine_failed(item)  # nothing is sent yet: an honest status
    text = last.text if last is not None else ""
    num_out = len(last.token_ids) if last is not None else 0
    return shape.full(text, item.finish_reason, logprobs, protocol.usage(p.num_prompt_tokens, num_out, _cached(last)))


async def sse(shape: protocol.ResponseShape, stream: RequestStream, first, p: PreparedRequest,
              on_client_left: Callable[[], None]) -> AsyncIterator[str]:
    """One `data:` event per batch of outputs ready together: when the
    reader falls behind the engine (overload, a slow client), the tokens
    that piled up go out as one multi-token delta instead of one event
    each, which saves the JSON encoding and the socket write per token
    that compete with the engine for the CPU. Logprobs keep one entry
    per token; text_offset counts from the start of the completion.

    `on_client_left` is called when the generator is closed before the
    request finished (the client went away)."""
    pending, last, is_first, text_offset = [first], None, True, 0
    wants_logprobs = p.params.logprobs is not None
    try:
        while True:
            batch = pending + stream.ready()
            outputs = [x for x in batch if not isinstance(x, Finished)]
            end = batch[-1] if isinstance(batch[-1], Finished) else None  # Finished comes last
            if outputs:
                newest = outputs[-1]
                text = "".join(o.new_text for o in outputs)
                lp = [x for o in outputs for x in _new_logprobs(o)] if wants_logprobs else None
                finish = newest.finish_reason if newest.finished else None
                if text or finish or is_first or lp:
                    yield shape.chunk(text, finish, lp, first=is_first,
                                      with_usage_field=p.include_usage, text_offset=text_offset)
                    is_first = False
                    text_offset += shape.text_length(lp)
                last = newest
            if end is not None:
                break
            pending = [await stream.next()]
        if end.abort_reason == ENGINE_FAILED:  # the status is sent: the error goes in the stream
            error = engine_failed(end)
            yield protocol.sse(protocol.error_body(error.message, error.type, error.code))
            yield protocol.SSE_DONE
            return
        if last is None or not last.finished:  # aborted mid-stream: say so
            yield shape.chunk(None, end.finish_reason, None, with_usage_field=p.include_usage)
        if p.include_usage:
            num_out = len(last.token_ids) if last is not None else 0
            yield shape.usage_chunk(protocol.usage(p.num_prompt_tokens, num_out, _cached(last)))
        yield protocol.SSE_DONE
    finally:
        if stream.finished is None:  # the client left (generator closed) before the end
            on_client_left()


def _new_logprobs(output) -> list:
    """This output's new logprob entries (a delta, or all of them when the
    output carries no delta)."""
    return list(getattr(output, "new_logprobs", None) or output.logprobs or [])


def _cached(output) -> int:
    """Prompt tokens served from the prefix cache, for `usage`."""
    return int(getattr(output, "num_cached_tokens", 0) or 0) if output is not None else 0
