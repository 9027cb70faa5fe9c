"""The pager actor: adapter loading and unloading at runtime, and prefetch for queued requests.

Disk reads and the checks of the files run in a worker thread; building the adapter's tensors runs
in the stepper's torch thread (all tensor work stays in that one thread) one layer per call, so
steps run between the pieces and a large adapter never pauses the streams for long; registration
and page allocation happen on the event loop between scheduling decisions, the row copies at the
start of the next step.
"""
from __future__ import annotations

import asyncio
import logging

from asyncserve.actors.stepper import StepperActor
from asyncserve.engine import Engine
from asyncserve.messages import Abort, LoadAdapter, Prefetch, Shutdown, UnloadAdapter, adapter_unloaded
from asyncserve.pager.adapters import build_in_pieces, read_peft_folder

log = logging.getLogger("asyncserve.pager")


class PagerActor:
    def __init__(self, engine: Engine, scheduler_mailbox: asyncio.Queue, stepper: StepperActor):
        self.engine = engine
        self.stepper = stepper
        self.scheduler_mailbox = scheduler_mailbox
        self.mailbox: asyncio.Queue = asyncio.Queue()

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
        engine.check_adapter_name(msg.name)
        folder = await asyncio.to_thread(read_peft_folder, msg.name, msg.path, engine.model_config)
        pieces = build_in_pieces(folder, engine.dtype)
        adapter = None
        while adapter is None:          # each call queues behind the step already submitted, if any
            adapter = await self.stepper.call(next, pieces)
        engine.register_adapter(adapter)
        log.info("loaded adapter %s from %s (%.1f MiB, ranks %s)", msg.name, msg.path, adapter.nbytes / 2**20,
                 adapter.ranks)
        msg.reply.set_result(None)

    def _unload(self, msg: UnloadAdapter) -> None:
        for request_id in self.engine.unload_adapter(msg.name):     # queued for it: can no longer run
            self.scheduler_mailbox.put_nowait(Abort(request_id, failure=adapter_unloaded(msg.name)))
        log.info("unloaded adapter %s", msg.name)
        msg.reply.set_result(None)

    def _prefetch(self, msg: Prefetch) -> None:
        self.engine.prefetch(msg.adapters)
