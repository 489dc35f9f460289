"""LoRA adapter names across a fleet (issue 16 with issue 20's adapters):
simulated replicas (`kvserve serve --simulate --lora-modules`) list and
serve their adapters as a real server does, and `kvserve gateway` lists the
backends' adapters in its /v1/models and routes a request for one only to
the backends that serve it, refusing an unknown name with OpenAI's 404;
prefix affinity keys a prompt by the adapter it runs under."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fleet_helpers import gateway, simulated_backend, start_all
from tests.load_helpers import wait_until

BASE = "base"
# a fast roofline (steps of a few ms, each a sleep): the test counts where requests went, not time
COMMON = ("--preset", "llama-3.1-8b", "--hardware", "h100", "--served-model-name", BASE, "--no-warm-up",
          "--kv-cache-memory", "1GiB", "--max-queue-wait", "30")


def adapter_folder(folder, rank: int = 8):
    """What a simulated replica reads of a PEFT folder: its adapter_config.json."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
        "bias": "none"}))
    return folder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    sql = adapter_folder(tmp / "sql")
    with_adapter = simulated_backend(None, *COMMON, "--lora-modules", f"sql={sql}")
    without = simulated_backend(None, *COMMON, "--enable-lora")
    gw = gateway([with_adapter.url, without.url], "--router", "round-robin", "--state-dir", str(tmp / "state"),
                 "--log-level", "warning")
    affine = gateway([with_adapter.url, without.url], "--router", "prefix-affinity", "--state-dir",
                     str(tmp / "affine-state"), "--log-level", "warning")
    procs = start_all(with_adapter, without, gw, affine)
    yield {"with": with_adapter, "without": without, "gateway": gw, "affine": affine, "tmp": tmp}
    for p in procs:
        p.stop()


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 3},
                      timeout=60)


def test_a_simulated_replica_lists_serves_and_refuses_adapters_as_a_server_does(fleet):
    url = fleet["with"].url
    cards = {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {BASE, "sql"} and cards["sql"]["parent"] == BASE and cards[BASE]["parent"] is None
    answer = complete(url, "sql")
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "sql" and answer.json()["usage"]["completion_tokens"] == 3
    assert answer.headers["x-kvserve-adapter-id"]  # the adapter's id, from its files
    # an unknown name, and an adapter the other replica does not serve: the server's 404
    for refused in (complete(url, "nope"), complete(fleet["without"].url, "sql")):
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_the_gateway_lists_adapters_and_routes_them_only_to_backends_serving_them(fleet):
    gw, with_url = fleet["gateway"].url, fleet["with"].url
    cards = {c["id"]: c for c in httpx.get(gw + "/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {BASE, "sql"} and cards["sql"]["parent"] == BASE
    # round-robin: base requests alternate over both backends, the adapter's all go to the one with it
    base_backends = {complete(gw, BASE).headers["x-kvserve-backend"] for _ in range(4)}
    assert base_backends == {with_url, fleet["without"].url}
    for _ in range(6):
        answer = complete(gw, "sql")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvserve-backend"] == with_url and answer.json()["model"] == "sql"


def test_prefix_affinity_keys_the_same_prompt_apart_under_another_adapter(fleet):
    """An adapter changes every layer's KV (the engine's prefix cache keys
    blocks by adapter): the same text under the base model and under an
    adapter is two keys, and one prompt under one adapter keeps one key."""
    def route_key(model: str) -> str:
        answer = complete(fleet["affine"].url, model)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-kvserve-route-key"]

    sql = route_key("sql")
    assert route_key("sql") == sql
    assert route_key(BASE) != sql


def test_the_gateway_refuses_an_unknown_model_with_openais_404(fleet):
    refused = complete(fleet["gateway"].url, "no-such-adapter")
    assert refused.status_code == 404
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "model_not_found", "model")
    assert "sql" in error["message"]  # it names what the fleet serves


def test_an_adapter_loaded_at_run_time_joins_the_gateways_routing(fleet):
    gw, without = fleet["gateway"].url, fleet["without"].url
    chat = adapter_folder(fleet["tmp"] / "chat", rank=4)
    loaded = httpx.post(without + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(chat)},
                        timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert wait_until(lambda: "chat" in {c["id"] for c in httpx.get(gw + "/v1/models", timeout=30).json()["data"]},
               timeout_s=30)
    for _ in range(4):
        answer = complete(gw, "chat")
        assert answer.status_code == 200 and answer.headers["x-kvserve-backend"] == without
