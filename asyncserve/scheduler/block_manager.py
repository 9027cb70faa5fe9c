"""The KV pages of sequences in the unified pool, and the prefix cache over them (nano-vllm's
BlockManager, over pages shared with adapters).

Prefix caching (vLLM's automatic prefix caching, per adapter): once a full block of a sequence's
tokens has its KV computed, its page is registered under a key naming the block's tokens, the
blocks before it and the adapter (which load of it). A sequence admitted later whose tokens start
with registered blocks takes those pages as they are (shared, read-only: a sequence writes only
past its cached prefix) and computes from there, always at least its last token, which gives the
logits to sample from. Requests that want prompt logprobs compute every prompt token.
"""
from __future__ import annotations

from asyncserve.pager.pager import AdapterPager
from asyncserve.pager.pool import PagedPool
from asyncserve.sequence import Sequence


class BlockManager:
    def __init__(self, pool: PagedPool, pager: AdapterPager, prefix_caching: bool = True, state_slots: int = 0):
        self.pool = pool
        # a model with linear-attention layers (Qwen3.5): a sequence holding pages holds one of these slots
        # of recurrent state too (model/linear_attention.LinearStates), taken at admission like its pages
        self._free_slots = list(range(state_slots))[::-1]
        self._state_slots = state_slots
        self.pager = pager                      # idle adapters are evicted to make room for KV
        self.prefix_caching = prefix_caching
        # keep a few pages free so running decodes rarely have to preempt right after an admission
        self.watermark = max(1, pool.num_pages // 100)
        self.prefix_queried_tokens = 0          # prompt tokens of admissions that looked up the cache
        self.prefix_hit_tokens = 0              # of those, tokens found cached

    def allocate_first_chunk(self, seq: Sequence, budget: int) -> int:
        """Pages for seq's cached prefix and a first chunk of at most ``budget`` tokens past it, leaving
        the watermark free; returns the chunk's size, or 0 (nothing held) if it does not fit now."""
        seq.block_table = self._cached_prefix(seq)
        if not self.hold_state_slot(seq):
            self.free(seq)
            return 0
        seq.num_registered_blocks = len(seq.block_table)
        seq.num_computed = len(seq.block_table) * self.pool.block_size
        first_chunk = min(seq.num_tokens - seq.num_computed, budget)
        kv_pages = self.pool.pages_for_tokens(seq.num_computed + first_chunk) - len(seq.block_table)
        if self.pool.num_free - kv_pages < self.watermark and not self.pager.make_room(kv_pages + self.watermark):
            self.free(seq)
            seq.num_computed = 0
            return 0
        seq.block_table += self.pool.allocate(kv_pages, "kv")
        return first_chunk

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for ``num_tokens`` KV entries, evicting idle adapters if needed; no preemption."""
        need = self.pool.pages_for_tokens(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if self.pool.num_free < need and not self.pager.make_room(need):
            return False
        seq.block_table += self.pool.allocate(need, "kv")
        return True

    def reserve_free(self, seq: Sequence, num_tokens: int) -> bool:
        """Like reserve, but only from pages free beyond the watermark: evicts nothing."""
        need = self.pool.pages_for_tokens(num_tokens) - len(seq.block_table)
        if need > 0:
            if self.pool.num_free - need < self.watermark:
                return False
            seq.block_table += self.pool.allocate(need, "kv")
        return True

    def trim(self, seq: Sequence) -> None:
        """Release seq's pages past those its tokens need (held for a draft's rejected tokens)."""
        keep = self.pool.pages_for_tokens(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        self.release_state_slot(seq)

    def hold_state_slot(self, seq: Sequence) -> bool:
        """A linear-attention state slot for seq where the model has such layers; False if none is free."""
        if self._state_slots and seq.state_slot is None:
            if not self._free_slots:
                return False
            seq.state_slot = self._free_slots.pop()
        return True

    def release_state_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = None

    def register_blocks(self, seq: Sequence) -> None:
        """Offer seq's newly completed blocks to the cache."""
        if seq.cache_root is None:
            return
        full = seq.num_computed // self.pool.block_size
        for i in range(seq.num_registered_blocks, full):
            self.pool.register_block(seq.block_table[i], self._block_key(seq, i))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages of the longest run of seq's first blocks that is cached, now held by seq too."""
        if not self.prefix_caching:
            return []
        self._root(seq, seq.adapter_load)              # the load it runs with
        if seq.params.prompt_logprobs is not None:     # every prompt token's logits are wanted
            return []
        pages = [self.pool.cached_block(key) for key in self._cached_keys(seq)]
        for page in pages:
            self.pool.share(page)
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += len(pages) * self.pool.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = min(len(pages) * self.pool.block_size, len(seq.prompt_ids))
        return pages

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many of a waiting seq's first tokens its admission now would find cached; holds nothing."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return 0
        self._root(seq, self.pager.registration(seq.adapter) if seq.adapter is not None else None)
        return len(self._cached_keys(seq)) * self.pool.block_size

    def _root(self, seq: Sequence, load: int | None) -> None:
        root = (seq.adapter, load or 0)
        if seq.cache_root != root:
            seq.cache_root, seq.block_keys = root, []

    def _cached_keys(self, seq: Sequence) -> list[tuple]:
        """Keys of the longest run of seq's first blocks that is cached."""
        keys = []
        for i in range((seq.num_tokens - 1) // self.pool.block_size):    # the last token is always computed
            key = self._block_key(seq, i)
            if self.pool.cached_block(key) is None:
                break
            keys.append(key)
        return keys

    def _block_key(self, seq: Sequence, i: int) -> tuple:
        """Block i's key: (block i-1's key hashed, or the cache root for block 0; block i's tokens)."""
        keys, bs = seq.block_keys, self.pool.block_size
        while len(keys) <= i:
            j = len(keys)
            keys.append((hash(keys[-1]) if keys else seq.cache_root, tuple(seq.tokens(j * bs, (j + 1) * bs))))
        return keys[i]
