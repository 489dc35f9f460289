"""LoRA adapters in the engine: kvserve's adapter against Hugging Face PEFT's
merged model (logits and greedy tokens), several adapters and the base model
batched in one step, the prefix cache kept apart per adapter, LRU slots under
--max-loras, and the adapter folder checks."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.contract import Request, SamplingParams
from kvserve.model.lora import LoraError, read_lora_adapter
from kvserve.runner.step_batch import build_step_batch
from kvserve.scheduler.scheduler import ScheduledChunk
from tests.tiny_models import (hf_greedy, model_config_of, random_prompts, tiny_engine, tiny_llama,
                               tiny_peft_adapter, word_tokenizer)

MAX_NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
# PEFT configurations the reference covers: every projection; and attention
# only, with rsLoRA scaling and a per-module rank (rank_pattern).
ADAPTER_CONFIGS = {
    "all-projections": dict(r=8, lora_alpha=16),
    "qv-rslora-rank-pattern": dict(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=True,
                                   rank_pattern={"v_proj": 2}),
}


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module", params=list(ADAPTER_CONFIGS))
def adapter(request, base, tmp_path_factory):
    """(folder, PEFT's merged model) of one adapter configuration."""
    folder = tmp_path_factory.mktemp(request.param)
    return folder, tiny_peft_adapter(base, folder, seed=1, **ADAPTER_CONFIGS[request.param])


@pytest.fixture(scope="module")
def two_adapters(base, tmp_path_factory):
    """Two different adapters: [(folder, merged model)] * 2."""
    pairs = []
    for seed in (1, 2):
        folder = tmp_path_factory.mktemp(f"adapter{seed}")
        pairs.append((folder, tiny_peft_adapter(base, folder, seed=seed)))
    return pairs


def lora_engine(base, **fields):
    return tiny_engine(base, enable_lora=True, **fields)


def run(engine, jobs, params=GREEDY):
    """jobs: [(prompt, adapter_id or None)] added together and stepped to
    completion; (final outputs in order, the adapter ids of each step)."""
    requests = [engine.new_request(p, params, adapter_id=a) for p, a in jobs]
    for request in requests:
        engine.add_request(request)
    final, steps = {}, []
    while engine.has_unfinished():
        result = engine.step()
        steps.append({c.request.adapter_id for c in result.scheduled.chunks})
        final.update((o.request_id, o) for o in result.outputs if o.finished)
    return [final[r.request_id] for r in requests], steps


def test_adapter_logits_match_peft_merged_model_beside_the_base_in_one_forward(base, adapter):
    folder, merged = adapter
    engine = lora_engine(base)
    lora = engine.load_lora_adapter("a", str(folder))
    runner = engine.runner
    prompts = random_prompts([29, 17], seed=3)
    # Chunk 0 under the adapter, chunk 1 the base model, in one forward pass.
    chunks = [ScheduledChunk(Request("a", prompts[0], GREEDY, 0.0), 0, 29, list(range(8)), samples=True),
              ScheduledChunk(Request("b", prompts[1], GREEDY, 0.0), 0, 17, list(range(8, 13)), samples=True)]
    batch = build_step_batch(chunks, runner.block_size, runner.device)
    slot = runner.lora_slots.slots_for([lora])[lora.adapter_id]
    slot_of_token = [slot] * 29 + [-1] * 17
    with torch.inference_mode():
        hidden = runner.model.forward(batch.token_ids, runner.kv_caches, batch.meta,
                                      runner.lora_slots.step(slot_of_token))
        logits = runner.model.compute_logits(hidden).cpu()
        expected_adapter = merged(torch.tensor([prompts[0]])).logits[0]
        expected_base = base(torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(logits[:29], expected_adapter, atol=1e-3, rtol=0)
    torch.testing.assert_close(logits[29:], expected_base, atol=1e-3, rtol=0)
    # The adapter changes the model: the same prompt under the base differs.
    assert (expected_adapter - base(torch.tensor([prompts[0]])).logits[0]).abs().max() > 0.1


def test_adapter_greedy_tokens_match_peft_merged_model(base, adapter):
    folder, merged = adapter
    engine = lora_engine(base)
    adapter_id = engine.load_lora_adapter("a", str(folder)).adapter_id
    prompts = random_prompts([5, 23, 40], seed=4)
    outputs, _ = run(engine, [(p, adapter_id) for p in prompts])
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(merged, prompt, MAX_NEW_TOKENS)


def test_two_adapters_and_the_base_batch_in_one_step_each_with_its_own_answer(base, two_adapters):
    engine = lora_engine(base, max_loras=2)
    ids = [engine.load_lora_adapter(f"a{i}", str(folder)).adapter_id for i, (folder, _) in enumerate(two_adapters)]
    prompt = random_prompts([19], seed=5)[0]
    outputs, steps = run(engine, [(prompt, ids[0]), (prompt, None), (prompt, ids[1])])
    expected = [hf_greedy(two_adapters[0][1], prompt, MAX_NEW_TOKENS), hf_greedy(base, prompt, MAX_NEW_TOKENS),
                hf_greedy(two_adapters[1][1], prompt, MAX_NEW_TOKENS)]
    assert [o.token_ids for o in outputs] == expected
    assert len({tuple(tokens) for tokens in expected}) == 3  # three different models
    assert all(step == {ids[0], None, ids[1]} for step in steps)  # every step mixed all three
    assert len(steps) == MAX_NEW_TOKENS


def test_the_same_prompt_under_two_adapters_shares_no_prefix_cache_blocks(base, two_adapters):
    engine = lora_engine(base, max_loras=2)
    ids = [engine.load_lora_adapter(f"a{i}", str(folder)).adapter_id for i, (folder, _) in enumerate(two_adapters)]
    prompt = random_prompts([33], seed=6)[0]
    cached = []
    for adapter_id in (ids[0], ids[1], None, ids[0]):
        outputs, _ = run(engine, [(prompt, adapter_id)])
        cached.append(outputs[0].num_cached_tokens)
    # a0, a1 and the base each compute the prompt; a0 again hits its own blocks.
    assert cached[:3] == [0, 0, 0]
    assert cached[3] == 32  # the full blocks of 4 tokens
    assert outputs[0].token_ids == hf_greedy(two_adapters[0][1], prompt, MAX_NEW_TOKENS)


def test_max_loras_one_runs_two_adapters_in_turn_with_lru_slots(base, two_adapters):
    engine = lora_engine(base, max_loras=1)
    ids = [engine.load_lora_adapter(f"a{i}", str(folder)).adapter_id for i, (folder, _) in enumerate(two_adapters)]
    prompts = random_prompts([11, 13, 9], seed=7)
    jobs = [(prompts[0], ids[0]), (prompts[1], ids[1]), (prompts[2], ids[0])]
    outputs, steps = run(engine, jobs)
    for (prompt, _), output, (_, merged) in zip(jobs, outputs, [two_adapters[0], two_adapters[1], two_adapters[0]]):
        assert output.token_ids == hf_greedy(merged, prompt, MAX_NEW_TOKENS)
    assert all(len(step - {None}) <= 1 for step in steps)  # never two adapters in one step
    # a0, then a1 evicting it (r1 waits at the head of the queue, r2 behind it), then a0 again
    assert engine.runner.lora_slots.num_loads == 3
    assert engine.runner.lora_slots.resident_ids == [ids[0]]


def test_unloaded_adapter_finishes_its_running_requests_and_frees_its_slot(base, two_adapters):
    engine = lora_engine(base, max_loras=2)
    adapter_id = engine.load_lora_adapter("a0", str(two_adapters[0][0])).adapter_id
    prompt = random_prompts([12], seed=8)[0]
    request = engine.new_request(prompt, GREEDY, adapter_id=adapter_id)
    engine.add_request(request)
    engine.step()
    assert engine.unload_lora_adapter("a0") and not engine.unload_lora_adapter("a0")
    assert engine.adapters.get("a0") is None
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == hf_greedy(two_adapters[0][1], prompt, MAX_NEW_TOKENS)
    engine.step()  # the engine thread hands the slot back once the last request is gone
    assert engine.runner.lora_slots.resident_ids == []
    late = engine.new_request(prompt, GREEDY, adapter_id=adapter_id)
    with pytest.raises(ValueError, match="unloaded"):  # its weights are gone
        engine.add_request(late)


def test_offline_llm_serves_an_adapter_per_prompt(base, two_adapters, tmp_path):
    from kvserve.engine.llm import LLM

    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    word_tokenizer()._backend.save(str(tmp_path / "base" / "tokenizer.json"))
    llm = LLM(str(tmp_path / "base"), kv_cache_memory=2**20, block_size=4, enable_lora=True, quantization="none")
    llm.load_lora_adapter("a1", two_adapters[1][0])
    prompt = random_prompts([10], seed=9)[0]
    outputs = llm.generate([prompt, prompt], GREEDY, lora=["a1", None])
    assert outputs[0].token_ids == hf_greedy(two_adapters[1][1], prompt, MAX_NEW_TOKENS)
    assert outputs[1].token_ids == hf_greedy(base, prompt, MAX_NEW_TOKENS)
    with pytest.raises(ValueError, match="no LoRA adapter named"):
        llm.generate(prompt, GREEDY, lora="missing")


# ---- the folder checks ------------------------------------------------------

@pytest.fixture()
def folder_copy(two_adapters, tmp_path):
    """A writable copy of a good adapter folder."""
    source = two_adapters[0][0]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    return tmp_path


def _edit_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


def _edit_weights(folder, edit):
    file = folder / "adapter_model.safetensors"
    save_file(edit(load_file(str(file))), str(file))


def _first_a(tensors):
    return next(k for k in tensors if k.endswith("lora_A.weight"))


BAD_FOLDERS = {
    "no config": (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    "config not JSON": (lambda f: (f / "adapter_config.json").write_text("{r: 8"), "not readable JSON"),
    "weights not safetensors": (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\0" * 64),
                                "not a readable safetensors"),
    "DoRA": (lambda f: _edit_config(f, use_dora=True), "DoRA"),
    "prompt tuning": (lambda f: _edit_config(f, peft_type="PROMPT_TUNING"), "only LORA"),
    "biases": (lambda f: _edit_config(f, bias="all"), "bias"),
    "modules_to_save": (lambda f: _edit_config(f, modules_to_save=["lm_head"]), "modules_to_save"),
    "wrong shapes": (lambda f: _edit_weights(f, lambda t: {**t, _first_a(t): t[_first_a(t)][:, :10].contiguous()}),
                     "do not fit the base model"),
    "only lora_A": (lambda f: _edit_weights(f, lambda t: {k: v for k, v in t.items() if "lora_B" not in k}),
                    "needs both lora_A and lora_B"),
    "embedding target": (lambda f: _edit_weights(f, lambda t: {
        **t, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 256)}), "is not a LoRA A/B matrix"),
    "layer past the model": (lambda f: _edit_weights(f, lambda t: {
        k.replace("layers.1.", "layers.7."): v for k, v in t.items()}), "names layer 7"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_adapter_folder_is_refused_with_a_message_naming_the_problem(base, folder_copy, case):
    break_it, message = BAD_FOLDERS[case]
    config = model_config_of(base)
    read_lora_adapter("ok", folder_copy, config, max_rank=16)  # the copy is good before the edit
    break_it(folder_copy)
    with pytest.raises(LoraError, match=message):
        read_lora_adapter("bad", folder_copy, config, max_rank=16)


def test_rank_above_max_lora_rank_and_a_missing_folder_are_refused(base, folder_copy, tmp_path):
    config = model_config_of(base)
    with pytest.raises(LoraError, match="rank 8 is above --max-lora-rank 4"):
        read_lora_adapter("a", folder_copy, config, max_rank=4)
    with pytest.raises(LoraError, match="is not a folder"):
        read_lora_adapter("a", tmp_path / "nowhere", config, max_rank=16)


def test_adapter_id_is_the_hash_of_its_files(base, two_adapters, folder_copy):
    config = model_config_of(base)
    first = read_lora_adapter("x", two_adapters[0][0], config, 16)
    assert read_lora_adapter("y", folder_copy, config, 16).adapter_id == first.adapter_id  # same bytes
    assert read_lora_adapter("x", two_adapters[1][0], config, 16).adapter_id != first.adapter_id
    _edit_weights(folder_copy, lambda t: {k: v * 2 for k, v in t.items()})
    assert read_lora_adapter("y", folder_copy, config, 16).adapter_id != first.adapter_id


def test_slots_evict_the_least_recently_used_adapter_not_in_the_step(base, two_adapters, folder_copy):
    from kvserve.model.lora import LoraSlots

    config = model_config_of(base)
    _edit_weights(folder_copy, lambda t: {k: v * 3 for k, v in t.items()})  # a third adapter
    a, b, c = (read_lora_adapter(n, f, config, 16) for n, f in
               (("a", two_adapters[0][0]), ("b", two_adapters[1][0]), ("c", folder_copy)))
    slots = LoraSlots(config, num_slots=2, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    slot_a = slots.slots_for([a])[a.adapter_id]
    slots.slots_for([b])
    slots.slots_for([a])  # a is now the most recent
    assert slots.slots_for([c]) == {c.adapter_id: 1 - slot_a}  # b evicted, its slot reused
    assert slots.resident_ids == [a.adapter_id, c.adapter_id]
    assert slots.num_loads == 3
    with pytest.raises(ValueError, match="max_loras is 2"):
        slots.slots_for([a, b, c])


def _random_adapter(name: str, config, ranks: dict[str, int], seed: int):
    """A LoraAdapter on layer 0 with the given rank per target (no folder)."""
    from kvserve.model.lora import LoraAdapter, _target_dims

    generator = torch.Generator().manual_seed(seed)
    dims = _target_dims(config)
    weights = {(0, target): (torch.randn((rank, dims[target][0]), generator=generator),
                             torch.randn((dims[target][1], rank), generator=generator))
               for target, rank in ranks.items()}
    return LoraAdapter(name, "", f"id-{name}", max(ranks.values()), weights)


@pytest.mark.parametrize("group, targets", [("qkv", ("q_proj", "k_proj", "v_proj")), ("down", ("down_proj",))])
def test_the_grouped_update_gives_each_token_its_own_slots_product_and_leaves_base_tokens_alone(
        base, group, targets):
    """Tokens of slots 0 and 2 (slot 1 resident but unused: a gap in the
    range), uneven counts per slot (padding in the grid), interleaved with
    base tokens: each token's row gains exactly x @ A.T @ B.T of its own
    adapter, per target, and a base token's row is untouched."""
    from kvserve.model.lora import LoraSlots

    config = model_config_of(base)
    rank_sets = [{"q_proj": 4, "v_proj": 2, "down_proj": 3}, {"k_proj": 8, "down_proj": 8},
                 {"q_proj": 1, "k_proj": 5, "v_proj": 8, "down_proj": 6}]
    adapters = [_random_adapter(f"a{i}", config, ranks, seed=i) for i, ranks in enumerate(rank_sets)]
    slots = LoraSlots(config, num_slots=3, max_rank=8, dtype=torch.float64, device=torch.device("cpu"))
    slot_of = slots.slots_for(adapters)
    used = [adapters[0], adapters[2]]
    slot_of_token = [slot_of[used[1].adapter_id], -1, slot_of[used[0].adapter_id], slot_of[used[1].adapter_id],
                     -1, slot_of[used[1].adapter_id]]
    stack = slots.layers[0][group]
    x = torch.randn((len(slot_of_token), stack.a.shape[1]), dtype=torch.float64)
    before = torch.randn((len(slot_of_token), stack.b.shape[2]), dtype=torch.float64)
    out = before.clone()
    slots.step(slot_of_token).add(out, 0, group, x)
    adapter_in_slot = {slot: a for a in adapters for aid, slot in slot_of.items() if aid == a.adapter_id}
    for token, slot in enumerate(slot_of_token):
        expected = before[token].clone()
        for j, target in enumerate(targets):
            pair = adapter_in_slot[slot].weights.get((0, target)) if slot >= 0 else None
            if pair is not None:
                a, b = (w.double() for w in pair)
                start = stack.out_offsets[j]
                expected[start:start + b.shape[0]] += x[token] @ a.t() @ b.t()
        torch.testing.assert_close(out[token], expected, rtol=1e-9, atol=1e-9)
        if slot < 0:
            assert torch.equal(out[token], before[token])


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_adapter_requests_speculate_and_keep_their_merged_models_greedy_tokens(base, two_adapters, tmp_path,
                                                                               method):
    """Speculation serves adapter requests: the drafts are verified by the
    target under the request's adapter. The draft model is the base model
    itself, so its drafts are the base's tokens: verifying them without the
    adapter would accept every one and answer the base's tokens."""
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    if method == "draft_model":
        base.save_pretrained(tmp_path, safe_serialization=True)
        word_tokenizer()._backend.save(str(tmp_path / "tokenizer.json"))
        spec["model"] = str(tmp_path)
    engine = lora_engine(base, max_loras=2, speculative_config=spec)
    ids = [engine.load_lora_adapter(f"a{i}", str(folder)).adapter_id for i, (folder, _) in enumerate(two_adapters)]
    half = random_prompts([12], seed=9)[0]
    prompt = half + half  # prompt lookup finds drafts
    requests = [engine.new_request(prompt, GREEDY, adapter_id=a) for a in (ids[0], None, ids[1])]
    for request in requests:
        engine.add_request(request)
    final, num_draft_tokens = {}, 0
    while engine.has_unfinished():
        result = engine.step()
        num_draft_tokens += result.spec_decode.num_draft_tokens if result.spec_decode else 0
        final.update((o.request_id, o.token_ids) for o in result.outputs if o.finished)
    expected = [hf_greedy(two_adapters[0][1], prompt, MAX_NEW_TOKENS), hf_greedy(base, prompt, MAX_NEW_TOKENS),
                hf_greedy(two_adapters[1][1], prompt, MAX_NEW_TOKENS)]
    assert [final[r.request_id] for r in requests] == expected
    assert num_draft_tokens > 0
