"""EngineCore, the offline LLM API and `kvserve generate` on a tiny random model."""

import pytest
import torch

from kvserve.cli import main as kvserve_main
from kvserve.contract import SamplingParams
from tests.tiny_models import hf_greedy, random_prompts, run_to_completion, tiny_engine, tiny_llama


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(seed=3)


def test_prompt_longer_than_the_context_is_refused_and_the_engine_still_works(hf):
    engine = tiny_engine(hf, max_model_len=64)
    with pytest.raises(ValueError, match="context is 64 tokens"):
        engine.add_request(engine.new_request([1] * 64, SamplingParams()))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request(engine.new_request([1, 256], SamplingParams()))
    assert not engine.has_unfinished()
    prompt = random_prompts([10], seed=1)[0]
    (out,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=5)).values()
    assert out.token_ids == hf_greedy(hf, prompt, 5)


def test_output_is_clamped_at_max_model_len(hf):
    engine = tiny_engine(hf, max_model_len=32)
    (out,) = run_to_completion(engine, [list(range(1, 29))], SamplingParams(max_tokens=50)).values()
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == 32


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(hf):
    prompt = random_prompts([12], seed=2)[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    alone = run_to_completion(tiny_engine(hf, seed=0), [prompt], seeded)
    engine = tiny_engine(hf, seed=99)
    others = [engine.new_request(p, SamplingParams(max_tokens=15, temperature=1.0))
              for p in random_prompts([3, 30, 7], seed=3)]
    for request in others:
        engine.add_request(request)
    engine.step()  # the seeded request joins a batch already running
    together = run_to_completion(engine, [prompt], seeded)
    assert list(together.values())[0].token_ids == list(alone.values())[0].token_ids
    # ...and the seed matters: a different one gives different tokens.
    other_seed = run_to_completion(tiny_engine(hf), [prompt],
                                   SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=4321))
    assert list(other_seed.values())[0].token_ids != list(alone.values())[0].token_ids


def test_stream_deltas_add_up_to_the_final_output(hf):
    engine = tiny_engine(hf, clock=FakeClock())
    request = engine.new_request(random_prompts([9], seed=4)[0], SamplingParams(max_tokens=8, logprobs=2))
    engine.add_request(request)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step().outputs
    final = deltas[-1]
    assert final.finished and final.finish_reason == "length"
    assert [t for d in deltas for t in d.new_token_ids] == final.token_ids
    assert "".join(d.new_text for d in deltas) == final.text
    # Word-level decoding in context puts a space between the prompt and the output.
    assert final.text.split() == engine.tokenizer.decode(final.token_ids).split()
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    assert all(len(lp.top) == 2 for lp in final.logprobs)
    latency = final.latency
    assert latency.num_output_tokens == 8
    assert latency.ttft_s > 0 and latency.tpot_s > 0 and latency.e2e_s >= latency.ttft_s


def test_stop_string_ends_the_text_before_it(hf):
    prompt = random_prompts([6], seed=5)[0]
    engine = tiny_engine(hf)
    (plain,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=10)).values()
    words = plain.text.split()
    stop = " " + words[4]  # the fifth generated word, with the space before it
    (stopped,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=10, stop=stop)).values()
    assert stopped.finish_reason == "stop"
    assert stopped.text == plain.text[:plain.text.index(stop)]
    assert len(stopped.token_ids) < len(plain.token_ids)
    # The stop string completing on the last allowed token still reports "stop".
    (at_limit,) = run_to_completion(engine, [prompt], SamplingParams(max_tokens=5, stop=stop)).values()
    assert at_limit.finish_reason == "stop" and at_limit.text == stopped.text
    assert not engine.has_unfinished() and engine.scheduler.stats().kv_usage == 0


def test_abort_finishes_the_request_and_frees_its_blocks(hf):
    engine = tiny_engine(hf)
    request = engine.new_request(random_prompts([20], seed=6)[0], SamplingParams(max_tokens=50))
    engine.add_request(request)
    engine.step()
    engine.step()
    assert engine.scheduler.stats().kv_usage > 0
    out = engine.abort(request.request_id)
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 2
    assert not engine.has_unfinished() and engine.scheduler.stats().kv_usage == 0
    assert engine.abort(request.request_id) is None
    assert engine.step().outputs == []


@pytest.fixture(scope="module")
def tiny_folder(hf, tmp_path_factory):
    """The tiny model saved as a Hugging Face folder with a word-level tokenizer."""
    from tests.tiny_models import word_tokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder, safe_serialization=True)
    word_tokenizer()._backend.save(str(folder / "tokenizer.json"))
    return folder


