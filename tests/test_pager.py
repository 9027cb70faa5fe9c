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
