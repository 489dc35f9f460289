"""Admission keeps its word, on a live server whose steps are slowed to a
known time: under a burst, the requests it admits start within 1.5 x the
wait limit and get their first token inside the TTFT target; it exports
each prediction beside the outcome; refusals say a positive limit."""

from __future__ import annotations

import re

from tests.load_helpers import body, metric, run_clients, scrape, stream_one, warm_up
from tests.server_helpers import live_server, slow_steps, tiny_core

MAX_QUEUE_WAIT_S = 1.0
TTFT_TARGET_S = 2.0


def test_under_a_burst_admitted_requests_wait_what_was_promised():
    core = slow_steps(tiny_core(num_blocks=64, max_num_seqs=8), 0.05)
    with live_server(core, max_queue_wait_s=MAX_QUEUE_WAIT_S, ttft_slo_s=TTFT_TARGET_S, tpot_slo_s=1.0) as srv:
        warm_up(srv.base_url, num_requests=4)
        waits: list[tuple[float, float]] = []
        record = srv.serving.metrics.record_queue_wait

        def recorded(predicted_s: float, actual_s: float) -> None:
            waits.append((predicted_s, actual_s))
            record(predicted_s, actual_s)
        srv.serving.metrics.record_queue_wait = recorded
        outs = run_clients(srv.base_url, lambda c: [stream_one(c, body(max_tokens=30)) for _ in range(40)],
                           timeout_s=120)
        samples = scrape(srv.base_url)
    admitted = [o for o in outs if o.status == 200]
    refused = [o for o in outs if o.status == 429]
    assert admitted and refused and len(admitted) + len(refused) == len(outs), [o.status for o in outs]
    assert len(waits) == len(admitted), (len(waits), len(admitted))
    assert max(actual for _, actual in waits) <= 1.5 * MAX_QUEUE_WAIT_S, sorted(waits, key=lambda w: w[1])[-5:]
    assert max(o.ttft_s for o in admitted) <= TTFT_TARGET_S, sorted(o.ttft_s for o in admitted)[-5:]
    # The prediction and its error are exported, one observation per admitted request of the burst.
    assert metric(samples, "kvserve_queue_wait_prediction_error_seconds_count") == len(admitted) + 4
    assert metric(samples, "kvserve_queue_wait_predicted_seconds_count") == len(admitted) + 4
    for o in refused:
        limits = [float(x) for x in re.findall(r"limit of ([0-9.]+) (m?s)", o.error["message"])[:1]
                  for x in x[:1]]
        assert limits and limits[0] > 0, o.error["message"]
