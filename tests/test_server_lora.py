"""LoRA adapters through the HTTP API, with the official `openai` client and
vLLM's runtime endpoints: the adapter is chosen by `model`, listed in
/v1/models with its base as parent, named in the version headers and the
system_fingerprint, loaded and unloaded at run time; unknown adapters are
404, bad folders 400; /metrics has vLLM's vllm:lora_requests_info."""

import concurrent.futures

import httpx
import pytest

from kvserve.server.cli import lora_modules
from tests.server_helpers import MODEL_NAME, live_server, tiny_core
from tests.tiny_models import hf_greedy, tiny_llama, tiny_peft_adapter

openai = pytest.importorskip("openai")

MAX_TOKENS = 8
PROMPT = [17, 5, 99, 3, 42, 8, 200, 31, 64, 12, 7]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters on the server's tiny model: [(folder, PEFT merged model)]."""
    base = tiny_llama(seed=0)  # the weights tiny_core serves
    pairs = []
    for seed in (1, 2):
        folder = tmp_path_factory.mktemp(f"adapter{seed}")
        pairs.append((folder, tiny_peft_adapter(base, folder, seed=seed)))
    return base, pairs


@pytest.fixture(scope="module")
def server(adapters):
    core = tiny_core(num_blocks=128, enable_lora=True, max_loras=2)
    core.load_lora_adapter("a0", str(adapters[1][0][0]))  # as --lora-modules a0=PATH does
    with live_server(core) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def complete(client, model):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)


def raw_completion(server, model) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", timeout=30, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})


def post(server, path, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_models_lists_each_adapter_with_the_base_as_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert cards["a0"].parent == MODEL_NAME and cards[MODEL_NAME].parent is None
    assert cards["a0"].root == str(adapters[1][0][0])


def test_an_adapters_completion_is_its_merged_models_answer_named_in_the_versions(server, client, adapters):
    base, pairs = adapters
    byte_text = server.serving.tokenizer.decode
    under_adapter, under_base = complete(client, "a0"), complete(client, MODEL_NAME)
    assert under_adapter.model == "a0" and under_base.model == MODEL_NAME
    assert under_adapter.choices[0].text == byte_text(hf_greedy(pairs[0][1], PROMPT, MAX_TOKENS))
    assert under_base.choices[0].text == byte_text(hf_greedy(base, PROMPT, MAX_TOKENS))
    assert under_adapter.choices[0].text != under_base.choices[0].text
    adapter_id = server.serving.core.adapters.get("a0").adapter_id
    assert under_adapter.system_fingerprint == f"{under_base.system_fingerprint}_{adapter_id[:6]}"
    assert raw_completion(server, "a0").headers["x-kvserve-adapter-id"] == adapter_id
    assert "x-kvserve-adapter-id" not in raw_completion(server, MODEL_NAME).headers


def test_concurrent_requests_under_two_adapters_and_the_base_each_get_their_own_answer(server, client, adapters):
    base, pairs = adapters
    assert post(server, "/v1/load_lora_adapter", {"lora_name": "mix1", "lora_path": str(pairs[1][0])}).status_code == 200
    try:
        byte_text = server.serving.tokenizer.decode
        models = ["a0", MODEL_NAME, "mix1"] * 3
        with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
            texts = list(pool.map(lambda m: complete(client, m).choices[0].text, models))
        expected = {"a0": hf_greedy(pairs[0][1], PROMPT, MAX_TOKENS), MODEL_NAME: hf_greedy(base, PROMPT, MAX_TOKENS),
                    "mix1": hf_greedy(pairs[1][1], PROMPT, MAX_TOKENS)}
        assert texts == [byte_text(expected[m]) for m in models]
    finally:
        post(server, "/v1/unload_lora_adapter", {"lora_name": "mix1"})


def test_load_serve_and_unload_an_adapter_at_run_time(server, client, adapters):
    _, pairs = adapters
    body = {"lora_name": "a1", "lora_path": str(pairs[1][0])}
    loaded = post(server, "/v1/load_lora_adapter", body)
    assert loaded.status_code == 200 and "a1" in loaded.text
    again = post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_adapter_exists"
    assert "a1" in {m.id for m in client.models.list().data}
    text = complete(client, "a1").choices[0].text
    assert text == server.serving.tokenizer.decode(hf_greedy(pairs[1][1], PROMPT, MAX_TOKENS))

    unloaded = post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert unloaded.status_code == 200
    assert "a1" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        complete(client, "a1")
    missing = post(server, "/v1/unload_lora_adapter", {"lora_name": "a1"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "lora_adapter_not_found"


def test_an_unknown_adapter_is_404_naming_what_is_served(client):
    with pytest.raises(openai.NotFoundError) as err:
        complete(client, "no-such-adapter")
    error = err.value.body if isinstance(err.value.body, dict) and "code" in err.value.body else \
        err.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "/v1/models" in error["message"]


@pytest.mark.parametrize("lora_path, message", [
    ("/nonexistent/adapter", "is not a folder"),
    ("{tmp}", "no adapter_config.json"),
])
def test_a_bad_adapter_folder_is_a_clear_400(server, tmp_path, lora_path, message):
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": lora_path.format(tmp=tmp_path)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"]
    assert error["code"] == "invalid_lora_adapter" and error["param"] == "lora_path"
    assert set(error) == {"message", "type", "code", "param"}


def test_a_malformed_load_body_is_400(server):
    response = post(server, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert response.status_code == 400 and "lora_path" in response.json()["error"]["message"]


def test_metrics_export_vllms_lora_requests_info(server, client):
    complete(client, "a0")
    text = httpx.get(server.base_url + "/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1  # only the current state
    assert 'max_lora="2"' in lines[0]
    assert 'running_lora_adapters=""' in lines[0] and 'waiting_lora_adapters=""' in lines[0]  # all finished


def test_the_runtime_endpoints_refuse_when_lora_is_not_enabled():
    with live_server(tiny_core()) as live:
        response = post(live, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "lora_not_enabled"
        assert "vllm:lora_requests_info" not in httpx.get(live.base_url + "/metrics").text


def test_lora_modules_flag_parses_name_equals_path():
    assert lora_modules(["a=/x/y", "b=/z=w"]) == [("a", "/x/y"), ("b", "/z=w")]
    for bad in ("a", "=/x", "a="):
        with pytest.raises(ValueError, match="NAME=PATH"):
            lora_modules([bad])
