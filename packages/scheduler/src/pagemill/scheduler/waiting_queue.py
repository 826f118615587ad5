"""The waiting queue in policy order: FCFS as a deque, priority as a heap.

Both expose the same small interface so the scheduler never branches on the policy.
Preempted requests go back "to the head", ahead of every later arrival: for FCFS by
arrival order (the front, unless a restricted step ran a later arrival first); for the heap
their unchanged key (priority, arrival_time, arrival seq) already puts them there.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from pagemill.scheduler.request import Request


class WaitingQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def add_front(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests are re-queued ahead of every later arrival."""

    def __init__(self) -> None:
        self._dq: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._dq.append(request)

    def add_front(self, request: Request) -> None:
        # Ahead of every later arrival: the front itself, except after a restricted step
        # (`Scheduler.restrict_to`) ran a later arrival while earlier ones were held.
        dq = self._dq
        at = 0
        while at < len(dq) and dq[at]._seq < request._seq:
            at += 1
        dq.insert(at, request)

    def peek(self) -> Request:
        return self._dq[0]

    def pop(self) -> Request:
        return self._dq.popleft()

    def remove(self, request: Request) -> None:
        # O(n): only aborts of waiting requests come here, never the per-step path.
        self._dq.remove(request)

    def __len__(self) -> int:
        return len(self._dq)

    def __bool__(self) -> bool:
        return bool(self._dq)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._dq)


def priority_key(request: Request) -> tuple[int, float, int]:
    """Lower sorts first: priority value, then arrival time, then arrival order."""
    return (request.priority, request.arrival_time, request._seq)


class PriorityQueue:
    """Min-heap on priority_key; iteration (tests, debugging) is in pop order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), request))

    add_front = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                last = self._heap.pop()
                if i < len(self._heap):
                    self._heap[i] = last
                    heapq.heapify(self._heap)
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def make_waiting_queue(policy: str) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; expected 'fcfs' or 'priority'")
