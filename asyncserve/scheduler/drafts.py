"""Speculative decoding's drafts by prompt lookup (vLLM's "ngram" method; Saxena's prompt lookup
decoding): the tokens that followed the latest earlier occurrence of a sequence's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) are guessed to follow again. No draft model:
text that repeats its context (code edits, quoting, summaries, extraction) gets several tokens
per step, any other text gets none and pays nothing but the lookup.

The step verifies a draft as one decode row per token, the last known one and the drafted ones, each
attending and sampled as the decode of its position would be (the sampler's draw depends only on the
row's logits, seed and output position); the scheduler keeps a drafted token while it equals the
token sampled at the row before it, so a request's output is the one it gets without speculation,
for greedy and seeded sampling alike (up to the kernels' rounding in batches of other shapes).
"""
from __future__ import annotations

# n-gram ends indexed per sequence per schedule() at most (~1 ms): a long prompt's index is built over a
# few steps instead of stalling the event loop in one (lookups meanwhile see the part indexed)
INDEX_PER_STEP = 1024


class NgramIndex:
    """One sequence's n-grams (n in [n_min, n_max]) -> where the latest occurrence indexed ends. Keyed by
    the n-gram's hash (an int, not the tuple: ~half the memory of a long context's index); a lookup
    checks the tokens it finds, so a collision costs a miss, never a wrong draft."""

    def __init__(self, n_min: int, n_max: int):
        self.sizes = range(n_max, n_min - 1, -1)          # longest first
        self.ends: dict[int, int] = {}
        self.indexed = 0                                   # n-grams ending at or before this are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of tokens' longest indexed suffix
        n-gram; [] where none occurred. Indexes the n-grams ending before the last token first."""
        last = len(tokens) - 1       # the suffix itself ends at len(tokens): never its own match
        stop = min(last, self.indexed + INDEX_PER_STEP)
        ends = self.ends
        for end in range(self.indexed + 1, stop + 1):
            for n in self.sizes:
                if n <= end:
                    ends[hash(tuple(tokens[end - n:end]))] = end
        self.indexed = max(self.indexed, stop)
        for n in self.sizes:
            if n > last:
                continue
            suffix = tokens[-n:]
            end = ends.get(hash(tuple(suffix)))
            if end is not None and tokens[end - n:end] == suffix:
                return tokens[end:end + k]
        return []


class NgramDrafter:
    """The scheduler's drafts: each sequence's NgramIndex lives on it (Sequence.ngram_index)."""

    def __init__(self, num_tokens: int, n_min: int, n_max: int, max_batch: int):
        self.num_tokens = num_tokens       # drafted tokens per sequence and step at most
        self.n_min, self.n_max = n_min, n_max
        self.max_batch = max_batch         # draft only while at most this many sequences decode
        self.drafted = 0                   # tokens drafted so far (counted by the scheduler)
        self.accepted = 0                  # of those, tokens kept

    def propose(self, seq, limit: int) -> list[int]:
        """At most min(num_tokens, limit) drafted tokens to follow seq's tokens."""
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.n_min, self.n_max)
        return seq.ngram_index.propose(seq.prompt_ids + seq.output_ids, min(self.num_tokens, limit))
