"""Model pools and aliases: a served model name maps to a pool of backends
with its own router; an alias (`model: "auto"`) picks a pool by a cheap
policy within a small time budget."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable

from kvserve.admission.retry_after import ReturnSlots
from kvserve.fleet.router import Router, RouterConfig
from kvserve.gateway.backends import BackendView
from kvserve.gateway.config import AliasConfig, PoolConfig

log = logging.getLogger(__name__)


class Pool:
    """The backends serving one model name, the router over them, and the
    return slots its refused requests are told (staggered over its drain)."""

    def __init__(self, config: PoolConfig, views: list[BackendView], router: RouterConfig,
                 clock: Callable[[], float]) -> None:
        self.config = config
        self.views = views
        self.router = Router(router)
        self.smaller = config.smaller
        self.return_slots = ReturnSlots(clock)

    @property
    def model(self) -> str | None:
        """The configured name, else the one its backends list."""
        if self.config.model is not None:
            return self.config.model
        return next((v.models[0] for v in self.views if v.models), None)

    @property
    def label(self) -> str:
        return self.model or "default"

    def eligible(self, stale_after_s: float, exclude: set[str] = frozenset(),
                 adapter: str | None = None) -> list[BackendView]:
        """Backends that may get a request now, in configured order (the
        router's ties and turns depend on the order); with `adapter`, only
        those that list that LoRA adapter."""
        return [v for v in self.views if v.name not in exclude and v.eligible(stale_after_s)
                and (adapter is None or adapter in v.adapters)]

    def adapters(self) -> dict[str, str | None]:
        """The LoRA adapters its backends list (name -> parent model), first listing first."""
        listed: dict[str, str | None] = {}
        for view in self.views:
            for name, parent in view.adapters.items():
                listed.setdefault(name, parent)
        return listed

    @property
    def listing_known(self) -> bool:
        """Every backend's /v1/models was read (one behind a key lists nothing)."""
        return all(v.models for v in self.views)


class AliasPolicy:
    """Chooses a pool's model for an alias: the first matching rule, else
    the classifier within its budget, else the default."""

    def __init__(self, config: AliasConfig) -> None:
        self.config = config
        self._classifier: Callable[[str, int | None], str] | None = None
        if config.classifier:
            self._classifier = _load(config.classifier)
        self.num_over_budget = 0

    async def choose(self, prompt_text: str, max_tokens: int | None, models: set[str]) -> str:
        for rule in self.config.rules:
            if rule.matches(len(prompt_text), max_tokens):
                return rule.model
        if self._classifier is None:
            return self.config.default
        try:
            chosen = await asyncio.wait_for(asyncio.to_thread(self._classifier, prompt_text, max_tokens),
                                            self.config.budget_s)
        except TimeoutError:
            self.num_over_budget += 1
            return self.config.default
        except Exception:  # a classifier's bug must not fail the request
            log.exception("alias %s: classifier failed", self.config.name)
            return self.config.default
        return chosen if chosen in models else self.config.default


def _load(spec: str) -> Callable[[str, int | None], str]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"classifier must be 'module:function', got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load classifier {spec!r}: {exc}") from exc
    if not callable(function):
        raise ValueError(f"classifier {spec!r} is not callable")
    return function
