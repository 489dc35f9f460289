"""`kvserve serve` flags: the issue's names exist, map onto the configs, and
every flag says its unit or meaning."""

from __future__ import annotations

import argparse

import pytest

from kvserve.server import cli

ISSUE_FLAGS = ["--model", "--host", "--port", "--dtype", "--kv-cache-memory", "--block-size", "--max-num-seqs",
               "--max-num-batched-tokens", "--max-queue-len", "--max-queue-wait", "--queue-timeout",
               "--default-max-tokens", "--require-max-tokens", "--ttft-slo", "--tpot-slo", "--api-keys",
               "--retry-budget", "--served-model-name", "--stream-stall-timeout", "--degrade-max-tokens",
               "--degrade-wait", "--strict", "--shutdown-grace"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p


def test_issue_flags_exist_with_help():
    p = parser()
    known = {opt: action for action in p._actions for opt in action.option_strings}
    for flag in ISSUE_FLAGS:
        assert flag in known, flag
        assert known[flag].help and len(known[flag].help) > 10, flag


def test_flags_map_onto_configs_and_default_to_loopback():
    args = parser().parse_args(["--max-queue-wait", "0.5", "--queue-timeout", "7", "--max-queue-len", "9",
                                "--default-max-tokens", "33", "--strict", "--ttft-slo", "1.5",
                                "--tpot-slo", "0.05", "--retry-budget", "0.2", "--degrade-wait", "0.3",
                                "--degrade-max-tokens", "12", "--stream-stall-timeout", "4"])
    admission, server = cli.configs(args, "m")
    assert (admission.max_queue_wait_s, admission.queue_timeout_s, admission.max_queue_len) == (0.5, 7, 9)
    assert (admission.default_max_tokens, admission.require_max_tokens) == (33, True)
    assert (admission.ttft_slo_s, admission.tpot_slo_s, admission.retry_budget) == (1.5, 0.05, 0.2)
    assert (admission.degrade_wait_s, admission.degrade_max_tokens) == (0.3, 12)
    assert server.host == "127.0.0.1" and server.stream_stall_timeout_s == 4


def test_bad_values_are_refused_with_a_message():
    args = parser().parse_args(["--max-queue-wait", "-1"])
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        cli.configs(args, "m")
    assert cli.run(parser().parse_args(["--api-keys", "/nonexistent/keys.json"])) == 2


def test_warm_up_is_on_by_default_and_can_be_disabled():
    _, server = cli.configs(parser().parse_args([]), "m")
    assert server.warm_up is True
    _, server = cli.configs(parser().parse_args(["--no-warm-up"]), "m")
    assert server.warm_up is False
    help_text = parser().format_help()
    assert "--no-warm-up" in help_text and "seconds" in help_text
