"""The cluster actor: peers gossip load, route requests to each other, move running ones, and
outlive a dead peer (cluster mode: --peers).

Every gossip interval it pushes this node's Digest to every peer (signed POST /cluster/gossip) and
refreshes the peer table (cluster/membership.py). For each new request the ingress asks it where
to run (cluster/routing.py's Router over the digests). A request sent to a peer is a Forward: this
node keeps the client's connection and relays the TokenEvents that the peer streams back from
/cluster/forward onto the request's stream, as the scheduler would. A Forward whose peer dies,
stalls past the dead time or answers garbage is resubmitted with its tokens so far to a live peer
or to this node; one that its peer moved (Moved) continues where it went.

A request for an adapter runs on a peer only as its content here (cluster/adapters.py): the
envelope carries its digest, and until this node has hashed it the request stays here. A peer that
lacks the adapter fetches it from this node; one that holds another copy, or cannot fetch it,
refuses the request, and for ADAPTER_REFUSAL_TTL_S it is sent no more of that adapter's requests
(nor moved any by migration).

When the predicted pending times spread past the threshold and this node is the busiest,
dLoRA's integer program (cluster/migration.py) picks which of its requests move where. Each is
taken out of the scheduler between steps (Export) with every token it generated already on its
stream, and continues on the target by recompute: a request whose client is here becomes a
Forward; one run for another origin is handed back to its origin as Moved, which forwards it on.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from asyncserve.actors.pager import FETCHERS
from asyncserve.cluster.adapters import AdapterDigests, PeerAdapters
from asyncserve.cluster.auth import PeerSigner, PeerVerifier, new_incarnation
from asyncserve.cluster.membership import Membership, PeerState
from asyncserve.cluster.messages import AdapterTiers, Digest, ForwardedRequest, ForwardLine, Moved
from asyncserve.cluster.migration import MAX_MIGRATIONS, Candidate, CoMigrator
from asyncserve.cluster.routing import POLICIES, RouteRequest, Router, cluster_coefficients
from asyncserve.engine import RequestError
from asyncserve.messages import Export, LoadAdapter, Submit, TokenEvent
from asyncserve.pager.adapters import AdapterError
from asyncserve.perf_model import QueuedWork, drain_seconds, expected_remaining_tokens, fetch_backlog_seconds
from asyncserve.sequence import Sequence
from asyncserve.step import Failure

log = logging.getLogger("asyncserve.cluster")

MAX_RESUBMITS = 4          # peers a request may lose before it fails
ADAPTER_REFUSAL_TTL_S = 60.0   # a peer that refused an adapter is sent none of its requests this long
# the codes of a peer's refusals of a request's adapter: another copy, or none it could fetch
ADAPTER_REFUSALS = ("adapter_mismatch", "adapter_unavailable")
RESPONSE_LINE_LIMIT = 64 * 2**20
_line_decoder = msgspec.json.Decoder(ForwardLine)

NO_LIVE_NODE = Failure("every server this request was sent to failed", 503, "server_unavailable")
SHUT_DOWN = Failure("the server shut down before this request finished", 503, "server_shutting_down")


class PeerFailed(Exception):
    """A peer broke off a request (died, stalled, garbage, shut down): resubmit it elsewhere."""


class PeerRefused(Exception):
    """A peer would not take a request (busy, loading, another model, another copy of its adapter):
    send it elsewhere. ``code``: the refusal's error code, if it said one."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class Forward:
    """A request whose client is here and which runs on a peer."""
    envelope: ForwardedRequest         # its output_ids grow with every token relayed
    stream: asyncio.Queue              # the client's TokenEvents (read by the ingress relay)
    node_id: str                       # where it runs now
    url: str
    rank: int                          # its adapter's (0: the base model), for rerouting
    tried: set[str] = field(default_factory=set)   # nodes that failed or refused it
    task: asyncio.Task | None = None
    attempt: asyncio.Task | None = None            # the current call to node_id


def _error_code(text: str) -> str | None:
    """The code of an error body in OpenAI's shape, if it is one."""
    try:
        error = msgspec.json.decode(text).get("error")
        return error.get("code") if isinstance(error, dict) else None
    except (msgspec.DecodeError, AttributeError):
        return None


