"""`kvserve bench` end to end against the scripted fake server."""

from __future__ import annotations

import argparse
import json

import pytest

from kvserve import cli
from kvserve.bench import cli as bench_cli
from tests.fake_openai_server import FakeOpenAIServer, Script, serve_in_thread

PACED = Script(chunks=((0.02, 1), (0.01, 1), (0.01, 1)))


@pytest.fixture
def server():
    with serve_in_thread(FakeOpenAIServer(PACED)) as srv:
        yield srv


def _bench(server, tmp_path, *flags) -> int:
    return cli.main(["bench", "--base-url", server.base_url + "/v1", "--model", "fake",
                     "--out", str(tmp_path), "--no-progress", "--metrics-interval", "0.2",
                     *flags])


def test_open_loop_run_writes_report_with_tenants_priorities_and_cost(server, tmp_path, capsys):
    rc = _bench(server, tmp_path, "--workload", "short", "--rate", "40", "--num-requests", "24",
                "--tenants", "alice:1,bob:1", "--api-keys", "alice=key-a,bob=key-b",
                "--priorities", "0:1,2:1", "--price-per-hour", "3.6", "--slo", "ttft=1,tpot=0.5")
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.html").stat().st_size > 1000
    assert report["summary"]["outcomes"]["success"] == 24
    assert set(report["by_tenant"]) == {"alice", "bob"}
    assert set(report["by_priority"]) == {"0", "2"}
    assert report["summary"]["cost_total"] > 0
    assert report["config"]["model"] == "fake"
    assert "key-a" not in (tmp_path / "report.json").read_text()  # keys never written
    sent = {r["index"]: r for r in report["requests"]}
    for received in server.received:
        spec = sent[received["index"]]
        key = {"alice": "key-a", "bob": "key-b"}[spec["tenant"]]
        assert received["headers"]["Authorization"] == f"Bearer {key}"
        assert received["body"]["priority"] == spec["priority"]
        assert received["body"]["model"] == "fake"
    assert "ttft" in capsys.readouterr().out


def test_chat_endpoint_and_cancellations(server, tmp_path):
    rc = _bench(server, tmp_path, "--endpoint", "chat", "--workload", "short", "--rate", "50",
                "--num-requests", "20", "--cancel-rate", "0.5", "--cancel-after", "0.0,0.01")
    assert rc == 0
    outcomes = json.loads((tmp_path / "report.json").read_text())["summary"]["outcomes"]
    assert outcomes["cancelled"] >= 3 and outcomes["success"] >= 3
    assert outcomes["cancelled"] + outcomes["success"] == 20
    assert all("messages" in r["body"] for r in server.received)


def test_trace_replay_keeps_the_trace_offsets(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    stamps = [100.0, 100.3, 101.0, 101.05]
    trace.write_text("\n".join(json.dumps({"timestamp": t, "input_tokens": 12, "output_tokens": 3})
                               for t in stamps))
    assert _bench(server, tmp_path / "out", "--trace", str(trace)) == 0
    requests = json.loads((tmp_path / "out" / "report.json").read_text())["requests"]
    assert [r["scheduled_s"] for r in requests] == pytest.approx([0.0, 0.3, 1.0, 1.05])
    # Sent at or after its offset (how much after is the machine's moment,
    # reported as schedule lag), and they reached the server in trace order.
    assert all(r["sent_s"] >= r["scheduled_s"] for r in requests)
    arrived = [r["index"] for r in sorted(server.received, key=lambda r: r["t"])]
    assert arrived == [r["index"] for r in sorted(requests, key=lambda r: r["scheduled_s"])]


def test_closed_loop_keeps_concurrency(server, tmp_path):
    assert _bench(server, tmp_path, "--concurrency", "2", "--num-requests", "8",
                  "--workload", "short") == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["outcomes"]["success"] == 8
    assert server.max_running == 2
    assert report["client"]["max_in_flight"] == 2


def test_sweep_writes_capacity_and_points(server, tmp_path, capsys):
    assert _bench(server, tmp_path, "--sweep", "--sweep-max-runs", "2", "--sweep-start-rate", "20",
                  "--num-requests", "6", "--workload", "short") == 0
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["rate_per_s"] for p in sweep["points"]] == [20.0, 40.0]
    assert sweep["max_sustainable_rate_per_s"] == 40.0
    assert (tmp_path / "rate_20" / "report.json").exists()
    assert "max sustainable rate" in capsys.readouterr().out
    # Each rate sends prompts of its own: a server's prefix cache cannot carry one run's into the next.
    prompts = {}
    for record in server.received:
        body = record["body"]
        prompts.setdefault(record["index"], []).append(
            body.get("prompt") or json.dumps(body.get("messages")))
    assert all(len(texts) == 2 and texts[0] != texts[1] for texts in prompts.values()), prompts


