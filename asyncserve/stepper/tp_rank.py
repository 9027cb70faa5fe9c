"""A tensor-parallel rank 1..N-1: ``python -m asyncserve.stepper.tp_rank <spec> <rank> <settings json>``.

It attaches to the group (ipc/collective.py's ShmGroup or ipc/dist.py's DistGroup, by the spec) and
to the host tier's arena, loads its shard of the model (model/shard.py) onto the group's device (CPU,
or cuda:r's GPU with NCCL), builds its pool (the pages rank 0's has, each a shard of rank 0's page) and
LoRA backend (warmed up: Triton compiles now, not while rank 0 waits in the first step's all-reduce),
starts its CPU LoRA workers where CPU assist is on (pinned to its cores), says it is ready
(group.barrier()), then runs each step rank 0 broadcasts: the adapters paged in since the last step
(its shard of their rows into the named pages), the merged adapter, the cold rows its workers assist,
then the forward over its shard, all-reducing the row-parallel outputs with the other ranks. It
computes no logits. It runs until rank 0 stops it; any error ends it non-zero, which takes the
server down (stepper/tp.py).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys

import torch

from asyncserve.lora.batch import LoraBatch
from asyncserve.model.llama import Rope, build_weights, forward
from asyncserve.model.loader import load_model
from asyncserve.model.shard import Shard, shard_config
from asyncserve.pager.pager import DeviceAdapter, copy_rows, place, row_plan, shard_rows
from asyncserve.pager.pool import PagedPool
from asyncserve.stepper.assist import AssistedLora, LayerAssist
from asyncserve.stepper.merge import WeightMerger
from asyncserve.stepper.runner import make_lora_backend
from asyncserve.stepper.tp import TpPageIn, TpStep, decode_step, step_inputs
from ipc.arena import AdapterHandle, ArenaReader
from ipc.collective import RankDied, ShmGroup
from ipc.dist import DistGroup, attach_group

log = logging.getLogger("asyncserve.tp_rank")


class Rank:
    def __init__(self, group: ShmGroup | DistGroup, settings: dict):
        self.group = group
        self.shard = Shard(group.rank, group.world)
        self.device = device = group.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(len(os.sched_getaffinity(0)))    # the cores RankProcesses pinned it to
        dtype = getattr(torch, settings["dtype"])
        loaded = load_model(settings["model"], keep_quantized=settings["keep_quantized"],
                            quantize=settings["quantize"], shard=self.shard)
        full = loaded.config
        # what the engine settled from its max_model_len (Engine.__init__)
        full.layer_windows, full.rope_scaling = settings["layer_windows"], settings["rope_scaling"]
        self.config = config = shard_config(full, group.world)
        self.weights = build_weights(config, loaded.weights, dtype, device, head=False)
        self.pool = PagedPool(settings["num_pages"], config.num_layers, settings["block_size"], config.num_kv_heads,
                              config.head_dim, dtype, device)
        self.arena = ArenaReader(settings["arena"], settings["arena_slots"])
        self.lora = make_lora_backend(settings["lora_backend"], self.pool, config)
        self.merger = WeightMerger(config, self.weights, self.pool, self.lora)
        self.rope = Rope(config, self.pool.device, dtype)
        self.resident: dict[int, DeviceAdapter] = {}        # by rank 0's DeviceAdapter.generation
        self.lora.warm_up()
        # CPU assist: this rank's own workers, pinned to its cores (last: a failure above leaves none running)
        self.assist = None
        if settings["cpu_workers"]:
            self.assist = LayerAssist(self.arena, config, self.shard, settings["cpu_workers"], dtype,
                                      self.pool.device, settings["max_step_tokens"], sorted(os.sched_getaffinity(0)))

    def page_in(self, p: TpPageIn) -> None:
        """The rank's shard of an adapter's rows into the pages rank 0 gave it."""
        try:
            view = self.arena.view(AdapterHandle(p.slot, p.arena_generation, 0))
        except KeyError:
            return      # evicted from the host tier (and so from the pool) since rank 0 copied it: never used
        plan = row_plan(p.ranks, self.config, self.pool.page_numel)
        copy_rows(self.pool, p.pages, plan.page_spans,
                  shard_rows(view.a_rows, view.b_rows, p.ranks, self.config, self.shard))
        taken = set(p.pages)         # adapters whose pages these were are gone on rank 0
        for generation in [g for g, a in self.resident.items() if taken.intersection(a.pages)]:
            del self.resident[generation]
        self.resident[p.generation] = place("", p.ranks, view.scaling.float(), p.pages, plan, self.pool, p.generation)

    @torch.inference_mode()
    def step(self, step: TpStep) -> None:
        for p in step.page_ins:
            self.page_in(p)
        self.merger.switch(step.merged, self.resident)
        inputs = step_inputs(step, self.pool.block_size, self.device)
        batch = None
        if step.adapters:
            batch = LoraBatch([self.resident[g] for g in step.adapters], step.seg_starts, step.seg_adapter,
                              len(inputs.input_ids), self.pool.device, step.num_decode)
        self.lora.begin_step(batch)
        lora = self.lora
        if self.assist is not None:
            tasks = [(AdapterHandle(c.slot, c.arena_generation, 0), c.row0, c.row1, c.ranks) for c in step.cold]
            self.assist.begin_step(tasks, step.cold_rows, step.cold_workers)
            if self.assist.active:
                lora = AssistedLora(self.assist, self.lora)
        forward(self.weights, self.config, self.rope, self.pool.kv_view(), inputs, lora, self.group.all_reduce_)

    def serve(self) -> None:
        """Step after step until rank 0 stops this process (or dies: the group's wait raises)."""
        while True:
            self.step(decode_step(self.group.broadcast(None)))


def main(argv: list[str]) -> None:
    spec, rank, settings = argv[0], int(argv[1]), json.loads(argv[2])
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(levelname)s %(message)s")
    # rank 0 stops this process with SIGTERM: exit through the finally below, which stops its workers
    stopped = []

    def stop(*_):
        stopped.append(True)
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    group = attach_group(spec, rank)
    worker = None
    code = 0
    try:
        worker = Rank(group, settings)
        group.barrier()                  # ready
        worker.serve()
    except BaseException as e:    # SystemExit from stop(), or the wait it interrupted (posix_ipc.SignalError)
        if stopped:
            pass
        elif isinstance(e, RankDied):
            # the group failed (rank 0 gone or closing, or another rank dead): why, in one line
            log.warning("stopping: %s", e)
            code = 1
        else:
            raise
    finally:
        if worker is not None and worker.assist is not None:
            worker.assist.close()
        group.close()
    # stopped, or the group gone (serve() returns no other way): skip torch's interpreter teardown,
    # seconds on a loaded machine, past the time rank 0 gives a stopped rank before SIGKILL
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
