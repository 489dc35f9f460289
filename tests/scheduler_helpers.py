"""Drive the real scheduler without a model: a fake clock and a fixed sampled token."""

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.contract import Request, SamplingParams
from kvserve.scheduler.scheduler import Scheduler

EOS = 0
NON_EOS = 7


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_model_len=4096,
                   prefix_caching=True, aging_s=10.0, clock=None):
    clock = clock or FakeClock()
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                        max_model_len=max_model_len, aging_s_per_priority=aging_s),
        CacheConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching),
        clock=clock)
    return sched, clock


def make_request(rid, num_prompt=8, max_tokens=4, priority=0, tenant="default", arrival=0.0,
                 first_token=1, **params):
    return Request(rid, list(range(first_token, first_token + num_prompt)),
                   SamplingParams(max_tokens=max_tokens, **params), arrival_time=arrival,
                   eos_token_ids=(EOS,), priority=priority, tenant=tenant)


def step(sched, clock=None, token=NON_EOS, dt=0.01):
    """One schedule + update, sampling `token` for every sampling chunk."""
    out = sched.schedule()
    if clock is not None:
        clock.now += dt
    sched.update(out, {c.request.request_id: token for c in out.chunks if c.samples})
    return out
