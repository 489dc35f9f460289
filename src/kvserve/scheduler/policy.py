"""The waiting queue's order: priority classes, aging, fair share across
tenants within a class, FCFS within a tenant.

- Lower priority number = more urgent. A waiting request's effective
  priority is `priority - wait_s / aging_s_per_priority`, so a batch request
  that has waited long enough overtakes fresh interactive ones: nothing starves.
  A class competes with the effective priority of its longest-waiting member,
  so fair sharing inside a class never lets another class pass it early.
- Within a class, the next request comes from the tenant that has been served
  the fewest tokens (prompt + max_tokens) while queued in that class: a
  tenant's flood cannot starve another tenant. A tenant that becomes active
  starts level with the least-served active tenant, so idle time banks no credit.
- Preempted requests resume first within their class: they already held
  their turn.

Pure Python; time comes from the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvserve.contract import Request


def request_cost(request: Request) -> int:
    """Tokens a request claims (its KV footprint at completion)."""
    return request.max_num_tokens


class _PriorityClass:
    """One priority class: a resume lane plus one FIFO per tenant."""

    def __init__(self) -> None:
        self.resumed: OrderedDict[str, Request] = OrderedDict()
        self.tenants: dict[str, OrderedDict[str, Request]] = {}
        self.served_tokens: dict[str, int] = {}
        self.size = 0

    def add(self, request: Request, front: bool) -> None:
        self.size += 1
        if front:
            self.resumed[request.request_id] = request
            self.resumed.move_to_end(request.request_id, last=False)
            return
        queue = self.tenants.get(request.tenant)
        if queue is None:
            floor = min(self.served_tokens.values(), default=0)
            queue = self.tenants[request.tenant] = OrderedDict()
            self.served_tokens[request.tenant] = floor
        queue[request.request_id] = request

    def head(self) -> Request | None:
        if self.resumed:
            return next(iter(self.resumed.values()))
        best = None
        for tenant, queue in self.tenants.items():
            candidate = next(iter(queue.values()))
            key = (self.served_tokens[tenant], candidate.arrival_time)
            if best is None or key < best[0]:
                best = (key, candidate)
        return best[1] if best else None

    def oldest_arrival(self) -> float:
        """Earliest arrival among waiting members (queues are FIFO, so heads suffice)."""
        heads = [next(iter(q.values())) for q in self.tenants.values()]
        if self.resumed:
            heads.append(min(self.resumed.values(), key=lambda r: r.arrival_time))
        return min(r.arrival_time for r in heads)

    def remove(self, request: Request, charge: bool) -> bool:
        rid = request.request_id
        if self.resumed.pop(rid, None) is not None:
            self.size -= 1
            return True
        queue = self.tenants.get(request.tenant)
        if queue is None or queue.pop(rid, None) is None:
            return False
        self.size -= 1
        if charge:
            self.served_tokens[request.tenant] += request_cost(request)
        if not queue:
            del self.tenants[request.tenant]
            del self.served_tokens[request.tenant]
        return True

    def __iter__(self) -> Iterator[Request]:
        yield from self.resumed.values()
        for queue in self.tenants.values():
            yield from queue.values()


class WaitingQueue:
    def __init__(self, aging_s_per_priority: float) -> None:
        self.aging_s_per_priority = aging_s_per_priority
        self._classes: dict[int, _PriorityClass] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """All waiting requests, class by class (not in exact pop order)."""
        for priority in sorted(self._classes):
            yield from self._classes[priority]

    def add(self, request: Request, front: bool = False) -> None:
        """Enqueue; `front` puts a preempted request ahead of its class."""
        cls = self._classes.get(request.priority)
        if cls is None:
            cls = self._classes[request.priority] = _PriorityClass()
        cls.add(request, front)
        self._size += 1

    def effective_priority(self, request: Request, now: float) -> float:
        return request.priority - (now - request.arrival_time) / self.aging_s_per_priority

    def peek(self, now: float) -> Request | None:
        """The request to start next at time `now`; no state change."""
        best_key, best = None, None
        for priority, cls in self._classes.items():
            oldest = cls.oldest_arrival()
            key = (priority - (now - oldest) / self.aging_s_per_priority, oldest)
            if best_key is None or key < best_key:
                best_key, best = key, cls
        return best.head() if best is not None else None

    def pop(self, request: Request) -> None:
        """Remove a request that is starting, charging its tenant's share."""
        self._remove(request, charge=True)

    def remove(self, request: Request) -> bool:
        """Remove a request that leaves without starting (abort, timeout)."""
        return self._remove(request, charge=False)

    def _remove(self, request: Request, charge: bool) -> bool:
        cls = self._classes.get(request.priority)
        if cls is None or not cls.remove(request, charge):
            return False
        self._size -= 1
        if cls.size == 0:
            del self._classes[request.priority]
        return True
