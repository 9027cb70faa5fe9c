"""The pager actor: adapter loading and unloading at runtime, and prefetch for queued requests.

Disk reads run in a worker thread; building the adapter's tensors runs in the stepper's torch thread
between two steps (all tensor work stays in that one thread); registration and page allocation
happen on the event loop between scheduling decisions, the row copies at the start of the next step.
"""
from __future__ import annotations

import asyncio
import logging

from asyncserve.engine import Engine
from asyncserve.messages import Abort, LoadAdapter, Prefetch, Shutdown, UnloadAdapter
from asyncserve.pager.adapters import build_host_adapter, read_peft_folder
from asyncserve.stepper.actor import StepperActor

log = logging.getLogger("asyncserve.pager")


class PagerActor:
    def __init__(self, engine: Engine, scheduler_mailbox: asyncio.Queue, stepper: StepperActor):
        self.engine = engine
        self.stepper = stepper
        self.scheduler_mailbox = scheduler_mailbox
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self.prefetched = 0

    async def run(self) -> None:
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
                    self._prefetch(msg)
            except Exception as e:                  # reported to the caller, never fatal
                if hasattr(msg, "reply") and not msg.reply.done():
                    msg.reply.set_exception(e)
                else:
                    log.exception("pager failed on %r", msg)

    async def _load(self, msg: LoadAdapter) -> None:
        engine = self.engine
        if msg.name in engine.pager.host or msg.name == engine.model_name:
            raise ValueError(f"adapter {msg.name!r} is already loaded")
        folder = await asyncio.to_thread(read_peft_folder, msg.name, msg.path)
        adapter = await self.stepper.call(build_host_adapter, folder, engine.model_config, engine.dtype)
        engine.register_adapter(adapter)
        log.info("loaded adapter %s from %s (%.1f MiB, ranks %s)", msg.name, msg.path, adapter.nbytes / 2**20,
                 adapter.ranks)
        msg.reply.set_result(None)

    def _unload(self, msg: UnloadAdapter) -> None:
        engine = self.engine
        if msg.name not in engine.pager.host:
            raise KeyError(msg.name)
        # queued requests for it can no longer run; running ones finish with the resident copy
        for seq in list(engine.scheduler.waiting):
            if seq.adapter == msg.name:
                self.scheduler_mailbox.put_nowait(Abort(seq.request_id, reason="abort"))
        engine.unload_adapter(msg.name)
        log.info("unloaded adapter %s", msg.name)
        msg.reply.set_result(None)

    def _prefetch(self, msg: Prefetch) -> None:
        """Page in queued requests' adapters while the step runs, using only free pages (S-LoRA §5.2)."""
        engine = self.engine
        spare = engine.pool.num_free - engine.scheduler.watermark - len(engine.scheduler.running)
        for name in msg.adapters:
            if name not in engine.pager.host or engine.pager.is_resident(name):
                continue
            need = engine.pager.footprint(name)
            if need > spare:
                break
            if engine.pager.ensure_resident(name) is not None:
                spare -= need
                self.prefetched += 1
