"""One uvloop process of cooperative actors: ingress (aiohttp), scheduler, pager, stepper.

The HTTP server answers at once (/health is 503 while loading); the model loads in the stepper's
torch thread, then the actors start. SIGINT/SIGTERM: stop accepting, let in-flight requests finish for
``shutdown_grace_s``, abort the rest, stop the actors, exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path

from aiohttp import web

from asyncserve.config import Config
from asyncserve.engine import Engine
from asyncserve.ingress.app import build_app
from asyncserve.messages import Abort, Shutdown
from asyncserve.metrics import Metrics
from asyncserve.pager.actor import PagerActor
from asyncserve.scheduler.actor import SchedulerActor
from asyncserve.stepper.actor import StepperActor

log = logging.getLogger("asyncserve.server")


def adapters_in_dir(folder: str) -> dict[str, str]:
    """Every sub-folder holding an adapter_config.json, named after the folder."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--adapter-dir {folder} is not a folder")
    return {p.name: str(p) for p in sorted(root.iterdir()) if (p / "adapter_config.json").is_file()}


class Server:
    def __init__(self, config: Config):
        self.config = config
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.scheduler: SchedulerActor | None = None
        self.pager: PagerActor | None = None
        self.stepper = StepperActor()
        self.ready = False
        self.failed: str | None = None
        self.stopping = False
        self.started = int(time.time())
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        """Serve HTTP now; load the model in a thread and start the actors when it is ready."""
        app = build_app(self, self.config.api_key, self.config.max_body_bytes)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the request
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("listening on http://%s:%d", self.config.host, self.port)
        self._tasks.append(asyncio.create_task(self._load()))

    async def _load(self) -> None:
        config = self.config
        try:
            if config.adapter_dir:
                config.adapters = {**adapters_in_dir(config.adapter_dir), **config.adapters}
            self.engine = await self.stepper.call(Engine, config)
        except Exception as e:
            log.exception("model loading failed")
            self.failed = f"{type(e).__name__}: {e}"
            return
        self.scheduler = SchedulerActor(self.engine, self.metrics)
        self.stepper.attach(self.engine.runner, self.scheduler.mailbox)
        self.pager = PagerActor(self.engine, self.scheduler.mailbox, self.stepper)
        self.scheduler.stepper_mailbox = self.stepper.mailbox
        self.scheduler.pager_mailbox = self.pager.mailbox
        for actor in (self.scheduler, self.stepper, self.pager):
            self._tasks.append(asyncio.create_task(actor.run(), name=type(actor).__name__))
        self.metrics.observe_engine(self.engine)
        self.ready = True
        log.info("ready: model %s, adapters %s", self.engine.model_name, ", ".join(self.engine.adapter_names) or "-")

    async def stop(self) -> None:
        """Graceful: no new connections, in-flight requests finish (up to the grace period)."""
        if self.stopping:
            return
        self.stopping = True
        log.info("shutting down")
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()          # stop accepting; open connections keep streaming
        if self.ready:
            self.scheduler.mailbox.put_nowait(Shutdown())
            deadline = time.monotonic() + self.config.shutdown_grace_s
            while not self.scheduler.idle and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for rid in list(self.scheduler.streams):
                self.scheduler.mailbox.put_nowait(Abort(rid))
            self.scheduler.mailbox.put_nowait(Shutdown())
            self.stepper.mailbox.put_nowait(Shutdown())
            self.pager.mailbox.put_nowait(Shutdown())
        if self._runner is not None:
            await self._runner.cleanup()   # closes connections once their handlers return
        for task in self._tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if not self.ready:                 # the stepper actor never ran; its thread may hold a failed load
            self.stepper.shutdown()
        log.info("stopped")


async def serve(config: Config) -> None:
    server = Server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def run(config: Config) -> None:
    import uvloop

    uvloop.run(serve(config))
