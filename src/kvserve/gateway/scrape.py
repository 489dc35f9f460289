"""Scraping: every backend's `/metrics` and `/ready` about once per
interval, into its view. A failed scrape (refused, timed out, a 5xx, not a
vLLM-compatible page) counts against the backend's breaker; an open
breaker is left alone until its cool-down ends, and then the next scrape is
the half-open probe that closes or reopens it."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvserve.gateway.backends import OPEN, BackendView, parse_metrics
from kvserve.gateway.config import GatewayConfig

log = logging.getLogger(__name__)


class Scraper:
    def __init__(self, views: list[BackendView], session: aiohttp.ClientSession, config: GatewayConfig) -> None:
        self.views = views
        self.session = session
        self.config = config
        self._timeout = aiohttp.ClientTimeout(total=config.scrape_timeout_s)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.scrape_interval_s)
            await self.scrape_all()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(v) for v in self.views))

    async def scrape(self, view: BackendView) -> None:
        if view.breaker.state == OPEN:
            return
        was_ready = view.ready
        try:
            text = await self._get_text(view.url + "/metrics")
            ready = await self._ready(view.url)
            # every scrape: adapters are loaded and unloaded at run time
            view.models, view.adapters = await self._models(view.url)
            view.record_scrape(parse_metrics(text), ready)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            if was_ready:
                log.warning("backend %s: scrape failed: %s", view.name, exc)
            view.record_scrape_failure()

    async def _get_text(self, url: str) -> str:
        async with self.session.get(url, timeout=self._timeout) as response:
            if response.status != 200:
                raise ValueError(f"GET {url}: HTTP {response.status}")
            return await response.text()

    async def _ready(self, url: str) -> bool:
        async with self.session.get(url + "/ready", timeout=self._timeout) as response:
            await response.read()
            if response.status == 404:  # a server without /ready (vLLM has /health): alive is ready
                async with self.session.get(url + "/health", timeout=self._timeout) as health:
                    await health.read()
                    return health.status == 200
            return response.status == 200

    async def _models(self, url: str) -> tuple[tuple[str, ...], dict[str, str | None]]:
        """(base models, LoRA adapters: name -> parent) from /v1/models, where
        a card with a `parent` (vLLM's adapter cards) is an adapter; nothing
        where it needs a key."""
        async with self.session.get(url + "/v1/models", timeout=self._timeout) as response:
            if response.status != 200:
                return (), {}
            data = await response.json(content_type=None)
        try:
            cards = [(str(m["id"]), m.get("parent")) for m in data["data"]]
        except (KeyError, TypeError, AttributeError):
            return (), {}
        return (tuple(name for name, parent in cards if parent is None),
                {name: str(parent) for name, parent in cards if parent is not None})
