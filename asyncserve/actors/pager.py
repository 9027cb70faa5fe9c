"""The pager actor: adapters read from disk into the host tier, loaded and unloaded at runtime, and
prefetch for queued requests.

Disk reads and the checks of the files run in a worker thread; building the adapter's tensors runs
in the stepper's torch thread (all tensor work stays in that one thread) a few MiB of rows per call
(PIECE_BYTES), so steps run between the pieces and a large adapter never pauses the streams for long; so does the
copy into the host tier's shared arena. Registration, eviction and arena allocation happen on the
event loop between scheduling decisions, the row copies into the pool at the start of the next step.

Requests for an adapter that is only on disk wait, parked in the engine, while it is fetched
(FetchAdapters, S-LoRA §5.2's prefetch from the tier below); the scheduler then queues them
(AdapterReady). A fetch that fails ends those requests alone, with the reason. FETCHERS fetches run
at once, first come first served, each reserving its arena block before it reads: a burst of
requests for a thousand cold adapters never holds more than FETCHERS of them in memory twice.
With --preload-adapters one more fetcher reads the registered adapters into the host tier's free
room, one at a time, whenever no request waits for a fetch.
"""
from __future__ import annotations

import asyncio
import logging
import time

from asyncserve.actors.stepper import StepperActor
from asyncserve.engine import Engine, adapter_load_failed
from asyncserve.messages import (Abort, AdapterReady, FetchAdapters, LoadAdapter, Prefetch, Shutdown, UnloadAdapter,
                                 adapter_unloaded)
from asyncserve.pager.adapters import HostAdapter, PeftFolder, build_in_pieces, read_peft_folder
from asyncserve.pager.pager import AdapterPager
from asyncserve.progress import Progress

log = logging.getLogger("asyncserve.pager")

# a fetch that finds the host tier full of adapters in use tries again this often (room comes as
# their requests finish, and with no step running nothing else would wake it)
HOST_ROOM_RETRY_S = 0.02
FETCHERS = 2          # one reads a file while the other's tensors are built
PRELOAD_YIELD_S = 0.05   # a preload waits this long at a time while requests' fetches are queued


