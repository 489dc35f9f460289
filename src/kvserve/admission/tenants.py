"""API keys -> tenants and their limits.

The keys file is JSON mapping each key to its tenant:

    {"sk-alice": {"tenant": "alice", "max_concurrent": 8, "tokens_per_minute": 200000},
     "sk-batch": {"tenant": "batch", "priority": 1}}

`max_concurrent` (requests in flight), `tokens_per_minute` (prompt +
max_tokens, refunded to actual on finish) and `priority` (the most urgent
class the tenant may use; lower = more urgent) are optional. Without a keys
file every request belongs to one default tenant with no limits.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.admission.quotas import TenantLimits

DEFAULT_TENANT = "default"
_FIELDS = {"tenant", "max_concurrent", "tokens_per_minute", "priority"}


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = TenantLimits()
    priority: int | None = None  # floor on the priority value its requests get


class TenantDirectory:
    """Authenticates a bearer key to a Tenant."""

    def __init__(self, keys: dict[str, Tenant] | None = None) -> None:
        self._keys = dict(keys or {})

    @property
    def auth_required(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant, or None when keys are configured and the
        header does not carry a known one."""
        if not self._keys:
            return Tenant(DEFAULT_TENANT)
        key = _bearer(authorization)
        if key is None:
            return None
        # Compare against every key in constant time, so timing reveals nothing.
        found = None
        for known, tenant in self._keys.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        return found

    def limits(self) -> dict[str, TenantLimits]:
        return {t.name: t.limits for t in self._keys.values()}

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        """Parse a keys file; ValueError names the bad entry."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read API keys file {path}: {exc}") from exc
        if not isinstance(data, dict) or not data:
            raise ValueError(f"API keys file {path} must be a non-empty JSON object key -> tenant")
        return cls({key: _parse_tenant(key, entry) for key, entry in data.items()})


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


def _parse_tenant(key: str, entry: object) -> Tenant:
    where = f"API key {key[:6]}..."
    if not isinstance(entry, dict) or not isinstance(entry.get("tenant"), str) or not entry["tenant"]:
        raise ValueError(f"{where}: each entry needs a non-empty string 'tenant'")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)} (allowed: {sorted(_FIELDS)})")
    for name in ("max_concurrent", "tokens_per_minute"):
        value = entry.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
    priority = entry.get("priority")
    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
    limits = TenantLimits(entry.get("max_concurrent"), entry.get("tokens_per_minute"))
    return Tenant(entry["tenant"], limits, priority)
