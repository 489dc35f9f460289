"""The gateway's configuration: frozen dataclasses, read once from flags and
an optional YAML or JSON file, validated with messages that name the bad
entry.

    router: {policy: prefix-affinity, affinity_slack_s: 0.5}
    pools:
      - model: large                      # the served model name clients send
        backends: [http://127.0.0.1:8001, {url: http://127.0.0.1:8002, name: l2}]
        smaller: small                    # the ladder's smaller-model rung
      - model: small
        backends: [http://127.0.0.1:8003]
    aliases:
      auto: {default: large, rules: [{max_prompt_chars: 400, max_tokens_at_most: 64, model: small}]}
    ladder:                               # per priority class (the largest key <= the priority)
      "0": [cap_max_tokens, smaller_model, deferred, reject]
    admission: {max_queue_wait_s: 1.0, deferred_max_queue_wait_s: 8.0, retry_budget: 0.1}  # AdmissionConfig
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kvserve.config import AdmissionConfig
from kvserve.fleet.router import RouterConfig

# Ladder rungs, tried in the configured order when the request's pool
# cannot start it within its class's queue-wait limit.
CAP_MAX_TOKENS = "cap_max_tokens"
SMALLER_MODEL = "smaller_model"
DEFERRED = "deferred"
REJECT = "reject"
RUNGS = (CAP_MAX_TOKENS, SMALLER_MODEL, DEFERRED, REJECT)


@dataclass(frozen=True)
class BackendConfig:
    """One OpenAI-compatible server. name: its identity in metrics, headers
    and on the hash ring (default: the URL). num_kv_blocks / block_size:
    for backends whose /metrics lacks vllm:cache_config_info."""

    url: str
    name: str = ""
    num_kv_blocks: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"backend URL must start with http:// or https://, got {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.name:
            object.__setattr__(self, "name", self.url)


@dataclass(frozen=True)
class PoolConfig:
    """A served model name and the backends that serve it. model None: the
    name the backends list in /v1/models (a gateway given only --backend)."""

    model: str | None
    backends: tuple[BackendConfig, ...]
    smaller: str | None = None

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError(f"pool {self.model!r} has no backends")


@dataclass(frozen=True)
class AliasRule:
    """Matches when every stated bound holds; None = no bound."""

    model: str
    max_prompt_chars: int | None = None
    max_tokens_at_most: int | None = None

    def matches(self, prompt_chars: int, max_tokens: int | None) -> bool:
        if self.max_prompt_chars is not None and prompt_chars > self.max_prompt_chars:
            return False
        if self.max_tokens_at_most is not None and (max_tokens is None or max_tokens > self.max_tokens_at_most):
            return False
        return True


@dataclass(frozen=True)
class AliasConfig:
    """A model name that routes by policy: the first matching rule, else a
    classifier ("module:function" called with (prompt_text, max_tokens),
    returning a model name) given `budget_s`, else `default`."""

    name: str
    default: str
    rules: tuple[AliasRule, ...] = ()
    classifier: str | None = None
    budget_s: float = 0.02

    def __post_init__(self) -> None:
        if not 0 < self.budget_s <= 0.05:
            raise ValueError(f"alias {self.name!r}: budget_s must be in (0, 0.05] seconds, got {self.budget_s}")


@dataclass(frozen=True)
class BreakerConfig:
    """Eject a backend after `failures` consecutive failures; probe it again
    (one scrape, half-open) after `cool_down_s`."""

    failures: int = 3
    cool_down_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failures < 1 or not self.cool_down_s > 0:
            raise ValueError("breaker needs failures >= 1 and cool_down_s > 0")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `kvserve gateway` runs with (seconds and tokens as named)."""

    pools: tuple[PoolConfig, ...]
    router: RouterConfig = field(default_factory=RouterConfig)
    aliases: tuple[AliasConfig, ...] = ()
    # priority class (the largest key <= a request's priority) -> rungs
    ladder: tuple[tuple[int, tuple[str, ...]], ...] = ((0, (REJECT,)),)
    ladder_max_tokens: int = 64
    # The fleet's admission settings, as a server's: the classes' queue-wait
    # limits, the retry budget, and default_max_tokens (what a backend
    # defaults to: the projection of a request without one).
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    api_keys_path: str | None = None
    state_dir: str = "kvserve-gateway-state"
    scrape_interval_s: float = 1.0
    stale_after_s: float = 5.0
    scrape_timeout_s: float = 2.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    connect_timeout_s: float = 2.0
    batch_concurrency: int = 4
    batch_priority: int = 10
    host: str = "127.0.0.1"
    port: int = 8080
    shutdown_grace_s: float = 30.0
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        if not self.pools:
            raise ValueError("the gateway needs at least one backend (--backend URL or pools in --config)")
        names = [b.name for p in self.pools for b in p.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {names}")
        models = [p.model for p in self.pools]
        if len(set(models)) != len(models) or (None in models and len(models) > 1):
            raise ValueError("each pool needs its own model name (only a single pool may leave it out)")
        for pool in self.pools:
            if pool.smaller is not None and pool.smaller not in models:
                raise ValueError(f"pool {pool.model!r}: smaller model {pool.smaller!r} is not a pool")
        for alias in self.aliases:
            targets = [alias.default, *(r.model for r in alias.rules)]
            unknown = [t for t in targets if t not in models]
            if unknown or alias.name in models:
                raise ValueError(f"alias {alias.name!r}: targets {unknown} are not pools, "
                                 "or the alias shadows a pool")
        for _, rungs in self.ladder:
            bad = [r for r in rungs if r not in RUNGS]
            if bad or not rungs:
                raise ValueError(f"ladder rungs must be among {RUNGS}, got {list(rungs)}")
        for name in ("scrape_interval_s", "stale_after_s", "scrape_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.ladder_max_tokens < 1 or self.batch_concurrency < 1:
            raise ValueError("ladder_max_tokens and batch_concurrency must be >= 1")

    def rungs_for(self, priority: int) -> tuple[str, ...]:
        """The ladder of a request's priority class."""
        chosen = self.ladder[0][1]
        for threshold, rungs in sorted(self.ladder):
            if threshold <= priority:
                chosen = rungs
        return chosen

    def pool(self, model: str | None) -> PoolConfig | None:
        return next((p for p in self.pools if p.model == model), None)


# ---- reading a file ----------------------------------------------------------

def load_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping (YAML is a superset of JSON)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read gateway config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"gateway config {path} must be a mapping at the top level")
    return data


def from_mapping(data: dict[str, Any], admission: dict[str, Any] | None = None,
                 **overrides: Any) -> GatewayConfig:
    """A GatewayConfig from a parsed config file; `overrides` and
    `admission` (flags that were given; None = not given) win over the
    file and its `admission` block."""
    data = dict(data)
    known = {f.name for f in fields(GatewayConfig)} | {"admission", "ladder"}
    unknown = set(data) - known - {"tenants"}
    if unknown:
        raise ValueError(f"unknown gateway config keys {sorted(unknown)}")
    values: dict[str, Any] = {}
    if "pools" in data:
        values["pools"] = tuple(_pool(p) for p in _list(data.pop("pools"), "pools"))
    if "router" in data:
        values["router"] = _build(RouterConfig, data.pop("router"), "router")
    if "aliases" in data:
        values["aliases"] = tuple(_alias(name, a) for name, a in _dict(data.pop("aliases"), "aliases").items())
    if "ladder" in data:
        ladder = _dict(data.pop("ladder"), "ladder")
        values["ladder_max_tokens"] = ladder.pop("max_tokens_cap", GatewayConfig.ladder_max_tokens)
        values["ladder"] = tuple((int(k), tuple(_list(v, f"ladder.{k}"))) for k, v in ladder.items())
    if "breaker" in data:
        values["breaker"] = _build(BreakerConfig, data.pop("breaker"), "breaker")
    if "tenants" in data:
        values["api_keys_path"] = data.pop("tenants")
    admission_values = _dict(data.pop("admission", {}), "admission")
    admission_values.update({k: v for k, v in (admission or {}).items() if v is not None})
    values.update(data)
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        values["admission"] = AdmissionConfig(**admission_values)
        return GatewayConfig(**values)
    except TypeError as exc:
        raise ValueError(f"gateway config: {exc}") from exc


def add_backends(data: dict[str, Any], urls: list[str]) -> dict[str, Any]:
    """A config mapping with `--backend URL ...` added: they form the one
    pool (its model read from the backends), or join a file's single pool."""
    if not urls:
        return data
    pools = list(_list(data.get("pools", []), "pools"))
    if len(pools) > 1:
        raise ValueError("--backend with several pools in --config: put the backends in their pools")
    pool = dict(_dict(pools[0], "pools[]")) if pools else {"model": None, "backends": []}
    pool["backends"] = list(_list(pool.get("backends", []), "pools[].backends")) + list(urls)
    return {**data, "pools": [pool]}


def _pool(entry: Any) -> PoolConfig:
    entry = _dict(entry, "pools[]")
    backends = tuple(BackendConfig(b) if isinstance(b, str) else _build(BackendConfig, b, "backend")
                     for b in _list(entry.get("backends"), "pools[].backends"))
    return PoolConfig(entry.get("model"), backends, entry.get("smaller"))


def _alias(name: str, entry: Any) -> AliasConfig:
    entry = dict(_dict(entry, f"aliases.{name}"))
    rules = tuple(_build(AliasRule, r, f"aliases.{name}.rules[]") for r in _list(entry.pop("rules", []), "rules"))
    return _build(AliasConfig, {**entry, "name": name, "rules": rules}, f"aliases.{name}")


def _build(cls, entry: Any, where: str):
    entry = _dict(entry, where)
    allowed = {f.name for f in fields(cls)}
    unknown = set(entry) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    return cls(**entry)


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping, got {json.dumps(value)[:60]}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {json.dumps(value)[:60]}")
    return value
