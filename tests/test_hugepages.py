"""Huge-page memory for the packed weights and the pool (asyncserve/model/hugepages.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncserve.model import hugepages
from asyncserve.model.linear import NativeLinear
from asyncserve.pager.pool import PagedPool

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where there is no THP."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:          # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_is_aligned_sized_and_writable():
    t = hugepages.empty(3 * (1 << 20) + 5, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3 * (1 << 20) + 5,)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(1.5)
    assert t.float().sum().item() == 1.5 * t.numel()


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_empty_faults_in_huge_pages():
    for _ in range(3):      # large blocks freed: glibc then serves 10 MB from memory it has touched before
        torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    t = hugepages.empty(8 << 20, torch.uint8)
    t.fill_(1)                                       # the first touch, after the advice
    assert anon_huge_kb(t.data_ptr()) >= 2048


def test_off_gives_ordinary_memory(monkeypatch):
    monkeypatch.setenv("ASYNCSERVE_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    t = hugepages.empty(1000, torch.float32)
    assert t.shape == (1000,) and t.untyped_storage().nbytes() == 4000


def test_arena_packs_tensors_into_shared_regions():
    arena = hugepages.Arena(chunk_bytes=4 << 20)
    base = lambda t: t.untyped_storage().data_ptr()     # noqa: E731  the region a tensor lives in
    a = arena.take(1000, torch.bfloat16)
    b = arena.take(333, torch.float32)
    c = arena.take((4 << 19) - 512, torch.bfloat16)    # 4 MiB less 1 KiB: not in what is left, a new region
    d = arena.take(10, torch.bfloat16)                 # in what c left
    big = arena.take(5 << 19, torch.bfloat16)          # 5 MiB: more than a region, one of its own
    assert base(a) == base(b) != base(c) == base(d)
    assert base(big) not in (base(a), base(c))
    for t in (a, b, c, d, big):
        assert t.data_ptr() % arena.ALIGN == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in (a, b, c, d))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "slices overlap"
    for value, t in enumerate((a, b, c, d, big)):
        t.fill_(value)
    assert all(bool((t == value).all()) for value, t in enumerate((a, b, c, d, big)))


def test_packed_weights_and_pool_live_on_huge_page_memory():
    w = torch.randn(48, 64).bfloat16()
    packed = NativeLinear.pack(w)
    # the packed layout, exactly: [out / 16, in / 2, 16, 2]
    assert torch.equal(packed, w.view(3, 16, 32, 2).permute(0, 2, 1, 3))
    assert packed.untyped_storage().data_ptr() == NativeLinear.arena._region.untyped_storage().data_ptr()
    pool = PagedPool(num_pages=4, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                     device="cpu")
    assert pool.data.data_ptr() % hugepages.HUGE_PAGE == 0
    assert not pool.data.any(), "the pool starts zeroed"
