"""The stepper actor: the only actor that touches the model. Each step runs in a dedicated thread
so the event loop keeps serving HTTP while the model computes."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from asyncserve.messages import RunStep, Shutdown, StepDone
from asyncserve.stepper.runner import ModelRunner

log = logging.getLogger("asyncserve.stepper")


class StepperActor:
    def __init__(self, runner: ModelRunner, scheduler_mailbox: asyncio.Queue):
        self.runner = runner
        self.scheduler_mailbox = scheduler_mailbox
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-step")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await self.mailbox.get()
                if isinstance(msg, Shutdown):
                    return
                assert isinstance(msg, RunStep)
                try:
                    result = await loop.run_in_executor(self._thread, self.runner.run, msg.plan)
                    done = StepDone(msg.step_id, msg.plan, result=result)
                except Exception as e:          # a failed step fails its requests, not the server
                    log.exception("step %d raised", msg.step_id)
                    done = StepDone(msg.step_id, msg.plan, error=e)
                self.scheduler_mailbox.put_nowait(done)
        finally:
            self._thread.shutdown(wait=True)
