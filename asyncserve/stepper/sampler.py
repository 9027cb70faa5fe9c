"""Batched sampler: turns one model step's logits into one token per row.

Order follows vLLM: penalties and min_tokens masking, the structured-output mask, then greedy
argmax or temperature -> top-k -> top-p -> min-p -> random draw. Logprobs are taken from the
raw logits, as vLLM's default.

Randomness: each seeded row draws a single uniform from the SplitMix64 stream of its seed
at position len(output_ids), and samples by inverse CDF over its own (vocab-ordered)
probabilities. The token therefore depends only on the row's logits, seed and position --
never on the batch around it -- and a request's sampling state is just (seed, position),
identical on any device, so it can migrate between servers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

import kernels.cpu as cpu_kernels
from asyncserve.sampling_params import SamplingParams
from asyncserve.step import Failure, SampleOutput
from asyncserve.structured import SequenceGuide

# Top-k/top-p thresholds are read off each row's `prefix` largest weights; the prefix grows by
# this factor until the nucleus fits, so a full-vocab sort only happens for very flat rows.
_FIRST_PREFIX = 256
_PREFIX_GROWTH = 8

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15

# why a row gets no token (SampleOutput.errors)
NON_FINITE = Failure("the model's output for this request is not finite (NaN or infinity), most likely because "
                     "of its adapter's weights; it was stopped", 500, "non_finite_logits")
NO_ALLOWED_TOKEN = Failure("the request's sampling constraints (allowed_token_ids, bad_words, stop_token_ids with "
                           "min_tokens, logit_bias) leave no token that may come next", 400, "no_allowed_token")


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated so far (drives penalties, min_tokens, the seed position)
    eos_token_ids: list[int]
    seed: int  # the request's seed (params.seed, or one drawn at arrival when None)
    guide: SequenceGuide | None = None  # the sequence's structured-output guide, if constrained
    bad_words_ids: list[list[int]] = field(default_factory=list)  # params.bad_words as token id sequences


@dataclass
class PlainSampling:
    """Per row, on the logits' device: what a plain row (is_plain) samples with. ``uniform`` is the row's
    draw (sampling_uniform); ``ranked`` (host): whether some row has top-k or top-p, so that the sort runs."""
    temperature: torch.Tensor    # [rows] float32, 1 for greedy rows
    greedy: torch.Tensor         # [rows] bool
    top_k: torch.Tensor          # [rows] int64, <= 0 disables
    top_p: torch.Tensor          # [rows] float32
    min_p: torch.Tensor          # [rows] float32
    uniform: torch.Tensor        # [rows] float32
    ranked: bool


class PlainRow(NamedTuple):
    """A request's constant inputs to sample_plain, and from which output count its rows are plain."""
    temperature: float          # 1 for greedy rows
    top_k: int
    top_p: float
    min_p: float
    greedy: bool
    seed: int                   # the request's seed as SplitMix64 takes it (64 bits)
    ranked: bool                # top-k or top-p truncate its draws
    plain_from: int             # rows with at least this many output tokens are plain (min_tokens bans none then)


def plain_row(params: SamplingParams, guide: SequenceGuide | None, eos_token_ids: list[int], seed: int
              ) -> PlainRow | None:
    """A request's PlainRow; None where none of its rows is plain (logprobs, penalties, a guide)."""
    if params.logprobs is not None or params.has_penalties or guide is not None:
        return None
    greedy = params.greedy
    bans = bool(params.stop_token_ids) or (not params.ignore_eos and bool(eos_token_ids))    # _min_tokens_banned
    return PlainRow(1.0 if greedy else params.temperature, params.top_k, params.top_p, params.min_p, greedy,
                    seed & _MASK64, not greedy and (params.top_k > 0 or params.top_p < 1),
                    params.min_tokens if bans else 0)


