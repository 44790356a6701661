"""Continuous batching: one thread owns the llama context and runs the decode loop.

Each iteration admits waiting requests (FIFO) while sequence ids and KV cells allow,
then builds ONE batch holding the next token of every live sequence of every request
plus a chunk of the prompts still being prefilled, calls ``llama_decode`` once and
samples every sequence from its own logits row. A prompt is evaluated once: its tokens
carry all n sequence ids of the request (unified KV cache), and only its last token asks
for logits, from which all n choices draw their first token.

A finished choice keeps its KV cells until its whole request ends: llama.cpp reuses
freed cells at once, and a sequence whose later tokens sit in lower cells than its
earlier ones attends in a different order, which changes the floating-point result.
Keeping the cells (and flash attention, which skips masked cells) makes a request that
runs alone reproducible to the bit: choice i with seed s equals choice 0 of an n=1
request with seed s+i. Concurrent requests can still reorder each other's cells, so
under load a seed is best-effort, as with OpenAI.

Admission reserves ``prompt + n × max_new`` KV cells, so a running request never runs out
of cells; a request that alone needs more than the whole cache runs alone and its
choices end with ``length`` if the cache fills. Results go back to the caller through a
``Sink`` (a callable the caller makes thread-safe); cancelling a request frees its
sequences at the start of the next step.

With a prefix cache (``ncap.engine.prefix_cache``), a request's prefill starts after the
longest prefix of its prompt that a recent prompt left in the cache, and its own prompt
is kept there once evaluated. In a tool request each choice's text goes through a
``ToolChoiceText``, which turns a finished call into ``tool_calls``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ncap.engine.events import (
    ChoiceDelta,
    Event,
    RequestCancelled,
    RequestDone,
    RequestFailed,
    RequestStarted,
    TokenInfo,
)
from ncap.engine.model import ContextSettings, LlamaModel
from ncap.engine.params import GenerationParams
from ncap.engine.prefix_cache import PrefixCache, common_prefix
from ncap.engine.sampling import LogitsRow, Sampler, build_sampler, logits_row, token_info
from ncap.engine.text import ChoiceText
from ncap.engine.tools import CallsText, ToolChoiceText
from ncap.errors import NcapError, Overloaded
from ncap.logsafe import log_internal_error

__all__ = [
    "EngineSpeed",
    "EngineStats",
    "Job",
    "PreparedRequest",
    "Scheduler",
    "SchedulerSettings",
    "Sink",
]

log = logging.getLogger(__name__)

Sink = Callable[[list[Event]], bool]
"""Receives a request's events from the scheduler thread; False: the receiver is gone."""


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    n_ctx: int = 8192
    max_sequences: int = 32
    max_queue: int = 64
    threads: int = 2
    prefill_chunk: int = 256
    prefix_cache_tokens: int = 0
    # sequence ids kept for prefix-cache entries (beyond max_sequences; at most 256 in all)
    prefix_cache_entries: int = 16


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request ready to run: prompt tokens, per-choice seeds, compiled grammar."""

    tokens: tuple[int, ...]
    params: GenerationParams
    max_new: int
    seeds: tuple[int, ...]
    grammar: str | None = None

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def reserve(self) -> int:
        """KV cells the request may occupy: the shared prompt once, every choice's output."""
        return len(self.tokens) + self.n * self.max_new


@dataclass(slots=True)
class EngineStats:
    """Counters for tests and metrics (prompt tokens are counted once per prefill)."""

    prompt_tokens_evaluated: int = 0
    decode_steps: int = 0
    tokens_generated: int = 0
    requests_completed: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_tokens: int = 0
    prefix_cache_entries: int = 0
    queue_depth: int = 0
    running_requests: int = 0
    live_sequences: int = 0


