"""``within``: the same contract as ``asyncio.timeout`` (a block cancelled at its
deadline raises ``TimeoutError``; an outer cancellation passes through; the task's
cancellation count is restored), with the blocks of one duration sharing one timer.
On the default loop and on uvloop, which the gateway serves on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from ncap.providers.deadlines import _QUEUES, within

LoopFactory = Callable[[], asyncio.AbstractEventLoop]
LOOPS: dict[str, LoopFactory] = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run(factory: LoopFactory, main: Awaitable[None]) -> None:
    loop = factory()
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


@pytest.fixture(params=sorted(LOOPS))
def loop_factory(request: pytest.FixtureRequest) -> LoopFactory:
    return LOOPS[request.param]


def test_a_block_past_its_deadline_raises_timeout_at_the_deadline(
    loop_factory: LoopFactory,
) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError), within(0.05):
            await asyncio.sleep(5)
        elapsed = loop.time() - started
        assert 0.045 <= elapsed < 0.5
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # no cancellation left pending on the task

    run(loop_factory, main())


def test_a_block_in_time_is_untouched_and_leaves_nothing_behind(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        for _ in range(1000):
            with within(0.2):
                await asyncio.sleep(0)
        await asyncio.sleep(0.3)  # the timer fires once, finds every block finished
        queue = _QUEUES[asyncio.get_running_loop()][0.2]
        assert not queue._blocks and queue._timer is None

    run(loop_factory, main())


def test_an_outer_cancellation_is_not_taken_for_the_deadline(loop_factory: LoopFactory) -> None:
    async def guarded() -> None:
        with within(5):
            await asyncio.sleep(5)

    async def main() -> None:
        task = asyncio.ensure_future(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(loop_factory, main())


def test_an_outer_timeout_around_a_longer_block_is_the_outer_ones(
    loop_factory: LoopFactory,
) -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05) as outer:
                with within(5):
                    await asyncio.sleep(5)
        assert outer.expired()

    run(loop_factory, main())


def test_blocks_of_one_duration_each_expire_at_their_own_deadline(
    loop_factory: LoopFactory,
) -> None:
    """Staggered entries, some finishing early: each running block times out one
    duration after it entered, the finished ones are never cancelled."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        outcomes: dict[int, tuple[str, float]] = {}

        async def block(i: int, work: float) -> None:
            entered = loop.time()
            try:
                with within(0.2):
                    await asyncio.sleep(work)
            except TimeoutError:
                outcomes[i] = ("timeout", loop.time() - entered)
            else:
                outcomes[i] = ("done", loop.time() - entered)

        tasks = []
        for i in range(12):
            work = 0.01 if i % 3 else 1.0  # every third one overruns
            tasks.append(asyncio.ensure_future(block(i, work)))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        for i, (outcome, elapsed) in outcomes.items():
            if i % 3:
                assert outcome == "done" and elapsed < 0.2
            else:  # never at a later block's deadline (0.05 s apart)
                assert outcome == "timeout" and 0.195 <= elapsed < 0.27

    run(loop_factory, main())


def test_blocks_of_different_durations_keep_their_own(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def block(seconds: float) -> float:
            entered = loop.time()
            with pytest.raises(TimeoutError), within(seconds):
                await asyncio.sleep(5)
            return loop.time() - entered

        long, short = await asyncio.gather(block(0.2), block(0.05))
        assert 0.045 <= short < 0.15 and 0.195 <= long < 0.4

    run(loop_factory, main())


def test_an_error_inside_a_block_passes_through(loop_factory: LoopFactory) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="inner"), within(5):
            raise ValueError("inner")

    run(loop_factory, main())


def test_the_timer_moves_on_to_the_next_running_block(loop_factory: LoopFactory) -> None:
    """Two overrunning blocks and nothing after them: the timer that expired the first
    is armed again for the second."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def block() -> float:
            entered = loop.time()
            with pytest.raises(TimeoutError), within(0.1):
                await asyncio.sleep(2)
            return loop.time() - entered

        first = asyncio.ensure_future(block())
        await asyncio.sleep(0.05)
        second = await block()
        assert 0.095 <= await first < 0.3 and 0.095 <= second < 0.3

    run(loop_factory, main())