def plain_columns(plain: list[PlainRow], positions: list[int]) -> tuple:
    """PlainSampling's columns of plain rows, host side: (temperature, top_k, top_p, min_p, uniform,
    greedy); positions: each row's output count so far."""
    temperature, top_k, top_p, min_p, greedy, seed, _, _ = zip(*plain)
    return temperature, top_k, top_p, min_p, sampling_uniforms(seed, positions), greedy


def plain_sampling_values(rows: list[SamplingRow]) -> tuple:
    """plain_columns of rows that are all plain (is_plain)."""
    return plain_columns([plain_row(r.params, r.guide, r.eos_token_ids, r.seed) for r in rows],
                         [len(r.output_ids) for r in rows])


def plain_sampling(rows: list[SamplingRow], device: torch.device) -> PlainSampling:
    temperature, top_k, top_p, min_p, uniform, greedy = plain_sampling_values(rows)
    f32 = dict(dtype=torch.float32, device=device)
    return PlainSampling(torch.tensor(temperature, **f32), torch.tensor(greedy, device=device),
                         torch.tensor(top_k, dtype=torch.int64, device=device), torch.tensor(top_p, **f32),
                         torch.tensor(min_p, **f32), torch.tensor(uniform, **f32), any_ranked(rows))


def any_ranked(rows: list[SamplingRow]) -> bool:
    return any(not row.params.greedy and (row.params.top_k > 0 or row.params.top_p < 1) for row in rows)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SampleOutput:
    """One token per row. logits: [rows, vocab] (float32; lower precision is upcast), not modified.
    On a GPU, a batch of plain rows (is_plain) is sampled there whole, with one copy of its tokens back
    (in a CUDA graph's decode step, inside the graph: cuda_graphs.py)."""
    if logits.device.type != "cpu" and rows and all(is_plain(row) for row in rows):
        return sample_plain(logits, plain_sampling(rows, logits.device))
    if all(_is_plain_greedy(row) for row in rows):
        if cpu_kernels.enabled_for(logits):     # one pass over the logits as they are
            tokens, finite = cpu_kernels.greedy_rows(logits)
        else:
            # upcast first: CPU argmax over bf16 is ~5x slower than the copy and an fp32 argmax
            x = logits.float()
            tokens = argmax_rows(x)
            finite = _finite_at(x, tokens)
        token_ids, errors = _valid_ids(tokens, finite, logits)
        return SampleOutput(token_ids, None, None, errors)

    tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    valid = torch.empty(len(rows), dtype=torch.bool, device=logits.device)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    # each group works on its own copy of its rows, so the caller's logits stay raw for logprobs
    if greedy:
        part = logits[greedy].float()  # [greedy, vocab]
        apply_penalties_(part, [rows[i] for i in greedy])
        apply_guides_(part, [rows[i] for i in greedy], logits[greedy])
        tokens[greedy] = chosen = argmax_rows(part)
        valid[greedy] = _finite_at(part, chosen)
    if sampled:
        part = logits[sampled].float()  # [sampled, vocab]
        apply_penalties_(part, [rows[i] for i in sampled])
        apply_guides_(part, [rows[i] for i in sampled], logits[sampled])
        tokens[sampled], valid[sampled] = _draw(part, [rows[i] for i in sampled])
    token_ids, errors = _valid_ids(tokens, valid, logits)

    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asked:
        return SampleOutput(token_ids, None, None, errors)
    logprobs: list[float | None] = [None] * len(rows)
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    chosen, tops = token_logprobs(logits[asked], tokens[asked], [rows[i].params.logprobs for i in asked])
    for j, i in enumerate(asked):
        logprobs[i], top_logprobs[i] = chosen[j], tops[j]
    return SampleOutput(token_ids, logprobs, top_logprobs, errors)


def sample_plain(logits: torch.Tensor, p: PlainSampling) -> SampleOutput:
    """sample() of plain rows, greedy and drawn ones together, without a host read but the one copy of
    the tokens back: the same tokens as the general path (its thresholds read off a full sort rather
    than a growing prefix of it)."""
    return plain_output(plain_tokens(logits, p).tolist())


