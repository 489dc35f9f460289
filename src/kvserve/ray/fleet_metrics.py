"""The fleet's series on the ingress's one /metrics: every replica's own
`vllm:*` series (each replica sends its `fleet_lines` in its routing
stats, so they are a stats period old at most), each
sample labelled `replica="<id>"`, as the ingress labels its per-replica
gauges; so a Prometheus pointed at the ingress sees the whole fleet
(sum by replica, or over it). Pure text work, no Ray."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

FLEET_PREFIX = "vllm:"
REPLICA_LABEL = "replica"


class _Families:
    """A collector of already-built families (a registry renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def replica_series(texts: Mapping[str, str], prefix: str = FLEET_PREFIX) -> bytes:
    """The `prefix` families of each replica's exposition text (by replica
    id), merged: one HELP / TYPE per family, every sample with its replica's
    label added."""
    merged: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(prefix):
                continue
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            for sample in family.samples:
                into.samples.append(sample._replace(labels={**sample.labels, REPLICA_LABEL: replica}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


def fleet_lines(text: str, prefix: str = FLEET_PREFIX) -> str:
    """The lines of an exposition text that belong to `prefix` families
    (what a replica sends the ingress: its other series stay home)."""
    keep = ("# HELP " + prefix, "# TYPE " + prefix, prefix)
    return "".join(line + "\n" for line in text.splitlines() if line.startswith(keep))
