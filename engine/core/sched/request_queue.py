"""Waiting queues: FCFS (arrival order) and priority (lower value first, then earlier arrival)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.request import Request


class RequestQueue(Protocol):
    """What the scheduler asks of its waiting queue (vLLM's `RequestQueue`), whichever the policy: the type that
    `create_request_queue` returns, so the scheduler depends on no one queue."""

    def add_request(self, request: Request) -> None: ...
    def prepend_request(self, request: Request) -> None: ...
    def peek_request(self) -> Request: ...
    def pop_request(self) -> Request: ...
    def remove_request(self, request: Request) -> None: ...
    def request_ids(self) -> tuple[str, ...]: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """Arrival order. A preempted request goes back to the head so it resumes first."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def request_ids(self) -> tuple[str, ...]:
        """The queued requests' ids, in queue order."""
        return tuple(r.request_id for r in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """A heap on (priority, arrival time): a preempted request keeps its place by its own key."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)

    def remove_request(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def request_ids(self) -> tuple[str, ...]:
        """The queued requests' ids in heap order (the first is the next to pop; the rest unsorted: a sort per
        step would cost O(n log n) for ids whose order nothing reads)."""
        return tuple(r.request_id for r in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ("fcfs" or "priority")."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