def test_prompts_of_a_new_run_keep_their_shared_prefix():
    from kvserve.bench.prompts import PromptBuilder
    from kvserve.bench.workload import PrefixGroup, RequestSpec

    base = PromptBuilder(seed=3)
    spec = RequestSpec(index=0, prompt_tokens=40, output_tokens=4, prefix_group=PrefixGroup(1, 20))
    first, again, other = base.build(spec), base.for_run("rate 2").build(spec), base.for_run("rate 4").build(spec)
    assert first == base.build(spec) and again == base.for_run("rate 2").build(spec)  # deterministic
    assert len({first, again, other}) == 3
    prefix = base.build(spec).split()[:20]
    assert again.split()[:20] == prefix == other.split()[:20]


@pytest.mark.parametrize("flags, message", [
    (["--slo", "fast"], "bad SLO"),
    (["--arrival", "wavy"], "unknown arrival"),
    (["--workload", "nope"], "unknown workload"),
    (["--concurrency", "2", "--arrival", "poisson"], "closed loop"),
    (["--num-requests", "0"], "num-requests"),
    (["--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer file not found"),
])
def test_bad_flags_exit_2_with_a_clear_message(server, tmp_path, capsys, flags, message):
    assert _bench(server, tmp_path, *flags) == 2
    assert message in capsys.readouterr().err
    assert server.received == []


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    for action in parser._actions:
        assert action.help, action.option_strings
    for flag in ("--base-url", "--model", "--spawn", "--workload", "--arrival", "--rate",
                 "--concurrency", "--num-requests", "--duration", "--slo", "--price-per-hour",
                 "--seed", "--out", "--retries", "--timeout", "--tokenizer", "--trace",
                 "--cancel-rate", "--sweep", "--api-key", "--api-keys", "--endpoint"):
        assert flag in parser._option_string_actions, flag


def test_retries_flag_honours_retry_after(tmp_path):
    def script(index, attempt):
        return Script(status=429, retry_after="0", error_code="kv_cache") if attempt == 0 else PACED

    with serve_in_thread(FakeOpenAIServer(script)) as server:
        assert _bench(server, tmp_path, "--workload", "short", "--rate", "50",
                      "--num-requests", "5", "--retries", "2") == 0
        retried = [r for r in server.received if r["attempt"] == 1]
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["outcomes"]["success"] == 5 and summary["retries"] == 5
    assert all(r["headers"]["x-kvserve-retry"] == "1" for r in retried) and len(retried) == 5


def test_prefix_groups_send_identical_prefixes(server, tmp_path):
    assert _bench(server, tmp_path, "--workload", "prompt=fixed:30;output=fixed:2",
                  "--prefix-groups", "1", "--prefix-tokens", "20", "--prefix-share", "1.0",
                  "--rate", "50", "--num-requests", "4") == 0
    prompts = [r["body"]["prompt"].split() for r in server.received]
    assert all(p[:20] == prompts[0][:20] for p in prompts)
    assert len({tuple(p[20:]) for p in prompts}) == 4  # each has its own suffix


def test_closed_loop_duration_stops_sending(server, tmp_path):
    assert _bench(server, tmp_path, "--concurrency", "3", "--duration", "0.5",
                  "--workload", "short") == 0
    requests = json.loads((tmp_path / "report.json").read_text())["requests"]
    assert len(requests) >= 3
    # Decided inside the duration (sent a moment later on a loaded machine).
    assert all(0 <= r["scheduled_s"] < 0.5 for r in requests)
    assert all(r["sent_s"] >= r["scheduled_s"] for r in requests)


def test_progress_into_a_log_prints_whole_lines(server, tmp_path, capsys, monkeypatch):
    from kvserve.bench import client

    monkeypatch.setattr(client, "PROGRESS_LOG_PERIOD_S", 0.05)
    rc = cli.main(["bench", "--base-url", server.base_url + "/v1", "--model", "fake", "--out", str(tmp_path),
                   "--metrics-interval", "0.2", "--workload", "short", "--rate", "20", "--num-requests", "10"])
    assert rc == 0
    err = capsys.readouterr().err  # captured: not a terminal
    lines = [line for line in err.splitlines() if " in flight, " in line]
    assert len(lines) >= 3, err
    assert "\r" not in err
    assert lines[-1].startswith("[##############################] 10/10 done")
