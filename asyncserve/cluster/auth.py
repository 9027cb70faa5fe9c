"""Peer authentication: HMAC-SHA256 over the destination, method, path, timestamp, nonce and body with
a shared key.

A call is accepted only if its signature matches (constant-time compare), it names this process as
its destination, its timestamp is within `window_s` of the receiver's clock and its nonce has not
been seen within that window. Nonces are remembered only after the signature checks out, so only
key holders can fill the (bounded) cache, and only until their timestamp leaves the window, after
which the timestamp check refuses a replay.

The destination is the receiver's incarnation, `<node id>@<random token of this process>`: a call
captured on its way to one node is refused by every other node (another id) and by the same node
once it restarted (another token, and an empty nonce cache), however fresh its timestamp. This does
not lean on clocks: restarts are safe whatever the skew, and the window only has to cover the skew
between peers (calls from a peer whose clock is more than `window_s` off are refused as stale). A
caller learns a peer's incarnation from its refusal of a call signed for another (the first call,
or the first after a restart): the 401 carries the incarnation with an HMAC over it and the refused
call's nonce, so only the key's holders can teach it, and the caller retries once.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from typing import Callable, Mapping

TIMESTAMP_HEADER = "X-Asyncserve-Timestamp"
NONCE_HEADER = "X-Asyncserve-Nonce"
SIGNATURE_HEADER = "X-Asyncserve-Signature"
DESTINATION_HEADER = "X-Asyncserve-Destination"
PROOF_HEADER = "X-Asyncserve-Destination-Proof"

_NONCE_RE = re.compile(r"^[0-9a-f]{16,64}$")


class AuthError(Exception):
    """A peer call refused; the message says why (for the 401 body and the log)."""


class WrongDestination(AuthError):
    """A genuine call signed for another incarnation; ``headers`` tell its caller this one's."""

    def __init__(self, message: str, headers: dict[str, str]):
        super().__init__(message)
        self.headers = headers


def new_incarnation(node_id: str) -> str:
    """This process's name as a destination: the node id and a token no other start shares."""
    if "\n" in node_id:
        raise ValueError(f"a node id must be one line, got {node_id!r}")
    return f"{node_id}@{secrets.token_hex(8)}"


def _key_bytes(key: str | bytes) -> bytes:
    key = key.encode() if isinstance(key, str) else bytes(key)
    if not key:
        raise ValueError("the cluster key must not be empty")
    return key


def signature(key: bytes, destination: str, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    # fields separated by newlines, which none of destination, method, path, timestamp or nonce may contain
    head = f"{destination}\n{method.upper()}\n{path}\n{timestamp}\n{nonce}\n".encode(errors="surrogateescape")
    return hmac.new(key, head + body, hashlib.sha256).hexdigest()


def _proof(key: bytes, destination: str, nonce: str) -> str:
    return hmac.new(key, f"destination\n{destination}\n{nonce}".encode(), hashlib.sha256).hexdigest()


class PeerSigner:
    def __init__(self, key: str | bytes, clock: Callable[[], float] = time.time):
        self.key = _key_bytes(key)
        self.clock = clock

    def headers(self, method: str, path: str, body: bytes, destination: str) -> dict[str, str]:
        """destination: the receiver's incarnation as last learned ("" before any)."""
        if "\n" in destination:
            raise ValueError("a destination is one line")
        timestamp = f"{self.clock():.3f}"
        nonce = secrets.token_hex(16)
        return {DESTINATION_HEADER: destination, TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce,
                SIGNATURE_HEADER: signature(self.key, destination, method, path, timestamp, nonce, body)}

    def learned(self, sent: Mapping[str, str], answer: Mapping[str, str]) -> str | None:
        """The receiver's incarnation from its refusal (``answer``'s headers) of the call sent with
        ``sent`` headers, if the refusal proves it holds the key; else None."""
        destination, proof = answer.get(DESTINATION_HEADER), answer.get(PROOF_HEADER)
        if not destination or not proof or "\n" in destination or destination == sent[DESTINATION_HEADER]:
            return None
        if not hmac.compare_digest(_proof(self.key, destination, sent[NONCE_HEADER]), proof):
            return None
        return destination


class PeerVerifier:
    def __init__(self, key: str | bytes, destination: str, window_s: float = 30.0, max_nonces: int = 65536,
                 clock: Callable[[], float] = time.time):
        """destination: this process's incarnation (new_incarnation)."""
        self.key = _key_bytes(key)
        self.destination = destination
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()     # nonce -> when it may be forgotten

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Return if the call is authentic and fresh; raise AuthError otherwise. Changes nothing
        when it raises."""
        destination = headers.get(DESTINATION_HEADER)
        timestamp = headers.get(TIMESTAMP_HEADER)
        nonce = headers.get(NONCE_HEADER)
        sig = headers.get(SIGNATURE_HEADER)
        if destination is None or not timestamp or not nonce or not sig:
            raise AuthError("missing peer signature headers")
        if not _NONCE_RE.match(nonce):
            raise AuthError("malformed nonce")
        try:
            ts = float(timestamp)
        except ValueError:
            raise AuthError("malformed timestamp") from None
        expected = signature(self.key, destination, method, path, timestamp, nonce, body)
        if not hmac.compare_digest(expected, sig):
            raise AuthError("bad signature")
        if destination != self.destination:
            # another node's call, or one to this node before it restarted: never this process's
            raise WrongDestination(f"signed for {destination or 'no destination'}, not this node ({self.destination})",
                                   {DESTINATION_HEADER: self.destination,
                                    PROOF_HEADER: _proof(self.key, self.destination, nonce)})
        now = self.clock()
        if not abs(now - ts) <= self.window_s:        # also refuses nan
            raise AuthError("stale timestamp")
        self._forget_expired(now)
        if nonce in self._seen:
            raise AuthError("replayed nonce")
        if len(self._seen) >= self.max_nonces:
            raise AuthError("too many calls within the replay window")
        self._seen[nonce] = ts + self.window_s

    def _forget_expired(self, now: float) -> None:
        # insertion order is nearly expiry order (timestamps within the window); stop at the first live one
        while self._seen:
            nonce, expiry = next(iter(self._seen.items()))
            if expiry >= now:
                break
            del self._seen[nonce]