@dataclass(slots=True)
class EngineSpeed:
    """How fast this engine has been lately, as moving averages of its own steps.

    ``prefill_s`` is the wall time per batch row of steps that evaluated prompt tokens
    (every row counted alike), ``decode_s`` the wall time per sequence of steps that
    only decoded. Both start pessimistic (several times what a quiet two-core machine
    does) and follow the machine as it is: a busy one measures slower. The step running
    now counts too (``now``): one that has already taken longer per row than the
    averages say is the measure until it ends, so a machine that slowed down is seen
    before its first slow step is over. Written by the scheduler thread only; a reader
    sees one value or the other, never a torn one.
    """

    prefill_s: float = 0.02
    decode_s: float = 0.05
    prefill_steps: int = 0
    decode_steps: int = 0
    # the step in progress: (perf_counter at its start, rows, rows that only decode)
    running: tuple[float, int, int] | None = None

    def begin(self, rows: int, decode_rows: int) -> float:
        began = time.perf_counter()
        self.running = (began, rows, decode_rows)
        return began

    def observe(self, seconds: float, rows: int, decode_rows: int) -> None:
        self.running = None
        if rows <= 0:
            return
        if rows > decode_rows:
            self.prefill_s = _ewma(self.prefill_s, seconds / rows, self.prefill_steps)
            self.prefill_steps += 1
        else:
            self.decode_s = _ewma(self.decode_s, seconds / rows, self.decode_steps)
            self.decode_steps += 1

    def now(self) -> tuple[float, float]:
        """(seconds per prefill row, seconds per decoded sequence), the running step's
        time so far included."""
        prefill, decode, running = self.prefill_s, self.decode_s, self.running
        if running is not None:
            began, rows, decode_rows = running
            so_far = (time.perf_counter() - began) / max(1, rows)
            if rows > decode_rows:
                prefill = max(prefill, so_far)
            else:
                decode = max(decode, so_far)
        return prefill, decode


def _ewma(mean: float, sample: float, seen: int) -> float:
    """The first measurement replaces the prior; later ones move the mean by a fifth."""
    return sample if seen == 0 else mean + 0.2 * (sample - mean)


@dataclass(eq=False, slots=True)
class _Sequence:
    index: int
    seq_id: int
    sampler: Sampler
    text: ChoiceText
    pos: int = 0
    n_tokens: int = 0
    pending: int | None = None
    finish_reason: str | None = None
    reported: bool = False
    logprob_sum: float = 0.0
    out_text: list[str] = field(default_factory=list)
    out_logprobs: list[TokenInfo] = field(default_factory=list)
    tools: ToolChoiceText | None = None

    @property
    def live(self) -> bool:
        return self.finish_reason is None


@dataclass(eq=False)
class Job:
    """One submitted request; the handle callers use to cancel it."""

    prepared: PreparedRequest
    sink: Sink
    sequences: list[_Sequence] = field(default_factory=list)
    prefilled: int = 0
    cached: int = 0
    looked_up: bool = False
    cancelled: bool = False
    finished: bool = False

    @property
    def params(self) -> GenerationParams:
        return self.prepared.params

    @property
    def tokens_generated(self) -> tuple[int, ...]:
        return tuple(s.n_tokens for s in self.sequences)

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prepared.tokens)


# a shared prefix shorter than this is not worth waiting for another request's prefill
_MIN_WAIT = 32
# llama.cpp's CPU flash attention takes a tiled path for 64 or more query rows in a
# ubatch, whose sums depend on where the cells sit in the cache; below that, every row
# attends over its visible cells in order, so a prompt whose prefix came from the cache
# computes the same bits as one evaluated whole (docs/decisions/engine-n-ubatch-48.md)
_UBATCH = 48
# a one-row ubatch takes yet another attention kernel (split over the KV cells, so its
# sums depend on the cache's size): a reused prompt's tail is at least two tokens
_MIN_TAIL = 2


