"""The peer table: who the peers are, what each last said, and whether it is alive.

Peers come from a list of URLs and/or `dns:NAME:PORT` entries; a DNS entry is re-resolved every
`resolve_every_s` (a Kubernetes headless Service answers with one address per ready pod) through an
injectable resolver with socket.getaddrinfo's signature. A peer silent for `suspect_after` gossip
intervals is suspect, for `dead_after` dead; it is alive again as soon as it speaks. A peer whose
call failed (timeout, garbage) is suspect until it speaks again.
"""
from __future__ import annotations

import enum
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable

from asyncserve.cluster.messages import Digest

log = logging.getLogger("asyncserve.cluster")


class PeerState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass
class Peer:
    url: str
    last_heard: float                  # when it last spoke (or was discovered, before it ever did)
    digest: Digest | None = None
    from_dns: str | None = None        # the dns: entry that named it, if any
    failed: bool = False               # a call to it failed since it last spoke
    state: PeerState = PeerState.ALIVE


def parse_peer_spec(spec: str) -> tuple[list[str], list[tuple[str, int]]]:
    """'http://a:1,dns:svc.ns:8000' -> (urls, [(dns name, port)])."""
    urls, names = [], []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item.startswith("dns:"):
            name, sep, port = item[4:].rpartition(":")
            if not sep or not name or not port.isdigit():
                raise ValueError(f"a DNS peer entry is dns:NAME:PORT, got {item!r}")
            names.append((name, int(port)))
        elif item.startswith(("http://", "https://")):
            urls.append(item.rstrip("/"))
        else:
            raise ValueError(f"a peer is an http(s) URL or dns:NAME:PORT, got {item!r}")
    return urls, names


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Membership:
    def __init__(self, self_url: str, peers: str | list[str], gossip_interval_s: float = 0.2,
                 suspect_after: int = 3, dead_after: int = 10, resolve_every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, resolver: Callable = socket.getaddrinfo):
        spec = peers if isinstance(peers, str) else ",".join(peers)
        urls, self.dns_names = parse_peer_spec(spec)
        self.self_urls = {self_url.rstrip("/")}
        self.self_id: str | None = None
        self.interval = gossip_interval_s
        self.suspect_after = suspect_after
        self.dead_after = dead_after
        self.resolve_every_s = resolve_every_s
        self.clock = clock
        self.resolver = resolver
        self.peers: dict[str, Peer] = {}
        self._last_resolve = float("-inf")
        now = clock()
        for url in urls:
            if url not in self.self_urls:
                self.peers[url] = Peer(url, now)
        self.refresh()

    # ---- discovery ---------------------------------------------------------------------------
    def refresh(self) -> list[tuple[str, PeerState | None, PeerState | None]]:
        """Re-resolve DNS entries when due and recompute states. Returns the changes as
        (url, old state, new state), None for a peer added or removed."""
        now = self.clock()
        changes = []
        if self.dns_names and now - self._last_resolve >= self.resolve_every_s:
            self._last_resolve = now
            changes += self._resolve(now)
        for peer in self.peers.values():
            new = self._state(peer, now)
            if new is not peer.state:
                changes.append((peer.url, peer.state, new))
                peer.state = new
        return changes

    def _resolve(self, now: float) -> list:
        changes = []
        for name, port in self.dns_names:
            entry = f"dns:{name}:{port}"
            try:
                infos = self.resolver(name, port, type=socket.SOCK_STREAM)
            except OSError as e:                # keep what we had: DNS hiccups must not drop peers
                log.warning("resolving %s failed: %s", entry, e)
                continue
            found = {_url(info[4][0], port) for info in infos} - self.self_urls
            for url in sorted(found - self.peers.keys()):
                self.peers[url] = Peer(url, now, from_dns=entry)
                changes.append((url, None, PeerState.ALIVE))
            for url in [u for u, p in self.peers.items() if p.from_dns == entry and u not in found]:
                changes.append((url, self.peers.pop(url).state, None))
        return changes

    # ---- what peers say ---------------------------------------------------------------------
    def heard(self, digest: Digest) -> bool:
        """Record a digest pushed by (or fetched from) a peer. Returns False for one that is older
        than what we have, or is our own (our address seen through DNS)."""
        url = digest.url.rstrip("/")
        if self.self_id is not None and digest.node_id == self.self_id:
            self.self_urls.add(url)
            self.peers.pop(url, None)
            return False
        peer = self.peers.get(url)
        if peer is None:                    # a peer that lists us though we do not list it
            peer = self.peers[url] = Peer(url, self.clock())
        elif (peer.digest is not None and peer.digest.node_id == digest.node_id
              and digest.seq <= peer.digest.seq):
            return False
        peer.digest = digest
        peer.last_heard = self.clock()
        peer.failed = False
        peer.state = PeerState.ALIVE
        return True

    def call_failed(self, url: str) -> None:
        """A call to the peer timed out or got garbage: suspect until it speaks again."""
        peer = self.peers.get(url.rstrip("/"))
        if peer is not None:
            peer.failed = True
            if peer.state is PeerState.ALIVE:
                peer.state = PeerState.SUSPECT

    def _state(self, peer: Peer, now: float) -> PeerState:
        silent = now - peer.last_heard
        if silent >= self.dead_after * self.interval:
            return PeerState.DEAD
        if peer.failed or silent >= self.suspect_after * self.interval:
            return PeerState.SUSPECT
        return PeerState.ALIVE

    # ---- views ----------------------------------------------------------------------------------
    def urls(self) -> list[str]:
        """Everyone to gossip to: alive and suspect peers, and dead ones too (so they can rejoin)."""
        return sorted(self.peers)

    def alive(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.state is PeerState.ALIVE]

    def alive_digests(self) -> list[Digest]:
        return [p.digest for p in self.alive() if p.digest is not None]

    def by_node_id(self, node_id: str) -> Peer | None:
        for p in self.peers.values():
            if p.digest is not None and p.digest.node_id == node_id:
                return p
        return None
