"""Adapter paging: the scheduler allocates pages at once, the row copy waits for the stepper's thread."""
import pytest
import torch
import torch.nn.functional as F

from asyncserve import LLM
from asyncserve.lora.batch import LoraBatch
from asyncserve.model.config import PROJECTIONS
from reference import ADAPTERS


def make_engine(tiny_model):
    llm = LLM(model=str(tiny_model.root), adapters={k: str(v) for k, v in tiny_model.adapters.items()},
              dtype="float32", device="cpu")
    return llm.engine


@pytest.mark.parametrize("host_rows", ["end to end", "padded apart"])
def test_page_in_copies_rows_at_write_pending(tiny_model, host_rows, monkeypatch):
    engine = make_engine(tiny_model)
    pager, pool = engine.pager, engine.pool
    if host_rows == "padded apart":        # the arena cannot give the rows as one view: they are gathered
        monkeypatch.setattr(pager.arena, "rows", lambda handle: None)
    name = next(iter(ADAPTERS))
    pool.data.fill_(float("nan"))
    device = pager.ensure_resident(name)
    assert device is not None and [p.device for p in pager.pending] == [device]
    if host_rows == "end to end":
        assert pager.arena.rows(pager.host_block(pager.registration(name))) is not None
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
    # one copy per page writes the rows and nothing else: the rest of the pages keeps its NaN
    row_elements = sum(t.numel() for rows in (host.a_rows, host.b_rows) for t in rows.values())
    assert int((~torch.isnan(pool.data[device.pages])).sum()) == row_elements


def test_step_tables_pad_each_adapter_to_the_largest_rank(tiny_model):
    engine = make_engine(tiny_model)
    devices = [engine.pager.ensure_resident(name) for name in ADAPTERS]
    assert len({d.r_max for d in devices}) > 1, "the tiny adapters must differ in rank"
    batch = LoraBatch(devices, [0, 1, 2], [1, 0], 2, torch.device("cpu"))
    ranks, a_ptr, b_ptr, scaling = batch.tables()
    r = max(d.r_max for d in devices)
    assert ranks.tolist() == [d.ranks for d in devices]
    for got, field in ((a_ptr, "a_ptr"), (b_ptr, "b_ptr")):
        want = torch.stack([F.pad(getattr(d, field), (0, r - d.r_max)) for d in devices])
        assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(scaling, torch.stack([d.scaling for d in devices]))


def test_slot_tables_fill_each_placement_once_and_reuse_the_least_recent(tiny_model):
    """The native path's tables kept across steps: a slot per placement, as LoraBatch.tables() would
    lay it out; a full table reuses the slot of the adapter that ran longest ago, never one of the
    step's; a step with more adapters or a larger rank than the tables hold grows them."""
    from asyncserve.lora.batch import SlotTables

    engine = make_engine(tiny_model)
    devices = {name: engine.pager.ensure_resident(name) for name in ADAPTERS}
    tables = SlotTables(engine.model_config.num_layers, len(PROJECTIONS), slots=2, max_rank=1)

    def check(adapters, slots):
        ranks, a_ptr, b_ptr, scaling = tables.tensors
        want = LoraBatch(adapters, [0, 1], [0], 1, torch.device("cpu")).tables()
        r = want[1].shape[-1]
        assert torch.equal(ranks[slots], want[0]) and torch.equal(scaling[slots], want[3])
        assert torch.equal(a_ptr[slots, ..., :r], want[1]) and torch.equal(b_ptr[slots, ..., :r], want[2])
        assert not a_ptr[slots, ..., r:].any() and not b_ptr[slots, ..., r:].any()

    first = [devices["r1_qv"], devices["r2_mlp"]]
    slots = tables.slots(first)
    assert sorted(slots) == [0, 1]
    check(first, slots)
    assert tables.slots(first[::-1]) == slots[::-1]                 # kept, whatever the order
    # a third adapter: the least recently used slot (r2_mlp's, used before r1_qv's last step) goes
    tables.slots([devices["r1_qv"]])
    assert tables.slots([devices["r8_attn_rs"]]) == [slots[1]]
    check([devices["r8_attn_rs"]], [slots[1]])
    assert tables.slots([devices["r1_qv"]]) == [slots[0]]
    # more adapters than slots, and a rank past the tables': both grow, the slots kept stay right
    everything = list(devices.values())
    grown = tables.slots(everything)
    assert len(set(grown)) == len(everything) and tables.tensors[1].shape[-1] == max(d.r_max for d in everything)
    assert grown[0] == slots[0]
    check(everything, grown)


def test_evicting_before_the_copy_drops_it(tiny_model):
    """Pages of an adapter evicted before its copy may already hold KV: the copy must not land."""
    engine = make_engine(tiny_model)
    pager, pool = engine.pager, engine.pool
    name = next(iter(ADAPTERS))
    pages = pager.ensure_resident(name).pages
    pager.unregister(name)                       # idle, so evicted now; its pages are free again
    assert not pager.is_resident(name) and pool.counts().adapter == 0
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


def _assert_rows_in_pool(engine, name):
    """The pool holds every row of the adapter's current load where its pointers say."""
    pager, flat = engine.pager, engine.pool.flat
    device, host = pager.ensure_resident(name), pager.host[name]
    for layer in range(engine.model_config.num_layers):
        for p in range(len(PROJECTIONS)):
            for ptrs, rows in ((device.a_ptr, host.a_rows), (device.b_ptr, host.b_rows)):
                for j in range(host.ranks[p]):
                    start = int(ptrs[layer, p, j])
                    assert torch.equal(flat[start:start + rows[(layer, p)].shape[1]], rows[(layer, p)][j]), name


def test_prefetch_on_the_event_loop_while_the_torch_thread_copies(tiny_model):
    """PagerActor._prefetch pages adapters in on the event loop while write_pending copies in the torch
    thread (issue 12: 'dictionary changed size during iteration', and copies silently dropped). Many
    adapters are paged in and evicted over and over while another thread copies; every copy must land."""
    import dataclasses
    import sys
    import threading

    engine = make_engine(tiny_model)
    pager = engine.pager
    hosts = list(pager.host.values())
    names = []
    for i in range(40):              # distinct weights per name, so a dropped copy shows
        h = hosts[i % len(hosts)]
        name = f"{h.name}-{i}"
        pager.add(dataclasses.replace(h, name=name, a_rows={k: v * (i + 2) for k, v in h.a_rows.items()},
                                      b_rows={k: v * (i + 2) for k, v in h.b_rows.items()}))
        names.append(name)
    stop, errors = threading.Event(), []

    def torch_thread():
        try:
            while not stop.is_set():
                pager.write_pending()
        except Exception as e:       # noqa: BLE001 — reported by the assertion below
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)      # switch threads often, as a busy server does
    copier = threading.Thread(target=torch_thread)
    copier.start()
    try:
        for _ in range(60):
            for name in names:
                assert pager.ensure_resident(name) is not None
            assert pager.make_room(engine.pool.num_pages)      # all idle: evict every one
            for name in names[:len(names) // 2]:
                pager.ensure_resident(name)
            if errors:
                break
    finally:
        stop.set()
        copier.join()
        sys.setswitchinterval(switch)
    assert not errors, errors
    pager.write_pending()
    for name in names[:len(names) // 2]:
        _assert_rows_in_pool(engine, name)