def _call_finish(job: Job, seq: _Sequence, calls: CallsText) -> str | None:
    """``tool_calls`` once the calls are whole; a choice cut inside one keeps its own
    reason (``length``), as OpenAI's does. Without parallel calls, a choice cut right
    after its one call could only have ended there."""
    tools = job.params.tools
    single = tools is not None and not tools.parallel
    if calls.complete and (seq.finish_reason != "length" or single):
        return "tool_calls"
    return seq.finish_reason


def _cache_slots(settings: SchedulerSettings) -> int:
    if settings.prefix_cache_tokens <= 0:
        return 0
    return max(0, min(settings.prefix_cache_entries, 256 - settings.max_sequences))


class _Batch:
    """A reusable ``llama_batch`` filled from Python."""

    def __init__(self, lib: Any, capacity: int, max_seq_ids: int) -> None:
        self._lib = lib
        self.capacity = capacity
        self.raw = lib.llama_batch_init(capacity, 0, max_seq_ids)

    @property
    def size(self) -> int:
        return int(self.raw.n_tokens)

    def clear(self) -> None:
        self.raw.n_tokens = 0

    def add(self, token: int, pos: int, seq_ids: list[int], logits: bool) -> int:
        raw, i = self.raw, self.raw.n_tokens
        raw.token[i] = token
        raw.pos[i] = pos
        raw.n_seq_id[i] = len(seq_ids)
        for k, sid in enumerate(seq_ids):
            raw.seq_id[i][k] = sid
        raw.logits[i] = 1 if logits else 0
        raw.n_tokens = i + 1
        return int(i)

    def free(self) -> None:
        self._lib.llama_batch_free(self.raw)


