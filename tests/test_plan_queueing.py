"""Kingman / Allen-Cunneen against exact M/M/1, M/D/1 and M/M/c results."""

import math

import pytest

from kvserve.plan import queueing


@pytest.mark.parametrize("lam,mu", [(0.5, 1.0), (3.0, 4.0), (9.5, 10.0), (0.01, 2.0)])
def test_kingman_is_exact_for_mm1(lam, mu):
    rho = lam / mu
    # M/M/1: Wq = rho / (mu - lambda).
    assert queueing.kingman_wait_s(rho, 1 / mu, arrival_cv=1, service_cv=1) == pytest.approx(rho / (mu - lam))


@pytest.mark.parametrize("lam,mu", [(0.5, 1.0), (3.0, 4.0), (9.5, 10.0)])
def test_kingman_is_exact_for_md1(lam, mu):
    rho = lam / mu
    # M/D/1 (Pollaczek-Khinchine with zero service variance): Wq = rho / (2 mu (1 - rho)).
    assert queueing.kingman_wait_s(rho, 1 / mu, arrival_cv=1, service_cv=0) == pytest.approx(
        rho / (2 * mu * (1 - rho)))


def test_service_variance_dominates_the_tail_at_the_same_utilization():
    # At 70% utilization, service times with cv 4 wait 8.5x longer than cv 1 (17/2 vs 2/2).
    calm = queueing.kingman_wait_s(0.7, 1.0, 1.0, 1.0)
    spread = queueing.kingman_wait_s(0.7, 1.0, 1.0, 4.0)
    assert spread / calm == pytest.approx(8.5)


def test_allen_cunneen_is_exact_for_mmc():
    # M/M/2 with lambda = 1, mu = 1 (a = 1, rho = 0.5): P(wait) = 1/3,
    # Wq = P(wait) / (c mu - lambda) = 1/3.
    assert queueing.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert queueing.allen_cunneen_wait_s(2, 0.5, 1.0) == pytest.approx(1 / 3)
    # c = 1 reduces to Kingman.
    assert queueing.allen_cunneen_wait_s(1, 0.6, 2.0, 0.5, 2.0) == pytest.approx(
        queueing.kingman_wait_s(0.6, 2.0, 0.5, 2.0))


def test_erlang_c_is_stable_for_large_fleets():
    p = queueing.erlang_c(2000, 1900.0)
    assert 0.0 < p < 1.0 and math.isfinite(p)


def test_replicas_respect_headroom():
    # 100 req/s x 2 s = 200 busy slots; 64 slots each at <= 75% -> 48 per replica -> 5 replicas.
    plan = queueing.replicas_for_rate(100, 2.0, 64, headroom=0.75)
    assert plan.num_replicas == 5
    assert plan.utilization == pytest.approx(200 / 320)
    tighter = queueing.replicas_for_rate(100, 2.0, 64, headroom=0.5)
    assert tighter.num_replicas == 7


def test_unstable_or_bad_inputs_raise():
    with pytest.raises(ValueError):
        queueing.kingman_wait_s(1.0, 1.0)
    with pytest.raises(ValueError):
        queueing.replicas_for_rate(10, 1.0, 4, headroom=1.2)
