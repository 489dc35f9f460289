"""LoRA adapter names across a fleet (issue 16 with issue 20's adapters):
simulated replicas (`kvserve serve --simulate --lora-modules`) list and
serve their adapters as a real server does, and `kvserve gateway` lists the
backends' adapters in its /v1/models and routes a request for one only to
the backends that serve it, refusing an unknown name with OpenAI's 404;
prefix affinity keys a prompt by the adapter it runs under. Then the same
over real tiny-model replicas (`kvserve serve`'s server loop with its
--lora-modules, on a PEFT adapter written here): the gateway reads a real
server's adapter cards, and what it routes under the adapter is the PEFT
merged model's greedy answer."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fleet_helpers import gateway, simulated_backend, start_all, tiny_backend
from tests.load_helpers import wait_until
from tests.server_helpers import MODEL_NAME, byte_tokenizer
from tests.tiny_models import hf_greedy, random_prompts, tiny_llama, tiny_peft_adapter

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


# --- real tiny-model replicas ---------------------------------------------------------------

TINY_MAX_TOKENS = 6
TINY_PROMPTS = random_prompts([9, 11, 13, 10, 12, 8], seed=21)  # token ids: their bytes are the affinity key


@pytest.fixture(scope="module")
def tiny_fleet(tmp_path_factory):
    """Two tiny-model replicas, one serving the adapter `sql`, behind a
    prefix-affinity gateway; and the base and PEFT merged models."""
    tmp = tmp_path_factory.mktemp("tiny-adapters")
    base = tiny_llama(seed=0)  # the weights the tiny replicas serve
    merged = tiny_peft_adapter(base, tmp / "sql", seed=5)
    with_adapter = tiny_backend(None, "--lora-modules", f"sql={tmp / 'sql'}", "--no-warm-up")
    without = tiny_backend(None, "--enable-lora", "--no-warm-up")
    gw = gateway([with_adapter.url, without.url], "--router", "prefix-affinity", "--state-dir", str(tmp / "state"))
    procs = start_all(with_adapter, without, gw)
    yield {"with": with_adapter, "without": without, "gateway": gw, "base": base, "merged": merged}
    for p in procs:
        p.stop()


def greedy_completion(url: str, model: str, prompt: list[int]) -> httpx.Response:
    answer = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": TINY_MAX_TOKENS, "temperature": 0})
    assert answer.status_code == 200, answer.text
    return answer


def test_the_gateway_lists_a_real_servers_adapter_with_its_base_as_parent(tiny_fleet):
    cards = {c["id"]: c for c in httpx.get(tiny_fleet["gateway"].url + "/v1/models", timeout=30).json()["data"]}
    assert set(cards) == {MODEL_NAME, "sql"}
    assert cards["sql"]["parent"] == MODEL_NAME and cards[MODEL_NAME]["parent"] is None


def test_the_gateway_routes_an_adapter_to_its_replica_and_answers_with_the_merged_model(tiny_fleet):
    """Every prompt under `sql` goes to the one replica with it, whichever
    replica its affinity key would pick, and is PEFT's merged model's greedy
    answer; the same prompts under the base model are the base model's."""
    gw, decode = tiny_fleet["gateway"].url, byte_tokenizer().decode
    for prompt in TINY_PROMPTS:
        under_adapter = greedy_completion(gw, "sql", prompt)
        assert under_adapter.headers["x-kvserve-backend"] == tiny_fleet["with"].url
        assert under_adapter.json()["model"] == "sql"
        expected = decode(hf_greedy(tiny_fleet["merged"], prompt, TINY_MAX_TOKENS))
        assert under_adapter.json()["choices"][0]["text"] == expected
        under_base = greedy_completion(gw, MODEL_NAME, prompt)
        assert under_base.json()["choices"][0]["text"] == decode(hf_greedy(tiny_fleet["base"], prompt, TINY_MAX_TOKENS))
        assert under_base.json()["choices"][0]["text"] != expected


def test_a_real_replicas_adapter_gets_its_own_affinity_key_and_unknown_names_a_404(tiny_fleet):
    gw, prompt = tiny_fleet["gateway"].url, TINY_PROMPTS[0]
    sql = greedy_completion(gw, "sql", prompt).headers["x-kvserve-route-key"]
    assert greedy_completion(gw, "sql", prompt).headers["x-kvserve-route-key"] == sql
    assert greedy_completion(gw, MODEL_NAME, prompt).headers["x-kvserve-route-key"] != sql
    refused = httpx.post(gw + "/v1/completions", json={"model": "sq", "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert "sql" in refused.json()["error"]["message"]
