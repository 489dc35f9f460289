"""What the gateway reads of a client's request without validating it:
model, stream, max_tokens, priority, the prompt's text (for the alias
policy, the size estimate and the affinity key). Validation stays with the
backend, so bad input gets exactly the server's 4xx; a body the gateway
cannot read at all is forwarded as it came."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

from kvserve.server import protocol

# The gateway cannot tokenize (it fronts any server): English BPE runs
# about 4 bytes per token, the estimate for the projected KV and quotas.
BYTES_PER_TOKEN = 4


@dataclass
class Inbound:
    kind: str  # "completion" | "chat"
    path: str
    raw: bytes
    body: dict | None  # the JSON object, None when it is not one
    model: str | None
    stream: bool
    requested_max_tokens: int | None
    priority: int
    is_retry: bool
    prompt_text: str
    prompt_bytes: bytes  # the leading prompt, for the affinity key

    @property
    def num_prompt_tokens(self) -> int:
        return max(1, -(-len(self.prompt_text.encode()) // BYTES_PER_TOKEN))

    def body_bytes(self, model: str | None = None, max_tokens: int | None = None) -> bytes:
        """The body to send: as received unless the model or max_tokens change."""
        if self.body is None or (model in (None, self.model) and max_tokens is None):
            return self.raw
        body = dict(self.body)
        if model is not None:
            body["model"] = model
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
            if "max_completion_tokens" in body:
                body["max_completion_tokens"] = max_tokens
            if isinstance(body.get("min_tokens"), int):
                body["min_tokens"] = min(body["min_tokens"], max_tokens)
        return json.dumps(body).encode()


def read_inbound(kind: str, path: str, raw: bytes, tenant_priority: int | None, headers) -> Inbound:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        body = None
    fields = body or {}
    model = fields.get("model") if isinstance(fields.get("model"), str) else None
    text = _prompt_text(kind, fields)
    return Inbound(kind, path, raw, body, model, fields.get("stream") is True, _max_tokens(fields),
                   _priority(fields, tenant_priority), protocol.is_retry(headers), text,
                   _leading_bytes(kind, fields, text))


def _max_tokens(fields: dict) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _priority(fields: dict, tenant_priority: int | None) -> int:
    """The server's rule (protocol.priority_of) on the raw fields; a value
    of the wrong type is left to the backend to refuse."""
    priority = fields.get("priority")
    tier = fields.get("service_tier")
    shaped = SimpleNamespace(priority=priority if isinstance(priority, int) and not isinstance(priority, bool)
                             else None, service_tier=tier if isinstance(tier, str) else None)
    return protocol.priority_of(shaped, tenant_priority)


def _prompt_text(kind: str, fields: dict) -> str:
    if kind == "chat":
        parts, messages = [], fields.get("messages")
        for message in messages if isinstance(messages, list) else []:  # a bad type is the backend's 400
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
            parts.append(f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " " * (BYTES_PER_TOKEN * len(prompt))  # its size; the key is taken from the ids
    return ""


def _leading_bytes(kind: str, fields: dict, text: str) -> bytes:
    prompt = fields.get("prompt")
    if kind == "completion" and isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and 0 <= t < 2**32 for t in prompt):
        return b"".join(t.to_bytes(4, "little") for t in prompt)
    return text.encode()


