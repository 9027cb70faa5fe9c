"""Sampler semantics (vLLM's), seeded reproducibility, and SamplingParams validation."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from asyncserve.sampling_params import SamplingParams
from asyncserve.stepper.sampler import (
    SamplingRow,
    any_ranked,
    apply_penalties_,
    sample,
    sampling_uniform,
    truncation_thresholds,
)

EOS = 0


def make_row(seed: int = 0, prompt: list[int] | None = None, output: list[int] | None = None,
             bad_words_ids: list[list[int]] | None = None, **params) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),
        prompt_ids=list(prompt or []),
        output_ids=list(output or []),
        eos_token_ids=[EOS],
        seed=seed,
        bad_words_ids=bad_words_ids or [],
    )


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_allowed(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """vLLM v0's sort-based top-k -> top-p -> min-p, for one row. logits: [vocab]. Returns [vocab] bool."""
    logits = logits.clone()
    ascending, order = logits.sort()
    if top_k > 0:
        ascending[ascending < ascending[-top_k]] = float("-inf")
    cumulative = ascending.softmax(-1).cumsum(-1)
    removed = cumulative <= 1 - top_p
    removed[-1] = False
    ascending[removed] = float("-inf")
    logits[order] = ascending
    probs = logits.softmax(-1)
    return (probs >= min_p * probs.max()) & (probs > 0)


