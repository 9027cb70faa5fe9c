"""Adapter paging: the scheduler allocates pages at once, the row copy waits for the stepper's thread."""
import torch

from asyncserve import LLM
from asyncserve.lora.batch import PROJECTIONS
from reference import ADAPTERS


def make_engine(tiny_model):
    llm = LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in tiny_model.adapters.items()},
              dtype="float32", device="cpu")
    return llm.engine


def test_page_in_copies_rows_at_write_pending(tiny_model):
    engine = make_engine(tiny_model)
    pager, pool = engine.pager, engine.pool
    name = next(iter(ADAPTERS))
    pool.data.fill_(float("nan"))
    device = pager.ensure_resident(name)
    assert device is not None and name in pager.pending
    assert torch.isnan(pool.data[device.pages]).all(), "the event loop side must not copy rows"

    pager.write_pending()
    assert not pager.pending
    host, flat = pager.host[name], pool.flat
    checked = 0
    for layer in range(engine.model_config.num_layers):
        for p in range(len(PROJECTIONS)):
            for ptrs, rows in ((device.a_ptr, host.a_rows), (device.b_ptr, host.b_rows)):
                for j in range(host.ranks[p]):
                    row = rows[(layer, p)][j]
                    start = int(ptrs[layer, p, j])
                    assert torch.equal(flat[start:start + row.shape[0]], row)
                    checked += 1
    assert checked == sum(host.ranks) * 2 * engine.model_config.num_layers


def test_evicting_before_the_copy_drops_it(tiny_model):
    """Pages of an adapter evicted before its copy may already hold KV: the copy must not land."""
    engine = make_engine(tiny_model)
    pager, pool = engine.pager, engine.pool
    name = next(iter(ADAPTERS))
    pages = pager.ensure_resident(name).pages
    pager.unregister(name)                       # idle, so evicted now; its pages are free again
    assert name not in pager.pending
    kv = pool.allocate(pool.num_free, "kv")
    assert set(pages) <= set(kv)
    pool.data[pages] = 7.0
    pager.write_pending()
    assert (pool.data[pages] == 7.0).all()


def test_pool_shares_caches_and_reclaims_kv_blocks():
    """KV pages with a registered block: shared by reference count, cached (and counted free) once
    no sequence holds them, reclaimed least recently used first when the free list runs out."""
    from asyncserve.pager.pool import PagedPool

    pool = PagedPool(4, num_layers=1, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    a, b = pool.allocate(2, "kv")
    pool.register_block(a, "A")
    pool.register_block(b, "B")
    pool.register_block(b, "A")                   # a key keeps its first page
    assert pool.cached_block("A") == a
    pool.share(a)                                 # a second sequence holds page a
    pool.release([a, b])
    assert pool.counts().kv == 1 and pool.counts().cached == 1 and pool.num_free == 3
    pool.release([a])
    assert pool.counts().kv == 0 and pool.counts().cached == 2 and pool.num_free == 4
    pool.share(b)                                 # a hit on a cached page brings it back
    assert pool.counts().kv == 1 and pool.counts().cached == 1
    pool.release([b])                             # b is now the most recently used
    pages = pool.allocate(3, "adapter")           # two free pages, then the oldest cached block (a)
    assert a in pages and pool.cached_block("A") is None and pool.cached_block("B") == b
    try:
        pool.release([b])
        raise AssertionError("a cached page is not held; releasing it again must fail")
    except RuntimeError:
        pass
