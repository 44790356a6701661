"""Per-attempt time limits that share one event-loop timer per duration.

``asyncio.timeout`` arms a timer when its block is entered and cancels it when the
block is left: on uvloop that is a libuv timer started and stopped per attempt, about
20 k instructions of a whole answer's ~830 k under callgrind (a gateway that answers
in milliseconds cancels every one of them). ``within(seconds)`` keeps the same
contract, its block's task cancelled at the deadline and that cancellation raised as
``TimeoutError`` (never an outer cancellation, which passes through as it came), but
the limits of one duration (a route's ``timeout_s``: a handful of values) wait in
one first-in, first-out queue, in deadline order since each is its entry time plus the
same duration, behind ONE timer armed for the oldest one still running:

- entering a block appends it (and drops the finished blocks at the queue's head);
- leaving one marks it finished (the queue drops it when it reaches the head);
- the timer, at the oldest deadline, cancels every block whose deadline has passed,
  drops the finished ones and arms itself again for the next running block's deadline.

Every block's deadline is therefore met when it falls, as with its own timer (the
timer is re-armed at exactly the next deadline, never rounded); a block that finishes
costs a list append and an attribute store, and the timer fires about once per
duration while traffic flows.

The cancellation count is kept as ``asyncio.timeout`` keeps it (``Task.cancelling`` on
entry, ``Task.uncancel`` on exit), so an outer ``asyncio.timeout`` or a client's
disconnect around a block is never mistaken for this block's deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType
from weakref import WeakKeyDictionary

__all__ = ["within"]

_RUNNING, _EXPIRING, _DONE = 0, 1, 2


class Within:
    """One block's limit (``with within(seconds):``); entered once."""

    __slots__ = ("_cancelling", "_queue", "_state", "_task", "deadline")

    def __init__(self, queue: _Queue) -> None:
        self._queue = queue
        self._state = _RUNNING
        self.deadline = 0.0

    def __enter__(self) -> Within:
        # the loop given: without it the lookup asks for the running loop again, which
        # CPython 3.11 checks with a getpid() system call
        task = asyncio.current_task(self._queue.loop)
        if task is None:
            raise RuntimeError("within() must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._queue.add(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == _EXPIRING:
            self._state = _DONE
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
        else:
            self._state = _DONE

    def expire(self) -> None:
        """The deadline passed with the block still running: its task is cancelled."""
        self._state = _EXPIRING
        self._task.cancel()


class _Queue:
    """The running blocks of one duration on one loop, oldest first, and the timer."""

    __slots__ = ("_blocks", "_seconds", "_timer", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        self.loop = loop
        self._seconds = seconds
        self._blocks: deque[Within] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def add(self, block: Within) -> None:
        blocks = self._blocks
        while blocks and blocks[0]._state == _DONE:
            blocks.popleft()
        block.deadline = self.loop.time() + self._seconds
        blocks.append(block)
        if self._timer is None:  # armed for the oldest running block (this one, as a rule)
            self._timer = self.loop.call_at(blocks[0].deadline, self._fire)

    def _fire(self) -> None:
        self._timer = None
        blocks, now = self._blocks, self.loop.time()
        while blocks:
            block = blocks[0]
            if block._state == _RUNNING:
                if block.deadline > now:
                    self._timer = self.loop.call_at(block.deadline, self._fire)
                    return
                block.expire()
            blocks.popleft()


_QUEUES: WeakKeyDictionary[asyncio.AbstractEventLoop, dict[float, _Queue]] = WeakKeyDictionary()
# the loop of the last call and its queues (a gateway runs on one loop: no weak
# reference is made per block)
_last: tuple[asyncio.AbstractEventLoop | None, dict[float, _Queue]] = (None, {})


def within(seconds: float) -> Within:
    """A limit of ``seconds`` on the block it guards (``with within(seconds): …``), on
    the running loop; past it the block's awaits are cancelled and the block raises
    ``TimeoutError``."""
    global _last
    loop = asyncio.get_running_loop()
    last, queues = _last
    if last is not loop:
        found = _QUEUES.get(loop)
        if found is None:
            found = _QUEUES[loop] = {}
        queues = found
        _last = (loop, queues)
    queue = queues.get(seconds)
    if queue is None:
        queue = queues[seconds] = _Queue(loop, seconds)
    return Within(queue)
