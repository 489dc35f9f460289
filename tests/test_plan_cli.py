"""`kvserve plan` through the real command-line entry point."""

import json

import pytest

from kvserve.cli import main
from kvserve.model_facts.default_model import default_model_path

GIB = 2**30


def run_json(capsys, *argv):
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_plan_json_has_capacity_table(capsys):
    rc, plan = run_json(capsys, "--preset", "llama-3.1-8b", "--memory", "80GiB",
                        "--reserve", "10%", "--context-lengths", "1024,8192,800:200")
    assert rc == 0
    assert plan["kv_bytes_per_token"] == 131072
    assert plan["weight_bytes"] == 2 * 8030261248
    assert plan["kv_cache_bytes"] == 80 * GIB - 8 * GIB - plan["weight_bytes"]
    assert plan["kv_capacity_tokens"] == plan["kv_cache_bytes"] // (131072 * 16) * 16
    rows = {r["total_tokens"]: r for r in plan["max_concurrency"]}
    assert rows[8192]["kv_bytes_per_sequence"] == GIB
    assert rows[8192]["max_concurrency"] == plan["kv_capacity_tokens"] // 8192
    assert rows[1024]["max_concurrency"] > rows[8192]["max_concurrency"]
    assert rows[1000]["prompt_tokens"] == 800


def test_plan_rate_shift_and_replicas(capsys):
    rc, plan = run_json(capsys, "--preset", "qwen2.5-7b", "--memory", "80GiB", "--rate", "40",
                        "--mean-service-s", "4", "--headroom", "0.75", "--shift", "800:6000")
    assert rc == 0
    shift = plan["context_shift"]
    assert shift["after"]["max_concurrency"] < shift["before"]["max_concurrency"]
    assert shift["kv_demand_tokens_after"] > 5 * shift["kv_demand_tokens_before"]
    rep = plan["replicas"]
    assert rep["utilization"] <= 0.75
    assert rep["num_replicas"] >= 40 * 4 / (rep["slots_per_replica"] * 0.75)
    assert "thinking tool" in plan["queueing"]["note"]


def test_plan_reads_a_gguf_model_config(capsys):
    gguf_file = default_model_path()  # installed by `make install`; a clear error otherwise
    rc, plan = run_json(capsys, "--model", str(gguf_file), "--memory", "1GiB")
    assert rc == 0
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dim x 2 x 2 bytes = 23,040 bytes per token.
    assert plan["kv_bytes_per_token"] == 23040
    # tensor bytes, without metadata, plus the bfloat16 prompt tiles where this CPU has AMX-BF16
    assert plan["weight_bytes"] - plan["prompt_tile_bytes"] < gguf_file.stat().st_size
    rc, plain = run_json(capsys, "--model", str(gguf_file), "--memory", "1GiB", "--prefill-weights", "none")
    assert plain["prompt_tile_bytes"] == 0 and plain["weight_bytes"] < gguf_file.stat().st_size
    rc, tiled = run_json(capsys, "--model", str(gguf_file), "--memory", "1GiB", "--prefill-weights", "bf16")
    # Every layer matrix once more at 2 bytes a weight: 30 x (960 + 576 + 3072 + 576 rows) x 576-1536 inputs.
    assert tiled["prompt_tile_bytes"] == 2 * 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    assert tiled["weight_bytes"] == plain["weight_bytes"] + tiled["prompt_tile_bytes"]
    # An int8 KV cache: 1 byte a value plus a float32 scale per 64 (`serve --kv-cache-dtype int8`); its
    # float fallback holds the cache in bfloat16 (only the quantized kernels read int8).
    rc, int8 = run_json(capsys, "--model", str(gguf_file), "--memory", "1GiB", "--kv-dtype", "int8")
    assert int8["kv_bytes_per_token"] == 30 * 3 * 2 * (64 + 4)
    assert int8["float_fallback"]["kv_dtype"] == "bfloat16" and plan["float_fallback"]["kv_dtype"] == "bfloat16"


