"""AdapterRegistry: the LoRA adapters an engine serves, by name (what a
request's `model` names), and the weights its unfinished requests run under.

Names come and go at run time (`--lora-modules`, POST /v1/load_lora_adapter
and /v1/unload_lora_adapter on the event loop thread) while the engine thread
adds and finishes requests, so every call takes the registry's lock. An
unloaded adapter's weights stay until the last request under it finishes:
unloading never changes an answer in flight. Two names for the same files
are one adapter (one id, one slot, one prefix-cache namespace).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvserve.model.lora import LoraAdapter


class AdapterRegistry:
    def __init__(self, on_dropped: Callable[[str], None] | None = None) -> None:
        """on_dropped(adapter_id): called (engine thread or loader) once no name
        and no request refers to an adapter any more."""
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._by_id: dict[str, LoraAdapter] = {}  # named or in use by a request
        self._users: dict[str, int] = {}  # adapter_id -> unfinished requests under it
        self._on_dropped = on_dropped
        self._dropped: list[str] = []  # ids to hand to on_dropped on the engine thread

    def add(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` under its name. Raises ValueError if the name is taken."""
        with self._lock:
            if adapter.name in self._by_name:
                raise ValueError(f"the LoRA adapter {adapter.name!r} has already been loaded")
            self._by_name[adapter.name] = self._by_id.setdefault(adapter.adapter_id, adapter)

    def remove(self, name: str) -> LoraAdapter | None:
        """Stop serving a name; None if it was not served."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is not None:
                self._forget_if_unused(adapter.adapter_id)
            return adapter

    def get(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def names(self) -> list[LoraAdapter]:
        """Every served name's adapter, in load order."""
        with self._lock:
            return list(self._by_name.values())

    def name_of(self, adapter_id: str) -> str:
        """A name the adapter is (or was) served under, for labels."""
        with self._lock:
            adapter = self._by_id.get(adapter_id)
            return adapter_id[:12] if adapter is None else adapter.name

    def acquire(self, adapter_id: str) -> None:
        """A request under this adapter enters the engine. Raises ValueError
        if it was unloaded since the request named it."""
        with self._lock:
            if adapter_id not in self._by_id:
                raise ValueError("the LoRA adapter of this request was unloaded before it started")
            self._users[adapter_id] = self._users.get(adapter_id, 0) + 1

    def release(self, adapter_id: str) -> None:
        """A request under this adapter finished."""
        with self._lock:
            users = self._users.get(adapter_id, 0) - 1
            if users > 0:
                self._users[adapter_id] = users
                return
            self._users.pop(adapter_id, None)
            self._forget_if_unused(adapter_id)

    def by_id(self) -> dict[str, LoraAdapter]:
        """adapter_id -> adapter, for the runner (a snapshot), after handing
        the ids dropped since the last call to on_dropped."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            snapshot = dict(self._by_id)
        if self._on_dropped is not None:
            for adapter_id in dropped:
                self._on_dropped(adapter_id)
        return snapshot

    def _forget_if_unused(self, adapter_id: str) -> None:
        if self._users.get(adapter_id) or any(a.adapter_id == adapter_id for a in self._by_name.values()):
            return
        if self._by_id.pop(adapter_id, None) is not None:
            self._dropped.append(adapter_id)