def test_llm_generate_over_strings_and_token_ids_in_input_order(hf, tiny_folder):
    from kvserve import LLM

    llm = LLM(model=str(tiny_folder), kv_cache_memory="4MiB", device="cpu")
    prompts = ["t5 t9 t200 t17", [3, 1, 4, 1, 5, 9, 2, 6], "t42"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    expected_ids = [[5, 9, 200, 17], [3, 1, 4, 1, 5, 9, 2, 6], [42]]
    assert [o.prompt_token_ids for o in outputs] == expected_ids
    for ids, output in zip(expected_ids, outputs):
        assert output.token_ids == hf_greedy(hf, ids, 6)
    single = llm.generate([7, 8, 9], [SamplingParams(max_tokens=3, ignore_eos=True)])
    assert len(single) == 1 and single[0].prompt_token_ids == [7, 8, 9]
    with pytest.raises(ValueError):
        llm.generate(["t1", "t2"], [SamplingParams()])  # one params per prompt, or one for all
    with pytest.raises(ValueError):
        llm.generate(["t1", [1] * 600])  # the second cannot fit: nothing stays queued
    assert not llm.engine.has_unfinished()


def test_kvserve_generate_prints_the_completion(hf, tiny_folder, capsys):
    code = kvserve_main(["generate", "t5 t9 t200", "--model", str(tiny_folder), "--max-tokens", "4",
                         "--kv-cache-memory", "4MiB", "--device", "cpu"])
    assert code == 0
    expected = hf_greedy(hf, [5, 9, 200], 4)
    assert capsys.readouterr().out.split() == [f"t{t}" for t in expected]


def test_bad_sampling_flag_is_an_error_message_not_a_traceback(tiny_folder, capsys):
    code = kvserve_main(["generate", "t1", "--model", str(tiny_folder), "--top-p", "0"])
    assert code == 2
    assert "top_p" in capsys.readouterr().err


def test_runner_sizes_the_cache_from_memory(hf):
    engine = tiny_engine(hf, num_blocks=37)
    assert engine.runner.num_blocks == 37
    assert engine.scheduler.kv_cache.num_blocks == 37
    with pytest.raises(ValueError, match="holds no block"):
        tiny_engine(hf, num_blocks=0)
    assert torch.get_default_dtype() == torch.float32


def test_llm_chat_renders_the_chat_template(tiny_folder):
    import json

    from kvserve import LLM

    template = ("{% for m in messages %}t1 {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}t2{% endif %}")
    (tiny_folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    try:
        llm = LLM(model=str(tiny_folder), kv_cache_memory="4MiB", device="cpu")
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        (one,) = llm.chat([{"role": "user", "content": "t5 t6"}], params)
        assert one.prompt_token_ids == [1, 5, 6, 2]
        many = llm.chat([[{"role": "user", "content": "t7"}], [{"role": "user", "content": "t8 t9"}]], params)
        assert [o.prompt_token_ids for o in many] == [[1, 7, 2], [1, 8, 9, 2]]
        assert all(len(o.token_ids) == 3 for o in many)
    finally:
        (tiny_folder / "tokenizer_config.json").unlink()


def test_bfloat16_engine_tracks_float32_logits(hf):
    prompt = random_prompts([16], seed=8)[0]
    params = SamplingParams(max_tokens=1, logprobs=5)
    (f32,) = run_to_completion(tiny_engine(hf), [prompt], params).values()
    (bf16,) = run_to_completion(tiny_engine(hf, dtype="bfloat16"), [prompt], params).values()
    reference = dict(f32.logprobs[0].top)
    assert bf16.token_ids == f32.token_ids
    for token_id, value in bf16.logprobs[0].top[:3]:
        assert abs(value - reference[token_id]) < 0.1


def test_a_step_returns_what_it_ran_started_and_finished(hf):
    engine = tiny_engine(hf, max_num_batched_tokens=16)
    long, short = (engine.new_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
                   for p, n in zip(random_prompts([20, 3], seed=9), (3, 1)))
    engine.add_request(long)
    engine.add_request(short)
    first = engine.step()  # 16 tokens of the long prompt; the short one waits for room
    assert (first.started_ids, first.num_prefill_tokens, first.num_decode_seqs) == ([long.request_id], 16, 0)
    assert first.outputs == [] and first.finished_ids == [] and first.captured_graph is False
    second = engine.step()  # the rest of the long prompt (its first token) and the whole short one
    assert second.started_ids == [short.request_id] and second.num_prefill_tokens == 4 + 3
    assert second.finished_ids == [short.request_id]  # max_tokens=1
    assert [o.request_id for o in second.outputs] == [long.request_id, short.request_id]
    third = engine.step()
    assert (third.started_ids, third.num_decode_seqs, third.num_prefill_tokens) == ([], 1, 0)
    assert [c.request for c in third.scheduled.chunks] == [long] and third.finished_ids == []
