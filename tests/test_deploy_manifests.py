"""deploy/: the Kubernetes manifests validate against the Kubernetes JSON
schemas (kubernetes-validate ships them; strict: no unknown fields; no
cluster, nothing downloaded) and hold together: readiness on /ready and a
preStop before the drain, the HPA scaling the replicas on the queue and its
wait (not CPU) up to the backends the gateway's config names, that config
read by kvserve's own gateway config reader. The Ray Serve config example
builds kvserve's application."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvserve.gateway import config as gateway_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES_VERSION = "1.37"


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def _kind(kind: str) -> list[dict]:
    return [doc for _, doc in _documents() if doc["kind"] == kind]


@pytest.mark.parametrize("name, doc", _documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_manifest_validates_against_the_kubernetes_schema(name, doc):
    # SchemaNotFoundError (a kind or apiVersion Kubernetes does not have) fails the test too.
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_an_invalid_manifest_is_caught():
    (replicas,) = _kind("StatefulSet")
    broken = yaml.safe_load(yaml.safe_dump(replicas))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_replicas_are_ready_on_ready_and_drain_after_prestop():
    (replicas,) = _kind("StatefulSet")
    pod = replicas["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    grace_s = float(container["args"][container["args"].index("--shutdown-grace") + 1])
    prestop_s = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > grace_s + prestop_s  # the drain finishes before SIGKILL


def test_hpa_scales_the_replicas_on_the_queue_up_to_the_gateways_backends():
    (hpa,) = _kind("HorizontalPodAutoscaler")
    (replicas,) = _kind("StatefulSet")
    assert hpa["spec"]["scaleTargetRef"]["name"] == replicas["metadata"]["name"]
    metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert metrics == {"vllm_num_requests_waiting", "vllm_request_queue_time_p95_seconds"}  # no CPU
    (gateway_map,) = [m for m in _kind("ConfigMap") if m["metadata"]["name"] == "kvserve-gateway"]
    config = gateway_config.from_mapping(yaml.safe_load(gateway_map["data"]["gateway.yaml"]))
    urls = [b.url for pool in config.pools for b in pool.backends]
    service = replicas["spec"]["serviceName"]
    expected = [f"http://{replicas['metadata']['name']}-{i}.{service}:8000" for i in range(hpa["spec"]["maxReplicas"])]
    assert urls == expected


def test_ray_serve_config_builds_the_application():
    from kvserve.ray_app import MODEL_DEPLOYMENT, build_app, parse_app_args

    config = yaml.safe_load((DEPLOY / "ray" / "kvserve.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "kvserve.ray_app:build_app"
    args = parse_app_args(app["args"])
    assert (args.min_replicas, args.max_replicas, args.sleep_idle) == (2, 8, True)
    ingress = build_app(app["args"])
    model = ingress._bound_deployment.init_args[0]  # the bound model deployment
    assert model._bound_deployment.name == MODEL_DEPLOYMENT
    assert model._bound_deployment._deployment_config.autoscaling_config.max_replicas == 8
