"""Arrival processes: seeded, with the right rate and burstiness.

Tolerances: with n gaps, the sample mean of exponential gaps has a relative
standard error of 1/sqrt(n); n = 20000 gives 0.7%, so a 3% band is > 4 sigma.
The sample CV^2 converges more slowly (heavier tails for gamma), hence 10%
bands with n = 50000. Counts: a Poisson count N has standard deviation
sqrt(N); every count band below is at least 2.7 sigma wide. All draws are
seeded, so the tests are deterministic; the bands say how wrong a generator
could be and still pass.
"""

from __future__ import annotations

import statistics

import pytest

from kvserve.bench.arrivals import ArrivalSpec, arrival_offsets, parse_arrival


def _gaps(offsets):
    return [b - a for a, b in zip([0.0] + offsets[:-1], offsets)]


def _cv2(gaps):
    mean = statistics.fmean(gaps)
    return statistics.pvariance(gaps) / mean**2


def test_constant_rate_is_exact():
    offsets = arrival_offsets(parse_arrival("constant", 4.0), num_requests=5)
    assert offsets == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_poisson_rate_and_cv():
    gaps = _gaps(arrival_offsets(parse_arrival("poisson", 5.0), num_requests=20000, seed=3))
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert _cv2(gaps) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_is_cv_squared(burstiness):
    spec = parse_arrival(f"gamma:burstiness={burstiness}", 10.0)
    gaps = _gaps(arrival_offsets(spec, num_requests=50000, seed=7))
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert _cv2(gaps) == pytest.approx(burstiness, rel=0.1)


def test_seeded_and_deterministic():
    spec = parse_arrival("poisson", 2.0)
    assert arrival_offsets(spec, 50, seed=1) == arrival_offsets(spec, 50, seed=1)
    assert arrival_offsets(spec, 50, seed=1) != arrival_offsets(spec, 50, seed=2)


def test_duration_bound_and_count_bound():
    spec = parse_arrival("poisson", 50.0)
    within = arrival_offsets(spec, duration_s=10.0, seed=0)
    assert max(within) < 10.0
    assert len(within) == pytest.approx(500, rel=0.15)
    assert len(arrival_offsets(spec, num_requests=7, duration_s=100.0)) == 7
    assert all(b >= a for a, b in zip(within, within[1:]))


def test_diurnal_peak_half_gets_more_arrivals():
    # rate(t) = 20 (1 + 0.5 sin(2 pi t / 100)): the first half-period holds
    # 20 x (50 + 50/pi x 0.5 x 2) ~ 1318 arrivals, the second ~ 682.
    spec = parse_arrival("diurnal:period=100,amplitude=0.5", 20.0)
    offsets = arrival_offsets(spec, duration_s=100.0, seed=5)
    first = sum(o < 50 for o in offsets)
    second = len(offsets) - first
    assert first == pytest.approx(1318, rel=0.1)
    assert second == pytest.approx(682, rel=0.12)


def test_diurnal_rate_curve():
    # Multipliers 0.5 and 2 at t = 0 and 50 s of a 100 s period, linear in
    # between: mean multiplier 1.25, so 20 req/s x 1.25 x 200 s = 5000.
    spec = parse_arrival("diurnal:period=100,curve=0.5/2", 20.0)
    offsets = arrival_offsets(spec, duration_s=200.0, seed=8)
    assert len(offsets) == pytest.approx(5000, rel=0.05)
    # Mean multiplier around the peak (40-60 s) is 1.85, around the trough
    # (90-110 s) 0.65.
    peak = sum(40 <= o % 100 < 60 for o in offsets)
    trough = sum(o % 100 >= 90 or o % 100 < 10 for o in offsets)
    assert peak / trough == pytest.approx(1.85 / 0.65, rel=0.12)


def test_step_rates():
    spec = parse_arrival("step:rates=5/20,step=100")
    offsets = arrival_offsets(spec, duration_s=200.0, seed=2)
    assert sum(o < 100 for o in offsets) == pytest.approx(500, rel=0.12)
    assert sum(o >= 100 for o in offsets) == pytest.approx(2000, rel=0.08)


def test_ramp_rises_linearly():
    spec = parse_arrival("ramp:start=0,end=40,duration=100")
    offsets = arrival_offsets(spec, duration_s=100.0, seed=4)
    assert len(offsets) == pytest.approx(2000, rel=0.08)  # mean rate 20/s over 100 s
    # The last quarter holds 7/16 of the arrivals, the first 1/16.
    assert sum(o >= 75 for o in offsets) == pytest.approx(875, rel=0.1)
    assert sum(o < 25 for o in offsets) == pytest.approx(125, rel=0.25)


@pytest.mark.parametrize("text, rate, message", [
    ("poisson", None, "--rate"),
    ("gamma:burstiness=0", 1.0, "burstiness"),
    ("wavy", 1.0, "unknown arrival"),
    ("step:step=10", None, "rates="),
    ("gamma:burstiness", 1.0, "key=number"),
])
def test_bad_specs_are_clear_errors(text, rate, message):
    with pytest.raises(ValueError, match=message):
        parse_arrival(text, rate)


def test_open_loop_needs_a_bound_and_closed_has_no_offsets():
    with pytest.raises(ValueError, match="num_requests or duration"):
        arrival_offsets(parse_arrival("poisson", 1.0))
    with pytest.raises(ValueError, match="no generated offsets"):
        arrival_offsets(ArrivalSpec("closed"), 5)
    with pytest.raises(ValueError, match="rate 0"):
        arrival_offsets(parse_arrival("step:rates=5/0,step=1"), num_requests=100)
