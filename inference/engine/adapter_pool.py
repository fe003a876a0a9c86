"""The engine's pool of loaded LoRA adapters: at most ``MAX_LORAS`` at once, read from disk off
the tick, laid out on the compute thread, evicted least recently used.

Adapters are keyed by :attr:`~inference.engine.request.AdapterSpec.key` (name, registry
revision, weights digest): two adapters sharing a weights file are two adapters. One a request
needs is *wanted* when the request arrives and a slot is free, or when it reaches the head of
the fair order (:mod:`inference.engine.sched.admission` parks the request meanwhile). A loader
thread (one of :data:`READER_THREADS`) reads its files and checks their SHA-256
(:func:`~inference.engine.lora.read_adapter_files`: file reading only); a read not done within
``read_timeout_s`` (:data:`READ_TIMEOUT_S`: a stalled volume) fails, its thread left blocked and
the others going on. The next tick's :meth:`AdapterPool.poll` lays them out as tensors
(:func:`~inference.engine.lora.build_adapter`, on the compute thread) into a free slot, or the
slot of the least recently used adapter that no admitted row and no request waiting in the
order uses. When every slot is in use the files wait, read, until a slot frees (at most
``MAX_LORAS`` adapters' files wait so; further wants queue without reading). A load that fails
reports its error once (and logs it): the scheduler fails the requests parked on it, and the
next request naming the adapter tries again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inference.engine.lora import AdapterError, AdapterFiles, AdapterWeights, read_adapter_files
from inference.engine.request import AdapterSpec

log = logging.getLogger(__name__)

# The largest adapter file a worker reads (bytes); the registry's own limit is lower.
MAX_ADAPTER_FILE_BYTES = 2 << 30
# Seconds a read of an adapter's files may take before its requests fail; threads reading.
READ_TIMEOUT_S = 30.0
READER_THREADS = 4


class AdapterPool:
    """Loaded adapters by digest, for one engine (module docstring).

    Args:
        capacity: most adapters loaded at once (``MAX_LORAS``, at least 1).
        build: lays out read files as tensors (the backend's, on the compute thread).
        root: the folder every adapter must lie under (``ADAPTER_ROOT``, resolved), or None
            for none (an engine used as a library).
        max_rank: the largest rank loaded (``MAX_LORA_RANK``).
        clock: seconds, for load times.

    ``notify`` (settable): called from the loader thread when files are read, to wake the tick
    loop.
    """

    def __init__(self, capacity: int, build: Callable[[AdapterFiles, int], AdapterWeights], *,
                 root: Path | None = None, max_rank: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter pool holds at least 1 adapter, got {capacity}")
        self.capacity = capacity
        self.root = root
        self.max_rank = max_rank
        self.notify: Callable[[], None] = lambda: None
        # A read not done by then fails its requests (a stalled volume); its thread may stay
        # blocked, the other reads go on on the other threads.
        self.read_timeout_s = READ_TIMEOUT_S
        # Read files at once on the calling thread instead of the loader thread (a test that
        # needs each tick's outcome to repeat exactly); a load is still laid out at a poll.
        self.read_inline = False
        self._build = build
        self._clock = clock
        self._loaded: OrderedDict[str, AdapterWeights] = OrderedDict()  # LRU first
        self._names: dict[str, str] = {}
        self._reading: dict[str, tuple[Future[AdapterFiles], float]] = {}
        self._staged: dict[str, tuple[AdapterFiles, float]] = {}
        self._queued: deque[AdapterSpec] = deque()
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.loads = self.load_failures = self.evictions = 0
        # A load's time runs from its read's start to its tensors laid out (the tick it waited
        # for included); the laying out alone, on the compute thread, is build_seconds_total.
        self.load_seconds_total = self.last_load_seconds = self.build_seconds_total = 0.0

    # -- what the scheduler asks ---------------------------------------------------------------

    def get(self, key: str) -> AdapterWeights | None:
        """The loaded adapter of ``key`` (:attr:`AdapterSpec.key`; now the most recently
        used), or None."""
        weights = self._loaded.get(key)
        if weights is not None:
            self._loaded.move_to_end(key)
        return weights

    def is_loaded(self, key: str) -> bool:
        return key in self._loaded

    def want(self, spec: AdapterSpec) -> None:
        """Start loading ``spec`` unless it is loaded or on its way. A folder outside the root
        fails at once (reported by the next :meth:`poll`)."""
        digest = spec.key  # (the adapter's key: its identity, not only its weights' digest)
        if (digest in self._loaded or digest in self._reading or digest in self._staged
                or digest in self._failed or any(s.key == digest for s in self._queued)):
            return
        self._names[digest] = spec.name
        if spec.rank > self.max_rank:
            self._failed[digest] = f"rank {spec.rank} is over MAX_LORA_RANK={self.max_rank}"
            return
        if self.root is not None:
            folder = Path(spec.path).expanduser().resolve()
            if folder == self.root or not folder.is_relative_to(self.root):
                self._failed[digest] = "its folder is not under ADAPTER_ROOT"
                return
        self._queued.append(spec)
        self._start_reads()

    def prefetch(self, spec: AdapterSpec) -> None:
        """Start loading ``spec`` for a request that just arrived, if it takes a free slot (no
        eviction: a request waiting for its turn never pushes out an adapter in use)."""
        busy = len(self._loaded) + len(self._reading) + len(self._staged) + len(self._queued)
        if busy < self.capacity:
            self.want(spec)

    def has_news(self) -> bool:
        """Whether :meth:`poll` has something to do: files read, or a failure to report."""
        now = self._clock()
        with self._lock:
            done = any(f.done() or now - t > self.read_timeout_s
                       for f, t in self._reading.values())
        return done or bool(self._staged) or bool(self._failed)

    def poll(self, in_use: Callable[[], Collection[str]]) -> tuple[list[str], dict[str, str]]:
        """Lay out the adapters whose files were read, while a slot is free or can be freed
        (evicting the least recently used adapter not in ``in_use()``: the digests of admitted
        rows and of requests waiting in the order). On the compute thread, once a tick.

        Returns:
            ``(loaded, failed)``: digests loaded now; digest -> why, for loads that failed.
        """
        failed, self._failed = self._failed, {}
        now = self._clock()
        with self._lock:
            done = [d for d, (f, _) in self._reading.items() if f.done()]
            stuck = [d for d, (f, t) in self._reading.items()
                     if not f.done() and now - t > self.read_timeout_s]
        for digest in stuck:  # its thread stays blocked; the other readers go on
            self._reading.pop(digest)
            failed[digest] = f"reading its files took over {self.read_timeout_s:g} s"
        for digest in done:
            future, started = self._reading.pop(digest)
            try:
                self._staged[digest] = (dataclasses.replace(future.result(), key=digest),
                                        started)
            except AdapterError as exc:
                failed[digest] = str(exc)
            except Exception as exc:  # an unexpected read failure fails its requests only
                log.exception("reading adapter %s failed", self._names.get(digest, digest))
                failed[digest] = f"cannot read it: {type(exc).__name__}"
        loaded: list[str] = []
        busy: Collection[str] | None = None
        for digest in list(self._staged):
            if len(self._loaded) >= self.capacity:
                busy = in_use() if busy is None else busy
                # (not one loaded in this poll: its parked requests come back after it)
                victim = next((d for d in self._loaded if d not in busy and d not in loaded),
                              None)
                if victim is None:
                    break  # every slot is in use: the files wait, read
                del self._loaded[victim]
                self.evictions += 1
            files, started = self._staged.pop(digest)
            built = time.perf_counter()
            try:
                self._loaded[digest] = self._build(files, self.max_rank)
            except AdapterError as exc:
                failed[digest] = str(exc)
                continue
            except Exception as exc:  # its requests fail, never the tick and the rows in it
                log.exception("laying out adapter %s failed", self._names.get(digest, digest))
                failed[digest] = f"cannot lay it out: {type(exc).__name__}"
                continue
            self.build_seconds_total += time.perf_counter() - built
            seconds = self._clock() - started
            self.loads += 1
            self.last_load_seconds = seconds
            self.load_seconds_total += seconds
            loaded.append(digest)
        self.load_failures += len(failed)
        for digest, why in failed.items():
            log.warning("LoRA adapter %s could not be loaded: %s",
                        self._names.get(digest, digest), why)
        self._start_reads()
        return loaded, failed

    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: the adapters loaded (names, least recently used first), the
        capacity, loads in progress, and counters since start (load times in seconds)."""
        return {
            "loaded": [self._names.get(d, d) for d in self._loaded],
            "loaded_keys": list(self._loaded),
            "capacity": self.capacity,
            "loading": len(self._reading) + len(self._staged) + len(self._queued),
            "loads": self.loads, "load_failures": self.load_failures,
            "evictions": self.evictions,
            "last_load_s": round(self.last_load_seconds, 4),
            "load_s_total": round(self.load_seconds_total, 4),
            "build_s_total": round(self.build_seconds_total, 4),
        }

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the loader thread ---------------------------------------------------------------------

    def _start_reads(self) -> None:
        """Read queued adapters while fewer than ``capacity`` are read or waiting read."""
        while self._queued and len(self._reading) + len(self._staged) < self.capacity:
            spec = self._queued.popleft()
            if self.read_inline:
                future: Future[AdapterFiles] = Future()
                try:
                    future.set_result(read_adapter_files(spec.path, spec.digest,
                                                         MAX_ADAPTER_FILE_BYTES))
                except Exception as exc:  # noqa: BLE001 - reported by poll, as a thread's
                    future.set_exception(exc)
                with self._lock:
                    self._reading[spec.key] = (future, self._clock())
                continue
            if self._executor is None:  # as many readers as reads: a stuck one blocks no other
                self._executor = ThreadPoolExecutor(READER_THREADS,
                                                    thread_name_prefix="adapter-read")
            future = self._executor.submit(read_adapter_files, spec.path, spec.digest,
                                           MAX_ADAPTER_FILE_BYTES)
            with self._lock:
                self._reading[spec.key] = (future, self._clock())
            future.add_done_callback(lambda _: self.notify())
