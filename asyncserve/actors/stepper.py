"""The stepper actor: the only actor that touches the model.

It owns the one thread that runs torch: the engine is built there, every step runs there, and so
does the tensor half of adapter loading. The event loop keeps serving HTTP meanwhile. One thread
matters on CPU: each thread that runs torch ops gets its own OpenMP team, and once the process
has more OpenMP threads than cores, libgomp stops spinning between parallel regions, which made
every server step ~1.7x slower than the same step offline (BENCHMARKS.md).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from asyncserve.messages import RunStep, Shutdown, StepDone
from asyncserve.step import EngineFailed, StepPlan, StepResult

log = logging.getLogger("asyncserve.stepper")


class StepperActor:
    def __init__(self):
        self.run_step: Callable[[StepPlan], StepResult] | None = None     # Engine.run, once loaded
        self.scheduler_mailbox: asyncio.Queue | None = None
        self.on_fatal: Callable[[str], None] | None = None                # the server's: stop, exit 1
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncserve-torch")

    async def call(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn`` in the torch thread, between steps."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def attach(self, run_step: Callable[[StepPlan], StepResult], scheduler_mailbox: asyncio.Queue) -> None:
        self.run_step = run_step
        self.scheduler_mailbox = scheduler_mailbox

    async def run(self) -> None:
        try:
            while True:
                msg = await self.mailbox.get()
                if isinstance(msg, Shutdown):
                    return
                assert isinstance(msg, RunStep)
                try:
                    done = StepDone(msg.step_id, msg.plan, result=await self.call(self.run_step, msg.plan))
                except EngineFailed as e:       # no step can run any more: the server stops
                    log.error("step %d: %s", msg.step_id, e)
                    done = StepDone(msg.step_id, msg.plan, error=e)
                    if self.on_fatal is not None:
                        self.on_fatal(str(e))
                except Exception as e:          # a failed step fails its requests, not the server
                    log.exception("step %d raised", msg.step_id)
                    done = StepDone(msg.step_id, msg.plan, error=e)
                self.scheduler_mailbox.put_nowait(done)
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)