class ClusterActor:
    def __init__(self, server, port: int, resolver=socket.getaddrinfo):
        config = server.config
        self.server = server
        self.metrics = server.metrics
        self.node_id = config.node_id or f"{socket.gethostname()}:{port}"
        host = config.host if config.host not in ("0.0.0.0", "::", "") else socket.gethostbyname(socket.gethostname())
        self.url = (config.advertise_url or f"http://{host}:{port}").rstrip("/")
        self.interval = config.gossip_interval_s
        self.membership = Membership(self.url, config.peers, self.interval, resolver=resolver)
        self.membership.self_id = self.node_id
        self.signer = PeerSigner(config.cluster_key)
        self.destination = new_incarnation(self.node_id)      # what peers' calls to this process must name
        self.verifier = PeerVerifier(config.cluster_key, self.destination)
        self._destinations: dict[str, str] = {}      # peer url -> its incarnation, as learned
        self.router = Router(self.node_id, POLICIES[config.dispatch](), horizon_s=self.interval)
        self.migrator = CoMigrator(threshold_s=config.migration_threshold_s) if config.migration_threshold_s > 0 else None
        self.rebalance_every_s = max(1.0, 5 * self.interval)
        self.forwards: dict[str, Forward] = {}     # request id -> its Forward (clients here, run elsewhere)
        self.served: set[str] = set()               # request ids run here for another origin
        self._exporting: set[str] = set()
        self._abandoned: set[str] = set()           # clients that left while their request was being exported
        # digests are numbered from the clock in ms, a few per second: a restarted node (same id, new
        # process) starts past its old numbers, so its peers do not take its digests for stale ones
        self._seq = int(time.time() * 1000)
        self._node_of: dict[str, str] = {}          # peer url -> node id
        self._session: aiohttp.ClientSession | None = None
        self._next_rebalance = 0.0
        self._rebalancing: asyncio.Task | None = None
        # the engine is loaded after the actors are made
        self.adapter_digests = AdapterDigests(lambda name: server.engine.adapter_source(name),
                                              lambda: server.engine.adapter_paths().keys(),
                                              lambda: server.engine.adapter_registry_version())
        self.peer_adapters: PeerAdapters | None = None          # with the session, in run()
        self._adapter_refusals: dict[str, dict[str, float]] = {}   # adapter -> {node id: until (monotonic)}

    # ---- the gossip loop -----------------------------------------------------------------------
    async def run(self) -> None:
        # no cap on connections: each forwarded request holds one for as long as it streams
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
        self.peer_adapters = PeerAdapters(self.server.config.fetch_limits(), self._post, self._load_fetched,
                                          lambda: self.server.engine.adapter_paths().values())
        loop = asyncio.get_running_loop()
        try:
            while True:
                start = loop.time()
                self._refresh()
                self.adapter_digests.refresh()
                digest = self.digest()
                self.router.view.update(digest, time.monotonic())
                await self._push(digest)
                if self.migrator is not None and start >= self._next_rebalance and \
                        (self._rebalancing is None or self._rebalancing.done()):
                    self._next_rebalance = start + self.rebalance_every_s
                    self._rebalancing = asyncio.ensure_future(self._rebalance())    # the gossip goes on meanwhile
                await asyncio.sleep(max(0.0, start + self.interval - loop.time()))
        finally:
            if self._rebalancing is not None:
                self._rebalancing.cancel()
            self.adapter_digests.close()
            self.peer_adapters.close()
            await self._session.close()

    def _refresh(self) -> None:
        for url, _, new in self.membership.refresh():
            if new is PeerState.ALIVE:
                continue
            node_id = self._node_of.get(url)
            if node_id is not None:
                self.router.view.remove(node_id)
            if new is not PeerState.SUSPECT:        # dead or gone: its requests go elsewhere now
                if node_id is not None:             # (one that never spoke is only not up yet)
                    log.warning("peer %s (%s) is %s", node_id, url, "dead" if new else "gone")
                for fwd in self.forwards.values():
                    if fwd.url == url and fwd.attempt is not None:
                        fwd.attempt.cancel()
        self.metrics.peers_alive.set(len(self.membership.alive()))

    def digest(self) -> Digest:
        engine = self.server.engine
        load = engine.load_snapshot()
        seqs = engine.unfinished()
        running = seqs[:load.running]
        parked_by_adapter = engine.parked_requests()
        parked = [seq for waiting in parked_by_adapter for seq in waiting]   # their adapters are on disk
        c = cluster_coefficients(engine.step_coefficients, engine.step_model_measured, engine.mean_disk_load_seconds,
                                 [d for node_id, d in self.router.view.digests.items() if node_id != self.node_id])
        mean = self.server.scheduler.mean_output

        def work(seq: Sequence) -> QueuedWork:
            return QueuedWork(seq.num_tokens - seq.num_computed if seq.in_prefill else 0,
                              expected_remaining_tokens(len(seq.output_ids), mean, seq.params.max_tokens),
                              seq.adapter_rank, seq.num_computed)
        windows = engine.layer_windows
        cold = [waiting[0].adapter_rank for waiting in parked_by_adapter if waiting]
        tiers = engine.adapter_tiers()
        self._seq += 1
        return Digest(node_id=self.node_id, url=self.url, seq=self._seq, timestamp=time.time(),
                      waiting=load.waiting, running=load.running,
                      pending_seconds=drain_seconds(c, [work(s) for s in seqs], [work(s) for s in parked],
                                                    fetch_backlog_seconds(c, cold, FETCHERS), engine.max_running,
                                                    windows),
                      free_pages=load.pool.free, page_tokens=engine.block_size, max_running=engine.max_running,
                      running_rank_sum=sum(s.adapter_rank for s in running),
                      running_rank_max=max((s.adapter_rank for s in running), default=0),
                      adapters=AdapterTiers(device=sorted(n for n, (t, _) in tiers.items() if t == "device"),
                                            host=sorted(n for n, (t, _) in tiers.items() if t == "host")),
                      coefficients=c, measured=engine.step_model_measured,
                      routed_per_s=self.router.arrivals.rate(time.monotonic()), layer_windows=windows)

    async def _push(self, digest: Digest) -> None:
        """The digest to every peer (dead ones too, so they can rejoin); a peer that does not answer
        within the interval is suspect until it speaks again."""
        body = msgspec.json.encode(digest)
        urls = self.membership.urls()
        if not urls:
            return
        calls = {asyncio.ensure_future(self._call(url, "/cluster/gossip", body)): url for url in urls}
        done, pending = await asyncio.wait(calls, timeout=self.interval)
        for task in pending:
            task.cancel()
        for task in calls:
            if task in pending or task.exception() is not None:
                self.membership.call_failed(calls[task])
                if (node_id := self._node_of.get(calls[task])) is not None:
                    self.router.view.remove(node_id)

    async def _call(self, url: str, path: str, body: bytes) -> None:
        async with await self._post(url, path, body) as resp:
            await resp.read()
            if resp.status >= 300:
                raise PeerRefused(f"{url}{path}: HTTP {resp.status}")

    async def _post(self, url: str, path: str, body: bytes) -> aiohttp.ClientResponse:
        """A signed POST to a peer, signed for its incarnation as last learned. A peer that is not that
        incarnation (first contact, or it restarted) refuses with its own, proven with the key: learned,
        and the call is made once more."""
        def post(headers: dict[str, str]):
            return self._session.post(url + path, data=body, headers={**headers, "Content-Type": "application/json"})
        headers = self.signer.headers("POST", path, body, self._destinations.get(url, ""))
        resp = await post(headers)
        learned = self.signer.learned(headers, resp.headers) if resp.status == 401 else None
        if learned is None:
            return resp
        resp.release()
        self._destinations[url] = learned
        return await post(self.signer.headers("POST", path, body, learned))

    def heard(self, digest: Digest) -> None:
        """A digest a peer pushed (its signature already checked)."""
        if self.membership.heard(digest):
            self._node_of[digest.url.rstrip("/")] = digest.node_id
            self.router.view.update(digest, time.monotonic())

    # ---- dispatch ----------------------------------------------------------------------------
    def live_nodes(self) -> set[str]:
        """This node and the live peers that have spoken."""
        return {self.node_id} | {p.digest.node_id for p in self.membership.alive() if p.digest is not None}

    def nodes_for(self, adapter: str | None) -> set[str]:
        """Where a request for ``adapter`` may run: only here until this node has hashed the adapter (a
        peer could not check its copy against it); else the live nodes but the peers that refused the
        adapter lately (another copy of it, or none they could fetch)."""
        if adapter is None:
            return self.live_nodes()
        if self.adapter_digests.known(adapter) is None:
            self.adapter_digests.start(adapter)      # registered a moment ago: its next requests may go
            return {self.node_id}
        return self.live_nodes() - self.adapter_refusers(adapter)

    def adapter_refusers(self, adapter: str) -> set[str]:
        now = time.monotonic()
        return {node for node, until in self._adapter_refusals.get(adapter, {}).items() if until > now}

    def _adapter_refused(self, node_id: str, adapter: str) -> None:
        refusals = self._adapter_refusals.setdefault(adapter, {})
        now = time.monotonic()
        for node in [n for n, until in refusals.items() if until <= now]:     # bounded by the live peers
            del refusals[node]
        refusals[node_id] = now + ADAPTER_REFUSAL_TTL_S

    def _envelope(self, seq: Sequence) -> ForwardedRequest:
        """What a peer needs to run or continue ``seq`` exactly, its adapter's digest here included."""
        digest = self.adapter_digests.known(seq.adapter) if seq.adapter is not None else None
        return ForwardedRequest(request_id=seq.request_id, origin=self.node_id, model=self.server.engine.model_name,
                                adapter=seq.adapter, prompt_ids=seq.prompt_ids, params=seq.params, seed=seq.seed,
                                output_ids=list(seq.output_ids), migrations=seq.migrations, adapter_digest=digest)

    async def _load_fetched(self, name: str, folder: str) -> None:
        """Register an adapter fetched from a peer, as /v1/load_lora_adapter would; one registered
        meanwhile under that name is kept (its digest decides whether the request runs on it)."""
        self.metrics.peer_adapters.labels("fetched").inc()
        engine = self.server.engine
        if engine.has_adapter(name):
            return
        reply = asyncio.get_running_loop().create_future()
        self.server.pager.mailbox.put_nowait(LoadAdapter(name, folder, reply))
        try:
            await reply
        except AdapterError:
            if not engine.has_adapter(name):
                raise

    def dispatch(self, seqs: list[Sequence], streams: list[asyncio.Queue]) -> bool:
        """Where a new request's sequences (its prompts x n samples) run, all on one node. False: here
        (the caller submits them); True: they were forwarded to a peer and their events will come on
        `streams`."""
        first = seqs[0]
        expected = expected_remaining_tokens(0, self.server.scheduler.mean_output, first.params.max_tokens)
        req = RouteRequest(first.adapter, first.adapter_rank, sum(len(s.prompt_ids) for s in seqs),
                           expected * len(seqs))
        target = self.router.route(req, time.monotonic(), self.nodes_for(first.adapter))
        peer = self.membership.by_node_id(target) if target != self.node_id else None
        if peer is None:
            return False
        for seq, stream in zip(seqs, streams):
            self._start(Forward(self._envelope(seq), stream, target, peer.url, seq.adapter_rank))
        self.metrics.requests_forwarded.labels(target).inc(len(seqs))
        return True

    def abort(self, request_id: str) -> None:
        """The client went away: stop relaying (closing the call makes the peer abort it)."""
        fwd = self.forwards.pop(request_id, None)
        if fwd is not None and fwd.task is not None:
            fwd.task.cancel()
        if request_id in self._exporting:
            self._abandoned.add(request_id)

    @property
    def idle(self) -> bool:
        return not self.forwards

    # ---- forwards ----------------------------------------------------------------------------
    def _start(self, fwd: Forward) -> None:
        self.forwards[fwd.envelope.request_id] = fwd
        fwd.task = asyncio.ensure_future(self._relay(fwd))

    async def _relay(self, fwd: Forward) -> None:
        rid = fwd.envelope.request_id
        try:
            while fwd.node_id != self.node_id:
                fwd.attempt = asyncio.ensure_future(self._stream_from(fwd))
                try:
                    moved = await fwd.attempt
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise                   # the client went away
                    failure: Exception | None = PeerFailed(f"peer {fwd.node_id} was declared dead")
                except PeerRefused as e:
                    failure = e
                    if e.code in ADAPTER_REFUSALS and fwd.envelope.adapter is not None:
                        self._adapter_refused(fwd.node_id, fwd.envelope.adapter)
                        self.metrics.peer_adapters.labels("refused").inc()
                except (PeerFailed, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                    # ValueError: msgspec's DecodeError and ValidationError (garbage), a line too long
                    failure = PeerFailed(f"{type(e).__name__}: {e}")
                else:
                    if moved is None:
                        return                  # finished there
                    fwd.envelope.migrations += 1
                    fwd.node_id, fwd.url = moved.node_id, moved.url.rstrip("/")
                    fwd.tried.discard(fwd.node_id)
                    continue
                log.warning("request %s on %s: %s; %d tokens so far", rid, fwd.node_id, failure,
                            len(fwd.envelope.output_ids))
                fwd.tried.add(fwd.node_id)
                if isinstance(failure, PeerFailed):
                    self.membership.call_failed(fwd.url)
                    self.router.view.remove(fwd.node_id)
                    self.metrics.migrations.labels("resubmit").inc()
                if len(fwd.tried) > MAX_RESUBMITS:
                    self._fail(fwd, NO_LIVE_NODE)
                    return
                self._reroute(fwd)
            self._continue_here(fwd)
        finally:
            if self.forwards.get(rid) is fwd:
                del self.forwards[rid]

    async def _stream_from(self, fwd: Forward) -> Moved | None:
        """Call the peer and relay its lines; returns where it moved the request, or None when the
        request finished there."""
        body = msgspec.json.encode(fwd.envelope)
        async with await self._post(fwd.url, "/cluster/forward", body) as resp:
            if resp.status != 200:
                text = (await resp.content.read(4096)).decode(errors="replace")
                if resp.status == 401 or resp.status >= 500 and resp.status != 503:
                    raise PeerFailed(f"HTTP {resp.status}: {text}")
                raise PeerRefused(f"HTTP {resp.status}: {text}", _error_code(text))
            buf = bytearray()
            async for chunk in resp.content.iter_any():
                buf += chunk
                while (end := buf.find(b"\n")) >= 0:
                    line = _line_decoder.decode(bytes(buf[:end]))
                    del buf[:end + 1]
                    if line.moved is not None:
                        return line.moved
                    event = line.event
                    if event is None:
                        raise PeerFailed("a line with neither an event nor a move")
                    if event.finished and event.error is not None and event.error.code == "server_shutting_down":
                        raise PeerFailed("the peer is shutting down")
                    fwd.envelope.output_ids += event.token_ids
                    fwd.stream.put_nowait(event)
                    if event.finished:
                        return None
                if len(buf) > RESPONSE_LINE_LIMIT:
                    raise PeerFailed("a line past the size limit")
        raise PeerFailed("the stream ended before the request did")

    def _reroute(self, fwd: Forward) -> None:
        """Where a request goes after its peer failed or refused it: the router's choice among the
        live nodes that have not failed it (this node at worst)."""
        env = fwd.envelope
        expected = expected_remaining_tokens(len(env.output_ids), self.server.scheduler.mean_output,
                                             env.params.max_tokens)
        req = RouteRequest(env.adapter, fwd.rank, len(env.prompt_ids) + len(env.output_ids), expected)
        target = self.router.route(req, time.monotonic(), (self.nodes_for(env.adapter) - fwd.tried) | {self.node_id})
        peer = self.membership.by_node_id(target) if target != self.node_id else None
        fwd.node_id, fwd.url = (target, peer.url) if peer is not None else (self.node_id, self.url)

    def _continue_here(self, fwd: Forward) -> None:
        """Run a request that came back (moved here, or its peers failed) on this node."""
        env = fwd.envelope
        engine = self.server.engine
        try:
            seq = engine.adopt(env.prompt_ids, env.output_ids, env.params, env.adapter, env.request_id, env.seed,
                               arrival=time.monotonic())
        except RequestError as e:
            self._fail(fwd, Failure(str(e), e.status, "model_not_found" if e.status == 404 else "invalid_value"))
            return
        seq.migrations = env.migrations
        self.server.scheduler.mailbox.put_nowait(Submit(seq, fwd.stream))

    def _fail(self, fwd: Forward, failure: Failure) -> None:
        env = fwd.envelope
        fwd.stream.put_nowait(TokenEvent(request_id=env.request_id, token_ids=[], text="", finished=True,
                                         finish_reason="error", num_prompt_tokens=len(env.prompt_ids),
                                         num_output_tokens=len(env.output_ids), error=failure))

    # ---- migration ---------------------------------------------------------------------------
    def candidates(self, limit: int) -> list[Candidate]:
        """This node's newest requests (Punica moves the newest), waiting ones first, that may still move."""
        mean = self.server.scheduler.mean_output
        out = []
        seqs = self.server.engine.unfinished()
        for seq in reversed(seqs):
            if len(out) >= limit:
                break
            if seq.migrations >= MAX_MIGRATIONS or seq.request_id in self._exporting:
                continue
            if seq.adapter is not None and self.adapter_digests.known(seq.adapter) is None:
                continue            # a peer could not check its copy of the adapter against this one's
            out.append(Candidate(seq.request_id, self.node_id, seq.adapter, seq.adapter_rank,
                                 seq.num_tokens - seq.num_computed if seq.in_prefill else 0, seq.num_tokens,
                                 expected_remaining_tokens(len(seq.output_ids), mean, seq.params.max_tokens),
                                 seq.migrations,
                                 frozenset(self.adapter_refusers(seq.adapter)) if seq.adapter else frozenset()))
        return out

    async def _rebalance(self) -> None:
        """dLoRA's co-migration round, run by each node for its own requests when it is the busiest
        (CoMigrator.mover): the MILP (in a worker thread: it may take up to its time limit) picks the moves."""
        live = self.live_nodes()
        loads = [n for n in self.router.view.loads() if n.node_id in live]
        if self.migrator.mover(loads) != self.node_id:
            return
        candidates = self.candidates(self.migrator.top_k_requests)
        if not candidates:
            return
        try:
            plan = await asyncio.to_thread(self.migrator.plan, loads, candidates)
        except Exception:               # a planning bug must not stop the gossip: no moves this round
            log.exception("migration planning failed")
            return
        if plan.moves:
            log.info("migration: %d moves, makespan %.2f s -> %.2f s (MILP %.1f ms)", len(plan.moves),
                     plan.makespan_before, plan.makespan_after, plan.solve_seconds * 1e3)
            self._next_rebalance += 2 * self.rebalance_every_s     # let the digests show the moves first
        adapter_of = {c.request_id: c.adapter for c in candidates}
        moved = {(adapter_of[move.request_id], move.target) for move in plan.moves
                 if await self.move(move.request_id, move.target)}
        for load in plan.loads:             # the adapter loads that moves made happen
            if load in moved:
                self.metrics.migrations.labels("adapter").inc()

    async def move(self, request_id: str, target: str) -> bool:
        """Move one of this node's requests to peer `target` (the node id); False if it is no longer
        here or the target is not a live peer."""
        peer = self.membership.by_node_id(target)
        if peer is None or peer.state is not PeerState.ALIVE or request_id in self._exporting:
            return False
        reply = asyncio.get_running_loop().create_future()
        self._exporting.add(request_id)
        try:
            self.server.scheduler.mailbox.put_nowait(Export(request_id, reply))
            taken = await reply
        finally:
            self._exporting.discard(request_id)
            abandoned = request_id in self._abandoned      # its client left meanwhile: drop it
            self._abandoned.discard(request_id)
        if taken is None or abandoned:
            return False
        seq, stream = taken
        self.metrics.migrations.labels("request").inc()
        log.info("request %s moves to %s after %d tokens", request_id, target, len(seq.output_ids))
        if request_id in self.served:           # its origin continues it there
            stream.put_nowait(Moved(target, peer.url))
        else:
            seq.migrations += 1
            self._start(Forward(self._envelope(seq), stream, target, peer.url, seq.adapter_rank))
        return True

    # ---- shutdown ----------------------------------------------------------------------------
    def cut(self) -> None:
        """End the requests still relayed from peers (the grace period is over)."""
        for fwd in list(self.forwards.values()):
            fwd.task.cancel()
            self._fail(fwd, SHUT_DOWN)
        self.forwards.clear()