def plain_tokens(logits: torch.Tensor, p: PlainSampling) -> torch.Tensor:
    """sample_plain's tokens and whether each row has one, [2, rows] int64 on the logits' device, with no
    host read or allocation that depends on the values (so a CUDA graph can hold it)."""
    x = logits.float()                                           # [rows, vocab], a private copy
    greedy_tokens = x.argmax(-1)
    greedy_valid = _finite_at(x, greedy_tokens)
    drawn, drawn_valid = _draw_plain(x, p)
    tokens = torch.where(p.greedy, greedy_tokens, drawn)
    valid = torch.where(p.greedy, greedy_valid, drawn_valid)
    return torch.stack([tokens.long(), valid.long()])


def plain_output(tokens_valid: list[list[int]]) -> SampleOutput:
    """plain_tokens, copied back, as the step's SampleOutput. Nothing masks a plain row's logits, so a
    row without a token has a non-finite logit (the all -inf row included)."""
    ids, valid = tokens_valid
    errors = {}
    for i in [i for i, ok in enumerate(valid) if not ok]:
        ids[i] = None
        errors[i] = NON_FINITE
    return SampleOutput(ids, None, None, errors)


def _draw_plain(logits: torch.Tensor, p: PlainSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """_draw's tokens and validity for plain rows, with no host reads. logits: [rows, vocab], overwritten."""
    rows, vocab = logits.shape
    peak = logits.amax(-1, keepdim=True)
    valid = torch.isfinite(peak.squeeze(1))
    logits = torch.where(valid.unsqueeze(1), logits, 0)         # uniform where invalid, so thresholds stay defined
    peak = torch.where(valid.unsqueeze(1), peak, 0)
    weights = logits.sub_(peak).mul_(1 / p.temperature.unsqueeze(1)).exp_()   # _draw's rounding
    thresholds = p.min_p
    if p.ranked:
        values = weights.sort(dim=-1, descending=True).values   # [rows, vocab]
        top_k = torch.where(p.top_k > 0, p.top_k.clamp(max=vocab), vocab)
        k_thresholds = values.gather(1, (top_k - 1).unsqueeze(1)).squeeze(1)
        k_thresholds = torch.where(top_k == vocab, 0, k_thresholds)
        in_top_k = torch.where(weights >= k_thresholds.unsqueeze(1), weights, 0)
        top_p_mass = in_top_k.sum(-1) * p.top_p
        ranked = torch.where(values >= k_thresholds.unsqueeze(1), values, 0)
        mass_before = F.pad(ranked.cumsum(-1)[:, :-1], (1, 0))
        kept = ((mass_before < top_p_mass.unsqueeze(1)) & (ranked > 0)).sum(-1).clamp(min=1)
        nucleus = torch.where(p.top_p < 1, values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1), 0)
        thresholds = torch.maximum(thresholds, torch.maximum(k_thresholds, nucleus))
    weights.masked_fill_(weights < thresholds.unsqueeze(1), 0)
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1]
    targets = torch.minimum(p.uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    return tokens.masked_fill_(~valid, 0), valid


def _finite_at(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[rows] bool: whether each row's chosen logit is finite. An argmax lands on a NaN or +inf where
    the row has one (torch ranks NaN above everything), on -inf only where every token is -inf."""
    return torch.isfinite(x.gather(1, tokens.unsqueeze(1)).squeeze(1))


def _valid_ids(tokens: torch.Tensor, valid: torch.Tensor, raw: torch.Tensor
               ) -> tuple[list[int | None], dict[int, Failure]]:
    """tokens [rows] as ints, None where not valid, and why each of those is not; raw: the rows' logits
    as the model gave them."""
    # one copy back: the tokens and their validity together
    both = torch.stack([tokens.long(), valid.long()]).tolist()
    ids, errors = both[0], {}
    if not all(both[1]):
        for i in [i for i, ok in enumerate(both[1]) if not ok]:
            ids[i] = None
            errors[i] = NON_FINITE if not bool(torch.isfinite(raw[i]).all()) else NO_ALLOWED_TOKEN
    return ids, errors


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x: [rows, vocab], the first maximum on ties. Via each block's max
    then an argmax within the first block that holds the row's: torch's CPU argmax runs one element
    at a time (232 us for 16 x 49,152 float32 logits), amax is vectorised (41 us for both stages)."""
    rows, vocab = x.shape
    block = next((b for b in (256, 128, 64, 32) if vocab % b == 0), None)
    if block is None or x.device.type != "cpu":
        return x.argmax(-1)
    blocks = x.reshape(rows, vocab // block, block)
    best = blocks.amax(-1).argmax(-1)                                   # [rows]: the first block with the max
    return best * block + blocks[torch.arange(rows), best].argmax(-1)


# rows log-softmaxed at once by token_logprobs: bounds its float32 copy (a long prompt's logprobs
# would otherwise take prompt length x vocab x 4 bytes)
LOGPROB_ROWS = 256


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, widths: list[int]
                   ) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Per row of raw logits [rows, vocab]: the log-probability of token_ids[row], and the row's
    widths[row] most likely (token id, log-probability), best first."""
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for lo in range(0, logits.shape[0], LOGPROB_ROWS):
        hi = min(lo + LOGPROB_ROWS, logits.shape[0])
        raw = logits[lo:hi].float().log_softmax(-1)                       # [rows, vocab]
        chosen += raw.gather(1, token_ids[lo:hi, None].to(raw.device)).squeeze(1).tolist()
        widest = min(max(widths[lo:hi]), raw.shape[1])
        top_values, top_ids = raw.topk(widest, dim=-1)                    # [rows, widest], descending
        for ids, values, n in zip(top_ids.tolist(), top_values.tolist(), widths[lo:hi]):
            tops.append(list(zip(ids[:n], values[:n])))
    return chosen, tops


def apply_penalties_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place: repetition penalty (HF/vLLM: prompt + output tokens), frequency and presence
    penalties (OpenAI: output tokens), logit_bias, allowed_token_ids, bad_words, then min_tokens
    masking. logits: [rows, vocab], contiguous."""
    vocab = logits.shape[1]
    device = logits.device
    flat = logits.view(-1)  # row i, token t lives at i * vocab + t
    repeated = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1]
    if repeated:
        index, _ = _flat_token_counts([(i, rows[i].prompt_ids + rows[i].output_ids) for i in repeated], vocab)
        index = index.to(device)
        penalty = _per_row(rows, "repetition_penalty", device)[index // vocab]
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [
        i for i, row in enumerate(rows)
        if (row.params.frequency_penalty != 0 or row.params.presence_penalty != 0) and row.output_ids
    ]
    if counted:
        index, counts = _flat_token_counts([(i, rows[i].output_ids) for i in counted], vocab)
        index, counts = index.to(device), counts.to(device)
        frequency = _per_row(rows, "frequency_penalty", device)[index // vocab]
        presence = _per_row(rows, "presence_penalty", device)[index // vocab]
        flat[index] -= frequency * counts + presence
    for i, row in enumerate(rows):
        if row.params.logit_bias:                  # ids checked against the vocab by Engine.make_sequence
            bias = row.params.logit_bias
            logits[i, list(bias)] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=device)
        if row.params.allowed_token_ids is not None:
            allowed = row.params.allowed_token_ids
            kept = logits[i, allowed]
            logits[i] = float("-inf")
            logits[i, allowed] = kept
        banned = _min_tokens_banned(row, vocab) + _bad_words_banned(row)
        if banned:
            logits[i, banned] = float("-inf")


def apply_guides_(logits: torch.Tensor, rows: list[SamplingRow], raw: torch.Tensor) -> None:
    """In place: -inf for every token a row's structured-output guide does not allow next.
    logits: [rows, vocab] after penalties; raw: the same rows before them. Where min_tokens,
    allowed_token_ids or bad_words leave a row nothing its guide allows (e.g. the text is complete
    but min_tokens bans the end-of-sequence token), the guide wins: that row is its raw logits
    under the guide's mask."""
    for i, row in enumerate(rows):
        if row.guide is None:
            continue
        bias = row.guide.bias(logits.shape[1])                  # [vocab]: 0 or -inf
        logits[i].add_(bias)
        if logits[i].amax() == float("-inf"):
            logits[i].copy_(raw[i]).add_(bias)


def truncation_thresholds(
    weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Smallest weight each row keeps after top-k, then top-p, then min-p (vLLM's order); 0 keeps
    everything. Tokens tied with a threshold are kept, as vLLM's top-k keeps them.
    weights: [rows, vocab], exp(logit - max logit) after temperature, so each row's largest is 1;
    top_k: [rows] long, <= 0 disables; top_p, min_p: [rows] float. Returns [rows]."""
    # min-p keeps p_i >= min_p * p_max, and p_max is weight 1
    thresholds = min_p.clone()
    ranked = ((top_k > 0) | (top_p < 1)).nonzero().squeeze(1)
    if ranked.numel():
        rank_thresholds = _rank_thresholds(weights[ranked], top_k[ranked], top_p[ranked])
        thresholds[ranked] = torch.maximum(thresholds[ranked], rank_thresholds)
    return thresholds


def sampling_uniform(seed: int, position: int) -> float:
    """Uniform in [0, 1) for output position `position` of a request: output number `position` of
    the SplitMix64 stream started from `seed`."""
    state = (_mix64(seed & _MASK64) + (position + 1) * _GOLDEN_GAMMA) & _MASK64
    return (_mix64(state) >> 11) * 2.0**-53


def sampling_uniforms(seeds, positions) -> np.ndarray:
    """sampling_uniform over columns, float64 [rows]: the same values, without a Python loop per row.
    seeds: 64-bit (seed & 2**64-1); numpy's uint64 arithmetic wraps as the masked scalar one does."""
    state = _mix64_array(np.asarray(seeds, dtype=np.uint64))
    state += (np.asarray(positions, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN_GAMMA)
    return (_mix64_array(state) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def is_plain(row: SamplingRow) -> bool:
    """Rows that sample_plain takes: nothing changes their logits first and nothing reads them after."""
    params = row.params
    return (params.logprobs is None and not params.has_penalties and row.guide is None
            and not _min_tokens_banned(row, None))


def _is_plain_greedy(row: SamplingRow) -> bool:
    params = row.params
    return (
        params.greedy
        and params.logprobs is None
        and not params.has_penalties
        and row.guide is None
        and not _min_tokens_banned(row, None)
    )


def _min_tokens_banned(row: SamplingRow, vocab: int | None) -> list[int]:
    """Ids that may not be sampled yet: stop_token_ids, and eos unless ignore_eos (vLLM), until min_tokens."""
    params = row.params
    if len(row.output_ids) >= params.min_tokens:
        return []
    ids = params.stop_token_ids + ([] if params.ignore_eos else row.eos_token_ids)
    # users may name ids past the model's vocab; those can never be sampled anyway
    return [t for t in ids if vocab is None or t < vocab]


def _bad_words_banned(row: SamplingRow) -> list[int]:
    """The last token of each bad word whose other tokens the output ends with (vLLM's rule)."""
    out = row.output_ids
    return [ids[-1] for ids in row.bad_words_ids if len(ids) == 1 or out[len(out) - len(ids) + 1:] == ids[:-1]]


def _flat_token_counts(row_tokens: list[tuple[int, list[int]]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs as flat indices row * vocab + token, with how often each occurs."""
    flat = torch.cat([torch.tensor(tokens, dtype=torch.long) + row * vocab for row, tokens in row_tokens])
    return torch.unique(flat, return_counts=True)


def _per_row(rows: list[SamplingRow], name: str, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(row.params, name) for row in rows], dtype=torch.float32, device=device)


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random draw for non-greedy rows. logits: [rows, vocab], a private copy (overwritten).
    Returns the tokens [rows] long and whether each row could be drawn from [rows] bool: not where
    its largest logit is NaN or +inf (so the weights would be NaN), nor -inf (nothing is allowed);
    those rows get token 0, to be ignored."""
    device = logits.device
    # weights: [rows, vocab], exp((logit - max) / temperature), so each row's largest is 1
    inverse_temperature = 1 / _per_row(rows, "temperature", device).unsqueeze(1)
    peak = logits.amax(-1, keepdim=True)                        # NaN where the row has one
    valid = torch.isfinite(peak.squeeze(1))
    if not bool(valid.all()):                                   # uniform instead, so the thresholds stay defined
        logits.masked_fill_(~valid.unsqueeze(1), 0)
        peak.masked_fill_(~valid.unsqueeze(1), 0)
    weights = logits.sub_(peak).mul_(inverse_temperature).exp_()
    top_k = torch.tensor([row.params.top_k for row in rows], dtype=torch.long, device=device)
    thresholds = truncation_thresholds(
        weights, top_k, _per_row(rows, "top_p", device), _per_row(rows, "min_p", device)
    )
    weights.masked_fill_(weights < thresholds.unsqueeze(1), 0)
    cdf = weights.cumsum_(-1)
    total = cdf[:, -1]
    uniforms = [sampling_uniform(row.seed, len(row.output_ids)) for row in rows]
    targets = torch.tensor(uniforms, dtype=torch.float32, device=device) * total
    # keep target < total so it lands on a token; a zero-weight token never raises the cdf, so the
    # first cdf entry above the target always belongs to a token with positive weight
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)
    return tokens.masked_fill_(~valid, 0), valid


def _rank_thresholds(weights: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p threshold per row, read from the largest `prefix` weights rather than a full
    sort (sorting the vocab costs ~15x a small top-k on CPU). weights: [rows, vocab]. Returns [rows]."""
    rows, vocab = weights.shape
    top_k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    limited = top_k[top_k < vocab]
    # one past the largest k, so that every top-k threshold is inside the first prefix
    prefix = min(vocab, max(_FIRST_PREFIX, int(limited.max()) + 1 if limited.numel() else 0))
    values = weights.topk(prefix, dim=-1).values  # [rows, prefix], descending
    k_thresholds = values.gather(1, (top_k.clamp(max=prefix) - 1).unsqueeze(1)).squeeze(1)  # [rows]
    k_thresholds[top_k == vocab] = 0
    # the nucleus is measured within the top-k set, whose mass is summed over the whole row (a fixed
    # length, so it does not depend on how long the prefix is, even with ties at the k-th weight)
    in_top_k = torch.where(weights >= k_thresholds.unsqueeze(1), weights, 0) if limited.numel() else weights
    top_p_mass = in_top_k.sum(-1) * top_p  # [rows]
    nucleus = torch.zeros_like(k_thresholds)
    pending = (top_p < 1).nonzero().squeeze(1)
    values = values[pending]
    while pending.numel():
        ranked = torch.where(values >= k_thresholds[pending].unsqueeze(1), values, 0)  # [pending, prefix]
        mass_before = F.pad(ranked.cumsum(-1)[:, :-1], (1, 0))
        # vLLM keeps a token while the mass strictly above it is below top_p (so always the first)
        kept = ((mass_before < top_p_mass[pending].unsqueeze(1)) & (ranked > 0)).sum(-1)  # [pending]
        nucleus[pending] = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        # a row that kept its whole prefix may have more nucleus beyond it
        unresolved = kept == prefix
        if prefix == vocab or not unresolved.any():
            break
        pending = pending[unresolved]
        prefix = min(vocab, prefix * _PREFIX_GROWTH)
        values = weights[pending].topk(prefix, dim=-1).values
    return torch.maximum(k_thresholds, nucleus)


def _mix64(z: int) -> int:
    """SplitMix64 finaliser: a bijective 64-bit hash with full avalanche."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
