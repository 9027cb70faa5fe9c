"""Messages between peers (msgspec Structs, JSON on HTTP routes under /cluster/)."""
from __future__ import annotations

from typing import Literal

import msgspec

from asyncserve.messages import TokenEvent
from asyncserve.perf_model import PerfCoefficients
from asyncserve.sampling_params import SamplingParams


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
    measured: bool = False             # coefficients fitted to this node's own steps (not a prior or borrowed)
    routed_per_s: float = 0.0          # arrivals this node routed (as a client's entry point), per second
    layer_windows: list[int | None] = []   # its model's per-layer attention windows (None: global; empty: all
                                           # global): what its queue estimates price attention over


class ForwardedRequest(msgspec.Struct):
    """A request sent to a peer, fresh or continued (migrated, or resubmitted after its peer died):
    everything needed to continue it exactly.

    The target prefills prompt_ids + output_ids (Punica's migration by recompute) and samples the
    next token at position len(output_ids) of the seed's stream (stepper/sampler.py), so seeded and
    greedy outputs equal those of an unmigrated run. The rest of the state is rebuilt by replaying
    output_ids: the detokenizer's (text held back for stop strings or an unfinished character) and
    the structured-output guide's; the client has been sent exactly the text that replay releases."""
    request_id: str
    origin: str                        # node id that holds the client's connection
    model: str                         # the base model's name: a peer serving another model refuses
    adapter: str | None                # None: the base model
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                          # drawn at the origin when the client gave none
    output_ids: list[int] = []         # generated so far (empty for a fresh request)
    migrations: int = 0                # times moved while running: bounded, so a request never ping-pongs
    adapter_digest: str | None = None  # the adapter's content at the origin (cluster/adapters.py): the
                                       # target runs the request only on an adapter of this content


class Moved(msgspec.Struct):
    """A node moved a request it ran for an origin: the origin continues it at this peer."""
    node_id: str
    url: str


class ForwardLine(msgspec.Struct, omit_defaults=True):
    """One line of /cluster/forward's answer (newline-delimited JSON): one of the request's
    TokenEvents, or, as the last line, where it moved."""
    event: TokenEvent | None = None
    moved: Moved | None = None


class AdapterFileRequest(msgspec.Struct):
    """A peer's call for one file of an adapter registered on the node it calls (POST /cluster/adapter):
    an adapter by its registered name, and only its config or its weights."""
    name: str
    file: Literal["adapter_config.json", "adapter_model.safetensors"]
