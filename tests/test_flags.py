"""The flags serve, simulate, profile and generate share: one definition and
one default each, stated in --help, mapping to the same configs."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from kvserve.cli import main
from kvserve.config import AdmissionConfig, parse_size

ADMISSION_ARGV = ["--ttft-slo", "1.5", "--tpot-slo", "0.05", "--max-queue-wait", "0.5",
                  "--deferred-max-queue-wait", "4", "--queue-timeout", "7", "--max-queue-len", "9",
                  "--default-max-tokens", "33", "--strict", "--retry-budget", "0.2", "--degrade-wait", "0.3",
                  "--degrade-max-tokens", "12"]


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def _parser(module) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser


@pytest.mark.parametrize("command", ["serve", "profile", "generate"])
def test_kv_cache_memory_has_one_default_stated_in_help(capsys, command):
    text = _help(capsys, command)
    assert re.search(r"--kv-cache-memory KV_CACHE_MEMORY KV cache size in bytes with a unit "
                     r"\(e\.g\. 512MiB, 2GiB\); with a speculative draft model, both models' caches "
                     r"\(as many blocks each, split by bytes per block\) \(default: 1GiB\)", text), text


def test_the_engine_and_offline_api_default_to_the_same_kv_cache():
    from kvserve.engine.core import EngineConfig
    from kvserve.engine.llm import LLM

    assert EngineConfig().kv_cache_memory_bytes == EngineConfig.from_sizes().kv_cache_memory_bytes \
        == parse_size("1GiB")
    assert parse_size(inspect.signature(LLM).parameters["kv_cache_memory"].default) == parse_size("1GiB")


def test_simulate_states_where_its_cache_size_comes_from(capsys):
    text = _help(capsys, "simulate")
    assert "default: the cache of the engine a profile JSON measured, else the hardware's memory" in text
    assert "--enforce-eager" in text and "no effect on a simulation" in text


def test_serve_and_simulate_map_admission_flags_to_the_same_config():
    from kvserve.server import cli as serve_cli
    from kvserve.sim import cli as sim_cli
    from kvserve import flags

    serve_args = _parser(serve_cli).parse_args(ADMISSION_ARGV)
    sim_args = _parser(sim_cli).parse_args(["--preset", "llama-3.1-8b", *ADMISSION_ARGV])
    admission, _ = serve_cli.configs(serve_args, "m")
    assert flags.admission_config(sim_args) == admission
    assert (admission.ttft_slo_s, admission.deferred_max_queue_wait_s, admission.require_max_tokens) \
        == (1.5, 4.0, True)
    # Unset, both take AdmissionConfig's own defaults.
    assert serve_cli.configs(_parser(serve_cli).parse_args([]), "m")[0] == AdmissionConfig() \
        == flags.admission_config(_parser(sim_cli).parse_args(["--preset", "llama-3.1-8b"]))


@pytest.mark.parametrize("command", ["serve", "simulate", "profile", "generate"])
def test_shared_engine_flags_keep_their_names_and_defaults(command):
    import importlib

    from kvserve.cli import SUBCOMMANDS

    parser = _parser(importlib.import_module(SUBCOMMANDS[command][0]))
    args = parser.parse_args(["prompt"] if command == "generate" else
                             ["--preset", "smollm2-135m"] if command == "simulate" else [])
    assert (args.block_size, args.max_num_seqs, args.max_num_batched_tokens) == (16, 64, 512)
    assert args.max_model_len is None and args.no_prefix_caching is False and args.enforce_eager is False
    assert args.kv_cache_memory == (None if command == "simulate" else "1GiB")


def test_generate_passes_the_engine_flags_to_the_offline_engine(monkeypatch, capsys):
    from kvserve.engine import llm as llm_module

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            raise ValueError("stop here")

    monkeypatch.setattr(llm_module, "LLM", FakeLLM)
    assert main(["generate", "hi", "--kv-cache-memory", "4MiB", "--block-size", "8", "--max-num-seqs", "3",
                 "--no-prefix-caching", "--dtype", "bfloat16"]) == 2
    assert "stop here" in capsys.readouterr().err
    assert (seen["kv_cache_memory"], seen["block_size"], seen["max_num_seqs"]) == ("4MiB", 8, 3)
    assert seen["enable_prefix_caching"] is False and seen["dtype"] == "bfloat16"