def test_weights_that_do_not_fit_fail_clearly(capsys):
    rc = main(["plan", "--preset", "llama-3.1-70b", "--memory", "80GiB"])
    assert rc == 1
    assert "exceed memory" in capsys.readouterr().err
    rc, plan = run_json(capsys, "--preset", "llama-3.1-70b", "--memory", "80GiB",
                        "--num-devices", "2")
    assert rc == 0 and plan["kv_capacity_tokens"] > 0


def test_bad_input_is_an_error_not_a_traceback(capsys):
    assert main(["plan", "--preset", "nope", "--memory", "80GiB"]) == 2
    assert "known presets" in capsys.readouterr().err
    assert main(["plan", "--preset", "llama-3.1-8b", "--memory", "lots"]) == 2
    with pytest.raises(SystemExit):
        main(["plan", "--memory", "80GiB"])  # neither --preset nor --model


def test_plan_reads_a_hugging_face_folder_config(tmp_path, capsys):
    from .tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path)  # config.json + model.safetensors
    rc, plan = run_json(capsys, "--model", str(tmp_path), "--memory", "64MiB", "--reserve", "0%")
    assert rc == 0
    # 2 (K, V) x 2 layers x 2 KV heads x 16 head dim x 2 bytes = 256 bytes per token.
    assert plan["kv_bytes_per_token"] == 256
    weights = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert plan["weight_bytes"] == weights
    # Whole 16-token blocks of what is left after the weights: under one block to spare.
    left = 64 * 2**20 - weights
    assert plan["kv_capacity_tokens"] % 16 == 0
    assert left - 256 * 16 < plan["kv_capacity_tokens"] * 256 <= left


def test_plan_counts_a_draft_models_weights_and_kv_cache(tmp_path, capsys):
    """--speculative-config with a draft model: its weight file and its KV
    cache (as many blocks as the target's) come out of the same memory, so
    the capacity falls below half the target's alone; prompt lookup needs
    no memory; a draft that is not there is an error, not a traceback."""
    from .tiny_models import tiny_llama

    target, draft = tmp_path / "target", tmp_path / "draft"
    tiny_llama(seed=0).save_pretrained(target)
    tiny_llama(seed=1, tie_word_embeddings=True).save_pretrained(draft)  # a smaller file: no LM head of its own
    common = ("--model", str(target), "--memory", "64MiB", "--reserve", "0%")
    rc, alone = run_json(capsys, *common)
    assert rc == 0 and alone["draft_model"] is None
    rc, paired = run_json(capsys, *common, "--speculative-config",
                          json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}))
    assert rc == 0
    draft_file = sum(f.stat().st_size for f in draft.glob("*.safetensors"))
    assert paired["draft_model"]["weight_bytes"] == draft_file
    assert paired["weight_bytes"] == alone["weight_bytes"] + draft_file
    assert paired["draft_model"]["kv_bytes_per_token"] == 256  # the draft's shape is the target's
    assert paired["kv_bytes_per_token"] == 2 * 256
    left = 64 * 2**20 - paired["weight_bytes"]
    assert left - 512 * 16 < paired["kv_capacity_tokens"] * 512 <= left
    assert paired["kv_capacity_tokens"] < alone["kv_capacity_tokens"] // 2
    rows = zip(alone["max_concurrency"], paired["max_concurrency"])
    assert all(b["max_concurrency"] < a["max_concurrency"] for a, b in rows)
    rc, ngram = run_json(capsys, *common, "--speculative-config", '{"method": "ngram"}')
    assert rc == 0 and ngram["kv_capacity_tokens"] == alone["kv_capacity_tokens"]
    text_rc = main(["plan", *common, "--speculative-config",
                    json.dumps({"method": "draft_model", "model": str(draft)})])
    assert text_rc == 0 and "(draft model draft: " in capsys.readouterr().out
    missing_rc = main(["plan", *common, "--speculative-config",
                       json.dumps({"method": "draft_model", "model": str(tmp_path / "nowhere")})])
    err = capsys.readouterr().err
    assert missing_rc == 2 and "kvserve plan: error:" in err and "Traceback" not in err
