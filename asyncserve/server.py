"""One uvloop process of cooperative actors: ingress (aiohttp), scheduler, pager, stepper.

The HTTP server answers at once (/health is 503 while loading); the model loads in the stepper's
torch thread, then the actors start. A load that fails (bad model, adapter, pool size, ...) stops the
server and exits 1 with the reason logged, so a supervisor sees it and can restart it. SIGINT/SIGTERM:
stop accepting, let in-flight requests finish for ``shutdown_grace_s``, end the rest with a 503
error, stop the actors, exit 0. An engine that can no longer step (a tensor-parallel rank died) ends
every open request with a 503 at once, stops the actors and exits 1.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time

from aiohttp import web

from asyncserve.actors.cluster import ClusterActor
from asyncserve.actors.pager import PagerActor
from asyncserve.actors.scheduler import SchedulerActor
from asyncserve.actors.stepper import StepperActor
from asyncserve.config import Config
from asyncserve.engine import Engine
from asyncserve.ingress.chat_output import ChatFormats
from asyncserve.ingress.resolver import AdapterResolver
from asyncserve.ingress.routes import build_app
from asyncserve.ingress.tokenizing import new_executor
from asyncserve.messages import Abort, Shutdown
from asyncserve.pager.remote import AdapterFetcher
from asyncserve.metrics import Metrics
from asyncserve.step import Failure

log = logging.getLogger("asyncserve.server")


class Server:
    def __init__(self, config: Config, resolver=socket.getaddrinfo):
        self.config = config
        self.resolver = resolver           # how cluster mode resolves dns: peers
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.scheduler: SchedulerActor | None = None
        self.pager: PagerActor | None = None
        self.cluster: ClusterActor | None = None       # cluster mode (config.peers)
        self.stepper = StepperActor()
        self.tokenizer_executor = new_executor()       # large inputs' tokenizing (ingress/tokenizing.py)
        # runtime loads from URLs; trimming the cache leaves the registered adapters' folders
        self.adapter_fetcher = AdapterFetcher(
            config.fetch_limits(), lambda: self.engine.adapter_paths().values() if self.engine is not None else ())
        self.adapter_resolver = None if config.adapter_resolver is None else \
            AdapterResolver(config.adapter_resolver, self.adapter_fetcher)
        self.ready = False
        self.failed: str | None = None
        self.stopping = False
        self.started = int(time.time())
        self._tasks: list[asyncio.Task] = []
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.loading: asyncio.Task | None = None    # done once the server is ready or has failed
        self.fatal = asyncio.Event()                # the engine cannot step any more (a tensor-parallel rank died)
        self.fatal_reason: str | None = None

    async def start(self) -> None:
        """Serve HTTP now; load the model in a thread and start the actors when it is ready."""
        app = build_app(self)
        # handler_cancellation: a client that disconnects cancels its handler, which aborts the request
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        log.info("listening on http://%s:%d", self.config.host, self.port)
        if self.config.peers is not None:
            self.cluster = ClusterActor(self, self.port, self.resolver)
            log.info("cluster mode: node %s at %s, peers %s", self.cluster.node_id, self.cluster.url,
                     self.config.peers)
        self.loading = asyncio.create_task(self._load())
        self._tasks.append(self.loading)

    async def _load(self) -> None:
        config = self.config
        try:
            self.engine = await self.stepper.call(Engine, config)
        except (ValueError, OSError, MemoryError) as e:    # the model, an adapter, a size: the reason says it
            self.failed = str(e) or type(e).__name__
            return
        except Exception as e:                              # a defect: its traceback is for a bug report
            log.debug("start-up failed", exc_info=True)
            self.failed = f"{type(e).__name__}: {e} (--log-level DEBUG shows the traceback)"
            return
        self.scheduler = SchedulerActor(self.engine, self.metrics)
        self.stepper.attach(self.engine.run, self.scheduler.mailbox)
        loop = asyncio.get_running_loop()
        self.stepper.on_fatal = self._fail
        self.engine.on_fatal = lambda reason: loop.call_soon_threadsafe(self._fail, reason)   # a watchdog thread's
        self.pager = PagerActor(self.engine, self.engine.pager, self.scheduler.mailbox, self.stepper)
        self.scheduler.stepper_mailbox = self.stepper.mailbox
        self.scheduler.pager_mailbox = self.pager.mailbox
        for actor in (self.scheduler, self.stepper, self.pager, self.cluster):
            if actor is not None:
                self._tasks.append(asyncio.create_task(actor.run(), name=type(actor).__name__))
        self.metrics.observe_engine(self.engine)
        self.chat_formats = ChatFormats.of(config.tool_call_parser, config.reasoning_parser,
                                           config.enable_auto_tool_choice, self.engine.tokenizer)
        if config.enable_auto_tool_choice and self.chat_formats.tools is None:
            log.warning("--enable-auto-tool-choice: the chat template shows no tool-call format, and no "
                        "--tool-call-parser names one; tool_choice 'auto' will be refused")
        if self.chat_formats.tools is not None or self.chat_formats.reasoning is not None:
            log.info("chat outputs: tool calls in %s format%s, reasoning %s",
                     getattr(self.chat_formats.tools, "name", "no"),
                     "" if config.enable_auto_tool_choice else " (read with --enable-auto-tool-choice)",
                     self.chat_formats.reasoning or "not split")
        self.ready = True
        names = self.engine.adapter_names
        log.info("ready: model %s, %d adapters%s", self.engine.model_name, len(names),
                 f" ({', '.join(names)})" if 0 < len(names) <= 10 else "")

    def _fail(self, reason: str) -> None:
        if self.fatal_reason is None:
            self.fatal_reason = reason
            self.fatal.set()

    async def stop(self, failure: Failure | None = None) -> None:
        """Graceful: no new connections, in-flight requests finish (up to the grace period). failure: the
        engine failed: no grace, every request still open gets it."""
        if self.stopping:
            return
        self.stopping = True
        if self.ready:                     # a failed start-up says only why it failed
            log.info("shutting down")
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()          # stop accepting; open connections keep streaming
        if self.ready:
            self.scheduler.mailbox.put_nowait(Shutdown())
            deadline = time.monotonic() + (0 if failure else self.config.shutdown_grace_s)
            while not (self.scheduler.idle and (self.cluster is None or self.cluster.idle)) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.cluster is not None:
                self.cluster.cut()
            cut = failure or Failure(f"the server shut down before this request finished (grace period "
                                     f"{self.config.shutdown_grace_s:g} s)", 503, "server_shutting_down")
            for rid in list(self.scheduler.streams):
                self.scheduler.mailbox.put_nowait(Abort(rid, failure=cut))
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
        self.tokenizer_executor.shutdown(wait=False, cancel_futures=True)
        self.adapter_fetcher.close()
        if self.engine is not None:
            self.engine.close()            # the host tier's shared memory, now that no thread uses it
        if self.ready:
            log.info("stopped")


async def serve(config: Config) -> int:
    """Serve until SIGINT/SIGTERM (exit status 0) or a failed start-up (1)."""
    server = Server(config)
    try:
        await server.start()
    except OSError as e:                   # cannot listen: the port is taken, not ours, or the host is wrong
        log.error("could not start: %s", listen_failure(config.host, config.port, e))
        await server.stop()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, server.loading], return_when=asyncio.FIRST_COMPLETED)
    if server.failed:
        log.error("could not start: %s", server.failed)
        stopping.cancel()
        await server.stop()
        return 1
    fatal = asyncio.create_task(server.fatal.wait())
    await asyncio.wait([stopping, fatal], return_when=asyncio.FIRST_COMPLETED)
    if server.fatal_reason is not None:
        log.error("stopping: %s", server.fatal_reason)
        stopping.cancel()
        await server.stop(Failure(f"the server stopped: {server.fatal_reason}", 503, "engine_failed"))
        return 1
    fatal.cancel()
    await server.stop()
    return 0


def listen_failure(host: str, port: int, e: OSError) -> str:
    """One line on why the server cannot listen on host:port, and what to do."""
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use by another process: stop it (`ss -ltnp 'sport = :{port}'` "
                f"shows which) or choose another port with --port")
    if e.errno == errno.EACCES:
        return f"no permission to listen on port {port}: choose a port above 1023 with --port"
    if e.errno == errno.EADDRNOTAVAIL or isinstance(e, socket.gaierror):
        return f"cannot listen on host {host!r} ({e.strerror or e}): give an address of this machine with --host"
    return f"cannot listen on {host}:{port}: {e}"


def run(config: Config) -> int:
    import uvloop

    return uvloop.run(serve(config))