class PagerActor:
    """``pager``: the engine's adapter tiers, whose host tier this actor fills (the engine's own
    calls park, unpark and check room)."""

    def __init__(self, engine: Engine, pager: AdapterPager, scheduler_mailbox: asyncio.Queue, stepper: StepperActor):
        self.engine = engine
        self.pager = pager
        self.stepper = stepper
        self.scheduler_mailbox = scheduler_mailbox
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self._to_fetch: asyncio.Queue[str] = asyncio.Queue()

    async def run(self) -> None:
        fetchers = [asyncio.create_task(self._fetcher()) for _ in range(FETCHERS)]
        if self.engine.preloading:
            fetchers.append(asyncio.create_task(self._preloader()))
        try:
            while True:
                msg = await self.mailbox.get()
                if isinstance(msg, Shutdown):
                    return
                try:
                    if isinstance(msg, LoadAdapter):
                        await self._load(msg)
                    elif isinstance(msg, UnloadAdapter):
                        self._unload(msg)
                    elif isinstance(msg, Prefetch):
                        self.engine.prefetch(msg.adapters)
                    elif isinstance(msg, FetchAdapters):
                        for name in msg.adapters:
                            self._to_fetch.put_nowait(name)
                except Exception as e:                  # reported to the caller, never fatal
                    if hasattr(msg, "reply") and not msg.reply.done():
                        msg.reply.set_exception(e)
                    else:
                        log.exception("pager failed on %r", msg)
        finally:
            for task in fetchers:
                task.cancel()

    async def _fetcher(self) -> None:
        while True:
            await self._fetch(await self._to_fetch.get())

    async def _preloader(self) -> None:
        t0, count, progress = time.perf_counter(), 0, Progress("preloading adapters", "adapters")
        while True:
            while not self._to_fetch.empty():
                await asyncio.sleep(PRELOAD_YIELD_S)
            name = self.engine.take_preload()
            if name is None:
                break
            count += await self._fetch(name)
            progress(count, count + self.engine.preload_pending())
        progress.close()
        log.info("preloaded %d adapters into the host tier in %.1f s", count, time.perf_counter() - t0)

    async def _fetch(self, name: str) -> bool:
        """Disk -> host for requests parked on ``name``; then the scheduler queues them. Whether it
        was read."""
        engine, pager = self.engine, self.pager
        t0 = time.perf_counter()
        handle = None
        try:
            while not engine.host_room(name):
                await asyncio.sleep(HOST_ROOM_RETRY_S)
            load, handle = pager.registry[name].load, pager.host_allocate(name)
            _, folder = await asyncio.to_thread(engine.read_adapter, name)
            adapter = await self._build(folder)
            view = await self.stepper.call(pager.host_write, handle, adapter)
        except Exception as e:        # a corrupt or vanished file, a tier too small: those requests fail
            if handle is not None:
                pager.host_abandon(handle)
            log.warning("adapter %s could not be loaded: %s", name, e)
            failure = adapter_load_failed(name, e)
            for request_id in engine.load_failed(name):
                self.scheduler_mailbox.put_nowait(Abort(request_id, reason="error", failure=failure))
            return False
        admitted = pager.host_admit(name, load, handle, view)      # else unloaded meanwhile
        if admitted:
            pager.record_load("disk", name, time.perf_counter() - t0)
        self.scheduler_mailbox.put_nowait(AdapterReady(name))
        return admitted

    async def _build(self, folder: PeftFolder) -> HostAdapter:
        pieces = build_in_pieces(folder, self.engine.dtype, self.engine.dora_base)
        adapter = None
        while adapter is None:          # each call queues behind the step already submitted, if any
            adapter = await self.stepper.call(next, pieces)
        return adapter

    async def _store(self, name: str, load: int, adapter: HostAdapter, wait: bool) -> bool:
        """Into the host tier: room and the arena block on the event loop, the copy in the torch thread.
        False if the name was unloaded meanwhile, or (``wait`` False) if the tier is full now."""
        engine, pager = self.engine, self.pager
        while not engine.host_room(name):
            if not wait:
                return False
            await asyncio.sleep(HOST_ROOM_RETRY_S)
        handle = pager.host_allocate(name)
        try:
            view = await self.stepper.call(pager.host_write, handle, adapter)
        except BaseException:
            pager.host_abandon(handle)
            raise
        return pager.host_admit(name, load, handle, view)

    async def _load(self, msg: LoadAdapter) -> None:
        """load_lora_adapter: read and check every weight now (a bad adapter is refused, not
        registered), then register it; it joins the host tier if there is room now (else it is read
        again when a request needs it). Pinned: onto the device for good, or refused."""
        engine, pager = self.engine, self.pager
        engine.check_adapter_name(msg.name)
        t0 = time.perf_counter()
        folder = await asyncio.to_thread(read_peft_folder, msg.name, msg.path, engine.model_config)
        adapter = await self._build(folder)
        engine.check_adapter_name(msg.name)       # again: another load of the name may have won meanwhile
        reg = pager.register(adapter.info(len(folder.weights)))
        try:
            if await self._store(msg.name, reg.load, adapter, wait=msg.pinned):
                pager.record_load("disk", msg.name, time.perf_counter() - t0)
            if msg.pinned:
                pager.pin(msg.name)
        except BaseException:
            if msg.name in pager.registry:
                pager.unregister(msg.name)
            raise
        beside = adapter.unpaged_nbytes
        log.info("loaded adapter %s from %s (%.1f MiB%s, ranks %s, %s%s)", msg.name, msg.path, adapter.nbytes / 2**20,
                 f" + {beside / 2**20:.1f} MiB beside the pool" if beside else "", adapter.ranks,
                 pager.tier(msg.name), ", pinned" if msg.pinned else "")
        msg.reply.set_result(None)

    def _unload(self, msg: UnloadAdapter) -> None:
        for request_id in self.engine.unload_adapter(msg.name):     # queued for it: can no longer run
            self.scheduler_mailbox.put_nowait(Abort(request_id, failure=adapter_unloaded(msg.name)))
        log.info("unloaded adapter %s", msg.name)
        msg.reply.set_result(None)