def chi_square(counts: Counter, probs: torch.Tensor, draws: int) -> float:
    return sum((counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in enumerate(probs.tolist()) if p > 0)


def chi_square_critical(degrees: int) -> float:
    """Chi-square quantile at p = 1e-4 (Wilson-Hilferty approximation)."""
    z, h = 3.719, 2 / (9 * degrees)
    return degrees * (1 - h + z * math.sqrt(h)) ** 3


def draw_many(logits_row: torch.Tensor, draws: int, **params) -> Counter:
    """One token per distinct seed, all in a single batch."""
    rows = [make_row(seed=s, **params) for s in range(draws)]
    return Counter(sample(logits_row.expand(draws, -1), rows).token_ids)


def test_greedy_equals_argmax():
    logits = random_logits(8, 1000)
    out = sample(logits, [make_row(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    # greedy rows keep argmax inside a batch that also samples
    mixed = [make_row(seed=i, temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    tokens = sample(logits, mixed).token_ids
    assert tokens[1::2] == logits.argmax(-1).tolist()[1::2]


def test_top_k_one_is_greedy():
    logits = random_logits(16, 1000)
    rows = [make_row(seed=s, temperature=1.5, top_k=1) for s in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(16, 1000)
    rows = [make_row(seed=s, temperature=1.5, top_p=1e-6) for s in range(16)]
    assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    vocab, steps = 512, 24
    targets = [
        dict(seed=11, temperature=0.8, top_p=0.9, top_k=50),
        dict(seed=12, temperature=1.0, min_p=0.05),
        dict(seed=13, temperature=1.2, top_p=0.95, presence_penalty=0.5, repetition_penalty=1.1),
    ]
    neighbours = [
        dict(temperature=0.0),
        dict(temperature=1.0, logprobs=5),
        dict(temperature=0.7, top_k=400),  # a wider top-k prefix than the targets'
        dict(temperature=1.0, top_p=0.999),  # a flat nucleus that outgrows the first prefix
        dict(temperature=1.3, frequency_penalty=1.0, min_tokens=5, stop_token_ids=[3]),
        dict(temperature=0.5, top_k=1),
        dict(temperature=0.9, min_p=0.2, repetition_penalty=1.5),
    ]
    # rounded through bf16, as many models emit them: ties at the top-k / top-p boundaries
    step_logits = random_logits(steps, vocab, seed=1).bfloat16().float()

    def run_alone(params: dict) -> list[int]:
        row = make_row(prompt=[5, 6, 7], **params)
        for step in range(steps):
            row.output_ids.append(sample(step_logits[step : step + 1], [row]).token_ids[0])
        return row.output_ids

    def run_batched(params: dict, shuffle_seed: int) -> list[int]:
        shuffle = random.Random(shuffle_seed)
        target = make_row(prompt=[5, 6, 7], **params)
        others = [make_row(seed=100 + i, prompt=[1, 2], **p) for i, p in enumerate(neighbours)]
        for step in range(steps):
            rows = others + [target]
            shuffle.shuffle(rows)
            logits = random_logits(len(rows), vocab, seed=1000 + step, scale=shuffle.choice([0.1, 3.0]))
            logits[rows.index(target)] = step_logits[step]
            tokens = sample(logits, rows).token_ids
            for row, token in zip(rows, tokens):
                row.output_ids.append(token)
        return target.output_ids

    for params in targets:
        alone = run_alone(params)
        assert run_batched(params, shuffle_seed=0) == alone
        assert run_batched(params, shuffle_seed=1) == alone
        assert len(set(alone)) > 4  # really sampling, not stuck on one token


def test_different_seeds_give_different_tokens():
    logits = random_logits(1, 1000, scale=0.5)
    counts = draw_many(logits[0], 64, temperature=1.0)
    assert len(counts) > 40
    positions = {sampling_uniform(7, position) for position in range(100)}
    assert len(positions) == 100


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature: float):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    draws = 16000
    counts = draw_many(logits, draws, temperature=temperature)
    expected = (logits / temperature).softmax(-1)
    assert chi_square(counts, expected, draws) < chi_square_critical(7)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    top_share = {t: draw_many(logits, 4000, temperature=t)[0] / 4000 for t in (0.5, 1.0, 2.0)}
    assert top_share[0.5] > top_share[1.0] > top_share[2.0]


@pytest.mark.parametrize(
    "top_k, top_p, min_p",
    [(3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (6, 0.8, 0.0), (5, 0.9, 0.1)],
)
def test_truncated_sampling_follows_the_truncated_softmax(top_k: int, top_p: float, min_p: float):
    logits = random_logits(1, 16, seed=3, scale=1.5)[0]
    allowed = reference_allowed(logits, top_k, top_p, min_p)
    draws = 8000
    counts = draw_many(logits, draws, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(counts) <= set(allowed.nonzero().squeeze(1).tolist())
    expected = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    kept = int(allowed.sum())
    if kept > 1:
        assert chi_square(counts, expected, draws) < chi_square_critical(kept - 1)


def test_truncation_thresholds_match_reference():
    vocab = 2000
    configs = [(0, 0.9, 0.0), (40, 1.0, 0.0), (40, 0.5, 0.0), (0, 1.0, 0.1), (300, 0.95, 0.05), (0, 0.99, 0.0)]
    rows = [(cfg, scale) for cfg in configs for scale in (0.05, 1.0, 4.0)]  # flat rows outgrow the prefix
    logits = torch.cat([random_logits(1, vocab, seed=i, scale=scale) for i, (_, scale) in enumerate(rows)])
    top_k = torch.tensor([cfg[0] for cfg, _ in rows])
    top_p = torch.tensor([cfg[1] for cfg, _ in rows])
    min_p = torch.tensor([cfg[2] for cfg, _ in rows])
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    thresholds = truncation_thresholds(weights, top_k, top_p, min_p)
    for i, (cfg, _) in enumerate(rows):
        kept = weights[i] >= thresholds[i]
        assert torch.equal(kept, reference_allowed(logits[i], *cfg)), (i, cfg)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 0.0]])  # eos (0) then stop id 1 are the favourites
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[1, 10_000], max_tokens=8)
    assert sample(logits, [make_row(output=[], **params)]).token_ids == [2]
    assert sample(logits, [make_row(output=[4], **params)]).token_ids == [2]
    assert sample(logits, [make_row(output=[4, 4], **params)]).token_ids == [EOS]
    # ignore_eos: eos is not a stop, so vLLM masks only stop_token_ids
    assert sample(logits, [make_row(output=[], ignore_eos=True, **params)]).token_ids == [EOS]
    # sampled rows never draw a masked id either
    flat = torch.zeros(1, 5)
    counts = draw_many(flat[0], 500, temperature=1.0, min_tokens=3, stop_token_ids=[1])
    assert set(counts) == {2, 3, 4}


def reference_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    logits = logits.clone()
    p = row.params
    for token in set(row.prompt_ids + row.output_ids):
        value = logits[token]
        logits[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    for token, count in Counter(row.output_ids).items():
        logits[token] -= p.frequency_penalty * count + p.presence_penalty
    for token, bias in p.logit_bias.items():
        logits[token] += bias
    if p.allowed_token_ids is not None:
        others = torch.ones(logits.shape, dtype=torch.bool)
        others[p.allowed_token_ids] = False
        logits[others] = float("-inf")
    for ids in row.bad_words_ids:        # banned where the output ends with all but the word's last token
        if len(row.output_ids) >= len(ids) - 1 and row.output_ids[len(row.output_ids) - len(ids) + 1:] == ids[:-1]:
            logits[ids[-1]] = float("-inf")
    return logits


def test_penalties_match_reference():
    vocab = 50
    padded = random_logits(9, vocab + 14, seed=5)
    logits = padded[:, :vocab]  # a non-contiguous view, as a padded vocab would give
    rows = [
        make_row(prompt=[1, 2, 2, 3], output=[3, 4, 4, 4], temperature=0.0, repetition_penalty=1.3),
        make_row(prompt=[1, 5], output=[5, 5, 6], temperature=0.0, presence_penalty=0.5, frequency_penalty=0.7),
        make_row(prompt=[7, 8, 9], output=[9, 9, 10, 11, 11], temperature=0.0,
                 repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=1.5),
        make_row(prompt=[1, 2], output=[3], temperature=0.0),
        make_row(prompt=[1, 2], output=[2], temperature=0.0, repetition_penalty=1.2, logit_bias={2: 30.0, 4: -100}),
        make_row(output=[3], temperature=0.0, allowed_token_ids=[7, 9, 11], logit_bias={9: 5.0}),
        # bad words: 12 always; 20 after 13; 30 after 14, 15 (the output ends 15, 14: not banned)
        make_row(output=[1, 13], temperature=0.0, bad_words_ids=[[12], [13, 20], [14, 15, 30]]),
        make_row(output=[15, 14], temperature=0.0, bad_words_ids=[[14, 15, 30]]),
        make_row(output=[14, 15], temperature=0.0, bad_words_ids=[[14, 15, 30], [5, 6, 7]]),
    ]
    for i, banned in ((6, [12, 20]), (7, [30]), (8, [30])):
        logits[i, banned] = 50.0                  # the banned tokens would win otherwise
    before = logits.clone()
    penalised = logits.contiguous()
    apply_penalties_(penalised, rows)
    expected = torch.stack([reference_penalties(logits[i], row) for i, row in enumerate(rows)])
    assert torch.allclose(penalised, expected, atol=1e-6)
    assert sample(logits, rows).token_ids == expected.argmax(-1).tolist()
    tokens = sample(logits, rows).token_ids
    assert tokens[4] == 2          # the bias wins over the repetition penalty
    assert tokens[5] == 9 and tokens[6] not in (12, 20) and tokens[7] == 30 and tokens[8] != 30
    assert torch.equal(logits, before)


def test_logprobs_are_raw_log_softmax_sorted():
    vocab = 300
    logits = random_logits(5, vocab, seed=7)
    rows = [
        make_row(seed=1, temperature=0.7, top_k=20, logprobs=3, repetition_penalty=1.4, output=[1, 2]),
        make_row(seed=2, temperature=0.0, logprobs=0),
        make_row(seed=3, temperature=1.0),
        make_row(seed=4, temperature=1.0, top_p=0.8, logprobs=20, presence_penalty=2.0, output=[5]),
        make_row(seed=5, temperature=0.0, logprobs=1),
    ]
    out = sample(logits, rows)
    raw = logits.log_softmax(-1)
    for i, row in enumerate(rows):
        n = row.params.logprobs
        if n is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] == []
            continue
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        top = out.top_logprobs[i]
        assert len(top) == n
        assert [t for t, _ in top] == raw[i].topk(n).indices.tolist()
        assert [v for _, v in top] == pytest.approx(raw[i].topk(n).values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_sampling_uniform_is_a_function_of_seed_and_position():
    assert sampling_uniform(42, 3) == sampling_uniform(42, 3)
    assert sampling_uniform(42, 3) != sampling_uniform(43, 3)
    values = [sampling_uniform(seed, 0) for seed in range(10_000)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.01
    assert 0.0 <= sampling_uniform(-5, 0) < 1.0  # negative seeds are valid


def test_sampling_params_defaults_and_normalisation():
    params = SamplingParams(stop="###")
    assert params.stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert not SamplingParams().greedy
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    SamplingParams(top_k=-1, logprobs=20, min_tokens=16, seed=-3, repetition_penalty=2.0, presence_penalty=-2.0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("n", 2),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("stop_token_ids", [5, -1]),
        ("stop", ["ok", ""]),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("seed", 1.5),
    ],
)
def test_sampling_params_rejects_out_of_range(field: str, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_only_n_one_is_supported():
    with pytest.raises(ValueError, match="only n=1 is supported"):
        SamplingParams(n=3)


def test_validate_rechecks_after_mutation():
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        params.validate()


@pytest.mark.parametrize("vocab", [49152, 32000, 384, 1000, 77])
def test_argmax_rows_is_argmax_with_first_maximum_on_ties(vocab):
    from asyncserve.stepper.sampler import argmax_rows

    generator = torch.Generator().manual_seed(vocab)
    for _ in range(20):
        x = torch.randn(16, vocab, generator=generator)
        x[torch.arange(16), torch.randint(0, vocab, (16,), generator=generator)] = 9.0
        x[torch.arange(16), torch.randint(0, vocab, (16,), generator=generator)] = 9.0     # ties, in either order
        x[3] = float("-inf")
        x[3, vocab - 1] = 0.0                                                              # the last token alone
        assert torch.equal(argmax_rows(x), x.argmax(-1))
        assert torch.equal(argmax_rows(x[:, :vocab - 5]), x[:, :vocab - 5].argmax(-1))    # a strided view


def _plain_rows(count: int, seed: int) -> list[SamplingRow]:
    """Greedy and drawn rows with every truncation mix, some with outputs already (other seed positions)."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        kind = i % 6
        params = ({"temperature": 0.0} if kind == 0 else {"temperature": rng.choice([0.5, 1.0, 1.7])})
        if kind == 2:
            params["top_k"] = rng.choice([1, 5, 40, 300])
        if kind == 3:
            params["top_p"] = rng.choice([0.1, 0.8, 0.95])
        if kind == 4:
            params.update(top_k=rng.choice([3, 50]), top_p=0.9, min_p=0.05)
        if kind == 5:
            params["min_p"] = 0.2
        rows.append(make_row(seed=rng.randrange(2**63), output=[1] * rng.randrange(4), max_tokens=100,
                             min_tokens=0, **params))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_sampler_gives_the_general_paths_tokens(seed):
    """sample_plain (the GPU's one-sync path, here on CPU tensors) against the general path, row for row:
    greedy exactly, seeded draws the same tokens; NaN and all -inf rows fail the same way."""
    from asyncserve.stepper.sampler import is_plain, plain_sampling, sample_plain

    rows = _plain_rows(48, seed)
    assert all(is_plain(r) for r in rows)
    logits = random_logits(len(rows), 700, seed=seed)
    logits[7, 3] = float("nan")
    logits[13] = float("-inf")
    logits[20, 5] = float("inf")
    want = sample(logits, rows)
    got = sample_plain(logits, plain_sampling(rows, logits.device))
    assert got.token_ids == want.token_ids
    assert {i: e.code for i, e in got.errors.items()} == {i: e.code for i, e in want.errors.items()}
    assert set(got.errors) >= {7, 13}
    # non-plain rows (logprobs, penalties, min_tokens) are not the device path's
    assert not is_plain(make_row(logprobs=2)) and not is_plain(make_row(repetition_penalty=1.2))
    assert not is_plain(make_row(min_tokens=3, max_tokens=9))


def test_plain_row_says_what_is_plain_says_at_every_output_count():
    """plain_row, kept per request by the graph path, against is_plain of each row it stands for: which
    rows are plain (min_tokens with stop ids or EOS makes the first ones not), with the same columns."""
    from asyncserve.stepper.sampler import is_plain, plain_row, plain_sampling_values

    cases = [dict(), dict(temperature=0.0), dict(top_k=1), dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
             dict(min_tokens=3, max_tokens=9), dict(min_tokens=3, max_tokens=9, ignore_eos=True),
             dict(min_tokens=2, max_tokens=9, ignore_eos=True, stop_token_ids=[5]), dict(logprobs=0),
             dict(presence_penalty=0.5), dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]),
             dict(bad_words=["x"]), dict(temperature=1e-6, top_p=0.5)]
    for params in cases:
        for outputs in range(5):
            row = make_row(seed=-3 + outputs, output=[1] * outputs, **params)
            plain = plain_row(row.params, row.guide, row.eos_token_ids, row.seed)
            assert (plain is not None and outputs >= plain.plain_from) == is_plain(row), (params, outputs)
            if is_plain(row):
                assert plain.ranked == any_ranked([row])
                columns = plain_sampling_values([row])
                assert [c[0] for c in columns] == [plain.temperature, plain.top_k, plain.top_p, plain.min_p,
                                                   sampling_uniform(row.seed, outputs), plain.greedy]


def test_sampling_uniforms_equal_the_scalar_stream():
    """The vectorized SplitMix64 draws of the graph path: bit for bit sampling_uniform's, over negative,
    huge and edge seeds and positions."""
    from asyncserve.stepper.sampler import sampling_uniforms

    rng = random.Random(5)
    seeds = [0, 1, -1, -5, 2**63, 2**64 - 1, 2**70 + 3] + [rng.randrange(-2**64, 2**64) for _ in range(500)]
    positions = [0, 1, 2**31, 10**9, 7, 3, 2] + [rng.randrange(100_000) for _ in range(500)]
    got = sampling_uniforms([s & (2**64 - 1) for s in seeds], positions).tolist()
    assert got == [sampling_uniform(s, p) for s, p in zip(seeds, positions)]
