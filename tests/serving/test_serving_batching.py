"""The replica's adaptive batcher on its own (no Ray): who is predicted with whom, and that every
caller gets exactly its own answer or its batch's error. Through real Serve and HTTP, with a
real registered model: ``tests/serving/test_serving.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from raydeck.serving.batching import AdaptiveBatcher


class Handler:
    """Doubles each item; records each batch; holds every batch until ``gate`` is set."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.gate.set()

    async def __call__(self, items: list[int]) -> Sequence[int]:
        self.batches.append(items)
        self.entered.set()
        await self.gate.wait()
        if -1 in items:
            raise ValueError("cannot predict -1")
        return [2 * item for item in items]


async def _queued_behind_a_running_batch(batcher: AdaptiveBatcher[int, int], handler: Handler,
                                         behind: list[int]) -> list[int]:
    handler.gate.clear()
    first = asyncio.create_task(batcher.submit(0))
    await handler.entered.wait()
    waiting = [asyncio.create_task(batcher.submit(item)) for item in behind]
    while batcher.pending < 1 + len(behind):
        await asyncio.sleep(0)
    handler.gate.set()
    return list(await asyncio.gather(first, *waiting))


@pytest.mark.timeout(10)
def test_a_lone_request_is_a_batch_of_one_and_those_queued_behind_it_go_together() -> None:
    async def scenario() -> tuple[list[int], list[list[int]]]:
        handler = Handler()
        batcher = AdaptiveBatcher(handler, max_batch_size=8)
        answers = await _queued_behind_a_running_batch(batcher, handler, [1, 2, 3])
        assert batcher.pending == 0
        return answers, handler.batches

    answers, batches = asyncio.run(scenario())
    assert answers == [0, 2, 4, 6]
    assert batches == [[0], [1, 2, 3]]


@pytest.mark.timeout(10)
def test_batches_stop_at_the_largest_size_and_keep_arrival_order() -> None:
    async def scenario() -> tuple[list[int], list[list[int]]]:
        handler = Handler()
        batcher = AdaptiveBatcher(handler, max_batch_size=2)
        answers = await _queued_behind_a_running_batch(batcher, handler, [1, 2, 3, 4, 5])
        return answers, handler.batches

    answers, batches = asyncio.run(scenario())
    assert answers == [0, 2, 4, 6, 8, 10]
    assert batches == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.timeout(10)
def test_a_failing_batch_fails_its_own_callers_only() -> None:
    async def scenario() -> list[object]:
        handler = Handler()
        batcher = AdaptiveBatcher(handler, max_batch_size=2)
        handler.gate.clear()
        first = asyncio.create_task(batcher.submit(0))
        await handler.entered.wait()
        rest = [asyncio.create_task(batcher.submit(item)) for item in (-1, 1, 2)]
        while batcher.pending < 4:
            await asyncio.sleep(0)
        handler.gate.set()
        return list(await asyncio.gather(first, *rest, return_exceptions=True))

    answers = asyncio.run(scenario())
    assert answers[0] == 0 and answers[3] == 4
    assert all(isinstance(a, ValueError) and "cannot predict -1" in str(a) for a in answers[1:3])


@pytest.mark.timeout(10)
def test_a_caller_that_gives_up_is_skipped() -> None:
    async def scenario() -> tuple[list[int], list[list[int]]]:
        handler = Handler()
        batcher = AdaptiveBatcher(handler, max_batch_size=8)
        handler.gate.clear()
        first = asyncio.create_task(batcher.submit(0))
        await handler.entered.wait()
        gone = asyncio.create_task(batcher.submit(1))
        kept = asyncio.create_task(batcher.submit(2))
        while batcher.pending < 3:
            await asyncio.sleep(0)
        gone.cancel()
        handler.gate.set()
        return [await first, await kept], handler.batches

    answers, batches = asyncio.run(scenario())
    assert answers == [0, 4]
    assert batches == [[0], [2]]


@pytest.mark.timeout(10)
def test_with_a_wait_the_first_request_waits_for_more_up_to_the_size() -> None:
    async def scenario() -> list[list[int]]:
        handler = Handler()
        # A wait far longer than the test: the batch goes when it is full, not when it ends.
        batcher = AdaptiveBatcher(handler, max_batch_size=3, wait_s=60.0)
        assert await asyncio.gather(*(batcher.submit(item) for item in (1, 2, 3))) == [2, 4, 6]
        batcher.configure(max_batch_size=1, wait_s=60.0)
        assert await batcher.submit(4) == 8
        return handler.batches

    assert asyncio.run(scenario()) == [[1, 2, 3], [4]]


@pytest.mark.timeout(10)
def test_a_handler_that_answers_the_wrong_count_fails_the_batch_not_the_batcher() -> None:
    async def wrong(items: list[int]) -> list[int]:
        return items[:1]

    async def scenario() -> list[object]:
        batcher = AdaptiveBatcher(wrong, max_batch_size=4)
        answers = await asyncio.gather(batcher.submit(1), batcher.submit(2),
                                       return_exceptions=True)
        return [*answers, await batcher.submit(3)]

    answers = asyncio.run(scenario())
    assert all(isinstance(a, RuntimeError) and "1 result(s) for 2 item(s)" in str(a)
               for a in answers[:2])
    assert answers[2] == 3