class Scheduler:
    """Owns the llama context; ``submit``/``cancel``/``stats`` are thread-safe."""

    def __init__(self, model: LlamaModel, settings: SchedulerSettings) -> None:
        self._model = model
        self._lib = model.lib
        self.settings = settings
        self._n_batch = max(512, settings.prefill_chunk) + settings.max_sequences
        slots = _cache_slots(settings)
        n_seq = settings.max_sequences + slots
        self._ctx = model.new_context(
            ContextSettings(settings.n_ctx, n_seq, self._n_batch, settings.threads, _UBATCH)
        )
        self.capacity: int = self._lib.llama_n_ctx(self._ctx)
        self._mem = self._lib.llama_get_memory(self._ctx)
        self._batch = _Batch(self._lib, self._n_batch, settings.max_sequences)
        budget = min(settings.prefix_cache_tokens, self.capacity) if slots else 0
        self._cache = PrefixCache(
            self._lib, self._mem, range(settings.max_sequences, n_seq), budget
        )
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._running: list[Job] = []
        self._free_ids: deque[int] = deque(range(settings.max_sequences))
        self._reserved = 0
        self._stopping = False
        self._drop_cache = False
        self._stats = EngineStats()
        self.speed = EngineSpeed()
        self._thread = threading.Thread(target=self._run, name="ncap-engine", daemon=True)
        self._thread.start()

    # --- any thread ---

    def submit(self, prepared: PreparedRequest, sink: Sink) -> Job:
        """Queue a request; raises Overloaded when the queue is full."""
        job = Job(prepared, sink)
        with self._cond:
            if self._stopping:
                raise Overloaded("the local engine is shutting down")
            if len(self._pending) >= self.settings.max_queue:
                raise Overloaded(
                    "the local engine's queue is full; retry after a short delay",
                    retry_after=1.0,
                )
            self._pending.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> bool:
        """Forget a request: dropped from the queue now (True), or its sequences freed
        before the next step, which it reports with ``RequestCancelled`` (False)."""
        job.cancelled = True
        with self._cond:
            queued = job in self._pending
            if queued:
                self._pending.remove(job)
            self._cond.notify()
        return queued

    def drop_prefix_cache(self) -> None:
        """Forget every cached prefix (done by the scheduler thread before its next step)."""
        with self._cond:
            self._drop_cache = True
            self._cond.notify()

    def stats(self) -> EngineStats:
        with self._cond:
            self._stats.queue_depth = len(self._pending)
            self._stats.prefix_cache_tokens = self._cache.tokens
            self._stats.prefix_cache_entries = self._cache.entries
        s = self._stats
        return EngineStats(**{k: getattr(s, k) for k in EngineStats.__slots__})

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        self._batch.free()
        self._lib.llama_free(self._ctx)

    # --- scheduler thread ---

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._pending or self._running or self._drop_cache):
                    self._cond.wait()
                if self._stopping:
                    break
                drop, self._drop_cache = self._drop_cache, False
                while drop and self._cache.evict_oldest():
                    pass
                # a cancelled request's ids and cells go to the queue's head in this very
                # iteration, not one step later
                self._reap_cancelled_safely()
                admitted = self._admit_locked()
            for job in admitted:
                self._start(job)
            try:
                if self._running:
                    self._step()
            except Exception as exc:
                log_internal_error(log, "local engine step failed", exc)
                self._fail_all(NcapError("the local engine failed while generating"))
        self._fail_all(Overloaded("the local engine is shutting down"))
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for job in pending:
            job.sink([RequestFailed(Overloaded("the local engine is shutting down"))])

    def _admit_locked(self) -> list[Job]:
        """FIFO admission while the head fits in free sequence ids and reserved KV cells."""
        admitted: list[Job] = []
        ids = len(self._free_ids)  # ids are taken in _start, after this loop
        while self._pending:
            job = self._pending[0]
            alone = not self._running and not admitted
            fits = self._fits(job.prepared.reserve)
            if ids < job.prepared.n or not (fits or alone):
                break
            ids -= job.prepared.n
            self._pending.popleft()
            self._reserved += job.prepared.reserve
            admitted.append(job)
        return admitted

    def _fits(self, reserve: int) -> bool:
        """Room for ``reserve`` more cells, evicting cached prefixes (oldest first) for it."""
        while self._reserved + self._cache.tokens + reserve > self.capacity:
            if not self._cache.evict_oldest():
                return False
        return True

    def _start(self, job: Job) -> None:
        """Give the job its sequence ids and samplers (built here: this thread owns them)."""
        self._running.append(job)
        p, model = job.prepared, self._model
        try:
            for i, seed in enumerate(p.seeds):
                sampler = build_sampler(
                    self._lib, model.vocab, model.n_vocab, p.params, seed=seed, grammar=p.grammar
                )
                seq_id = self._free_ids.popleft()
                seq = _Sequence(i, seq_id, sampler, ChoiceText(p.params.stop))
                tools = p.params.tools
                seq.tools = ToolChoiceText([t.name for t in tools.callable]) if tools else None
                job.sequences.append(seq)
        except NcapError as exc:
            self._drop(job)
            job.sink([RequestFailed(exc)])
        else:
            job.sink([RequestStarted()])
        self._update_gauges()

    def _step(self) -> None:
        batch = self._batch
        batch.clear()
        decode_rows = [
            (job, seq, batch.add(seq.pending, seq.pos, [seq.seq_id], True))
            for job in self._running
            for seq in job.sequences
            if seq.pending is not None
        ]
        chunks = self._add_prefill_chunks(batch)
        if batch.size == 0:
            return
        began = self.speed.begin(batch.size, len(decode_rows))
        rc = self._lib.llama_decode(self._ctx, batch.raw)
        if rc != 0:
            self.speed.running = None
            self._decode_failed(rc)
            return
        self._stats.decode_steps += 1
        self._stats.prompt_tokens_evaluated += batch.size - len(decode_rows)
        for job, end, _row in chunks:
            job.prefilled = end
            if job.prefill_done and job.sequences:
                self._cache.store(job.sequences[0].seq_id, job.prepared.tokens)
        prefill_rows = [(job, row) for job, _end, row in chunks if job.prefill_done]
        self._sample_all(decode_rows, prefill_rows)
        self.speed.observe(time.perf_counter() - began, batch.size, len(decode_rows))

    def _add_prefill_chunks(self, batch: _Batch) -> list[tuple[Job, int, int]]:
        """Add prompt chunks within the step's budget: (job, prompt end, last row) each."""
        # alone, a prompt goes in whole batches; beside decoding sequences, in small
        # chunks, so that their next tokens are not held up for long
        room = batch.capacity - batch.size
        budget = room if batch.size == 0 else min(self.settings.prefill_chunk, room)
        chunks: list[tuple[Job, int, int]] = []
        for job in self._running:
            if job.prefill_done or budget <= 0:
                continue
            if not job.looked_up and not self._reuse_prefix(job):
                continue
            tokens, ids = job.prepared.tokens, [s.seq_id for s in job.sequences]
            end = min(len(tokens), job.prefilled + budget)
            row = -1
            for pos in range(job.prefilled, end):
                row = batch.add(tokens[pos], pos, ids, pos == len(tokens) - 1)
            budget -= end - job.prefilled
            chunks.append((job, end, row))
        return chunks

    def _reuse_prefix(self, job: Job) -> bool:
        """Start the job's prefill from the longest cached prefix of its prompt; False
        (wait) while another request is still prefilling a longer shared prefix, which
        the cache will hold once it is done (fan-out branches, concurrent same-prompt
        calls). The last ``_MIN_TAIL`` prompt tokens are always evaluated (the last gives the
        logits; see ``_MIN_TAIL``)."""
        tokens = job.prepared.tokens
        if not self._cache.enabled:
            job.looked_up = True
            return True
        hit = self._cache.lookup(tokens, len(tokens) - _MIN_TAIL)
        have = hit.length if hit is not None else 0
        for other in self._running:
            busy = other is not job and other.looked_up and not other.prefill_done
            if busy and common_prefix(other.prepared.tokens, tokens) > max(have, _MIN_WAIT):
                return False
        job.looked_up = True
        if hit is not None:
            self._cache.copy_into(hit, [s.seq_id for s in job.sequences])
            job.prefilled = job.cached = hit.length
            self._stats.prompt_tokens_cached += hit.length
        return True

    def _sample_all(
        self, decode_rows: list[tuple[Job, _Sequence, int]], prefill_rows: list[tuple[Job, int]]
    ) -> None:
        cache: dict[int, LogitsRow] = {}
        touched: dict[int, Job] = {}
        for job, seq, row in decode_rows:
            seq.pos += 1
            seq.pending = None
            self._sample(job, seq, row, cache)
            touched[id(job)] = job
        for job, row in prefill_rows:
            for seq in job.sequences:
                seq.pos = len(job.prepared.tokens)
                self._sample(job, seq, row, cache)
            touched[id(job)] = job
        for job in touched.values():
            self._flush(job)
        self._update_gauges()

    def _sample(self, job: Job, seq: _Sequence, row: int, cache: dict[int, LogitsRow]) -> None:
        token = seq.sampler.sample(self._ctx, row)
        seq.n_tokens += 1
        self._stats.tokens_generated += 1
        params = job.params
        if params.logprobs or params.score:
            if row not in cache:
                raw = logits_row(self._lib, self._ctx, row, self._model.n_vocab)
                cache[row] = LogitsRow.of(raw)
            info = token_info(cache[row], token, params.top_logprobs, self._model.pieces)
            seq.logprob_sum += info.logprob
            if params.logprobs:
                seq.out_logprobs.append(info)
        if token in self._model.eog:
            self._finish(seq, "stop")
            return
        text, stopped = seq.text.feed(self._model.pieces[token])
        seq.out_text.append(text)
        if stopped:
            self._finish(seq, "stop", flush=False)
        elif seq.n_tokens >= job.prepared.max_new:
            self._finish(seq, "length")
        else:
            seq.pending = token

    def _finish(self, seq: _Sequence, reason: str, *, flush: bool = True) -> None:
        if flush:
            seq.out_text.append(seq.text.finish())
        seq.finish_reason = reason
        seq.pending = None
        seq.sampler.close()

    def _release(self, seq: _Sequence) -> None:
        """Free a sequence's KV cells and id (shared prompt cells go with the last one)."""
        self._lib.llama_memory_seq_rm(self._mem, seq.seq_id, -1, -1)
        self._free_ids.append(seq.seq_id)
        seq.sampler.close()

    def _flush(self, job: Job) -> None:
        """Send the job's new text (and finish reasons); complete it when all choices ended."""
        events: list[Event] = [d for seq in job.sequences if (d := self._delta(job, seq))]
        if job.prefill_done and all(s.reported for s in job.sequences):
            events.append(
                RequestDone(
                    len(job.prepared.tokens),
                    tuple(s.n_tokens for s in job.sequences),
                    tuple(s.logprob_sum / max(1, s.n_tokens) for s in job.sequences),
                    job.cached,
                )
            )
            self._stats.requests_completed += 1
            self._drop(job)
        if events and not job.sink(events):
            job.cancelled = True

    def _delta(self, job: Job, seq: _Sequence) -> ChoiceDelta | None:
        if seq.reported:
            return None
        text = "".join(seq.out_text)
        seq.out_text.clear()
        done = seq.finish_reason is not None
        calls = None
        if seq.tools is not None:
            text, calls = seq.tools.feed(text, done)
        if not text and not done:
            return None
        logprobs = None
        if job.params.logprobs:
            logprobs = tuple(seq.out_logprobs)
            seq.out_logprobs.clear()
        seq.reported = done
        if calls is not None:
            return ChoiceDelta(
                seq.index, text, logprobs, _call_finish(job, seq, calls), tuple(calls.calls)
            )
        return ChoiceDelta(seq.index, text, logprobs, seq.finish_reason)

    def _drop(self, job: Job) -> None:
        """Take a job off the running list, freeing whatever it still holds."""
        for seq in job.sequences:
            seq.finish_reason = seq.finish_reason or "cancelled"
            self._release(seq)
        if job in self._running:
            self._running.remove(job)
            self._reserved -= job.prepared.reserve
        job.finished = True
        self._update_gauges()  # before the job's last event: its receiver may read them

    def _reap_cancelled_safely(self) -> None:
        try:
            self._reap_cancelled()
        except Exception as exc:
            log_internal_error(log, "local engine failed to free a cancelled request", exc)
            self._fail_all(NcapError("the local engine failed while generating"))

    def _reap_cancelled(self) -> None:
        """Free cancelled requests and tell each what it had used (its caller may wait
        for this to know the sequences are gone and what to account for)."""
        for job in [j for j in self._running if j.cancelled]:
            self._drop(job)
            job.sink([RequestCancelled(job.prefilled, job.tokens_generated, job.cached)])
        self._update_gauges()

    def _decode_failed(self, rc: int) -> None:
        if rc == 1 and self._running:
            # no free KV cell: only a request larger than the cache runs into this (alone)
            job = self._running[-1]
            if not job.prefill_done:
                self._drop(job)
                job.sink([RequestFailed(Overloaded("the local engine ran out of KV cache"))])
                return
            for seq in job.sequences:
                if seq.live:
                    self._finish(seq, "length")
            self._flush(job)
            return
        log.error("llama_decode failed with %d", rc)
        self._fail_all(NcapError("the local engine failed while generating"))

    def _fail_all(self, error: NcapError) -> None:
        self.speed.running = None
        for job in list(self._running):
            self._drop(job)
            job.sink([RequestFailed(error)])
        self._lib.llama_memory_clear(self._mem, True)
        self._cache.forget()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self._stats.running_requests = len(self._running)
        self._stats.live_sequences = sum(1 for j in self._running for s in j.sequences if s.live)
