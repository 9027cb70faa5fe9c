"""Messages between peers (msgspec Structs, JSON on HTTP routes under /cluster/)."""
from __future__ import annotations

from typing import Any

import msgspec

from asyncserve.perf_model import PerfCoefficients


class AdapterTiers(msgspec.Struct):
    device: list[str] = []             # resident in the unified pool: usable at once
    host: list[str] = []               # in host memory: a copy away


class Digest(msgspec.Struct):
    """A node's load, pushed to its peers every gossip interval."""
    node_id: str
    url: str
    seq: int                           # monotonic per node: a peer keeps only the newest
    timestamp: float                   # sender's clock (seconds) when the digest was made
    waiting: int
    running: int
    pending_seconds: float             # perf_model.pending_seconds over running + waiting
    free_pages: int                    # free unified-pool pages (KV and adapters share them)
    page_tokens: int                   # tokens of KV per page (block size)
    max_running: int
    running_rank_sum: int              # sum and max of the running sequences' adapter ranks: what a
    running_rank_max: int              # rank-aware router needs to price adding one more
    adapters: AdapterTiers
    coefficients: PerfCoefficients


class ForwardedRequest(msgspec.Struct):
    """A request sent to a peer, fresh or migrated: everything needed to continue it exactly.

    The target prefills prompt_ids + output_ids (Punica's migration by recompute) and samples the
    next token at position len(output_ids) of the seed's stream, so seeded and greedy outputs equal
    those of an unmigrated run."""
    request_id: str
    origin: str                        # node id that holds the client's connection
    adapter: str | None                # None: the base model
    prompt_ids: list[int]
    output_ids: list[int] = []         # generated so far (empty for a fresh request)
    params: dict[str, Any] = {}        # SamplingParams as a dict
    seed: int = 0
    seed_position: int = 0             # samples drawn so far from the seed's stream
    emitted_text_len: int = 0          # stop state: characters already streamed to the client
    stop_state: dict[str, Any] = {}    # detokenizer state the stop-string check needs to resume
    structured_state: Any = None       # the constraint guide's state, opaque to the cluster layer
    hops: int = 0                      # times forwarded: a request is never forwarded past a bound
