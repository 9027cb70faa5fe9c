"""Peer authentication: HMAC-SHA256 over method, path, timestamp, nonce and body with a shared key.

A call is accepted only if its signature matches (constant-time compare), its timestamp is within
`window_s` of the receiver's clock and its nonce has not been seen within that window. Nonces are
remembered only after the signature checks out, so only key holders can fill the (bounded) cache,
and only until their timestamp leaves the window, after which the timestamp check refuses a replay.
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

_NONCE_RE = re.compile(r"^[0-9a-f]{16,64}$")


class AuthError(Exception):
    """A peer call refused; the message says why (for the 401 body and the log)."""


def _key_bytes(key: str | bytes) -> bytes:
    key = key.encode() if isinstance(key, str) else bytes(key)
    if not key:
        raise ValueError("the cluster key must not be empty")
    return key


def signature(key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    # fields separated by newlines, which none of method, path, timestamp or nonce may contain
    head = f"{method.upper()}\n{path}\n{timestamp}\n{nonce}\n".encode()
    return hmac.new(key, head + body, hashlib.sha256).hexdigest()


class PeerSigner:
    def __init__(self, key: str | bytes, clock: Callable[[], float] = time.time):
        self.key = _key_bytes(key)
        self.clock = clock

    def headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        timestamp = f"{self.clock():.3f}"
        nonce = secrets.token_hex(16)
        return {TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce,
                SIGNATURE_HEADER: signature(self.key, method, path, timestamp, nonce, body)}


class PeerVerifier:
    def __init__(self, key: str | bytes, window_s: float = 30.0, max_nonces: int = 65536,
                 clock: Callable[[], float] = time.time):
        self.key = _key_bytes(key)
        self.window_s = window_s
        self.max_nonces = max_nonces
        self.clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()     # nonce -> when it may be forgotten

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> None:
        """Return if the call is authentic and fresh; raise AuthError otherwise. Changes nothing
        when it raises."""
        timestamp = headers.get(TIMESTAMP_HEADER)
        nonce = headers.get(NONCE_HEADER)
        sig = headers.get(SIGNATURE_HEADER)
        if not timestamp or not nonce or not sig:
            raise AuthError("missing peer signature headers")
        if not _NONCE_RE.match(nonce):
            raise AuthError("malformed nonce")
        try:
            ts = float(timestamp)
        except ValueError:
            raise AuthError("malformed timestamp") from None
        expected = signature(self.key, method, path, timestamp, nonce, body)
        if not hmac.compare_digest(expected, sig):
            raise AuthError("bad signature")
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
