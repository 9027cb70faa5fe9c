"""A tensor-parallel rank 1..N-1: ``python -m asyncserve.stepper.tp_rank <spec> <rank> <settings json>``.

It attaches to the group (ipc/collective.py's ShmGroup or ipc/dist.py's DistGroup, by the spec) and
to the host tier's arena, loads its shard of the model (model/shard.py) onto the group's device (CPU,
or cuda:r's GPU with NCCL), builds its pool (the pages rank 0's has, each a shard of rank 0's page) and
LoRA backend (warmed up: Triton compiles now, not while rank 0 waits in the first step's all-reduce),
says it is ready (group.barrier()), then runs each step rank 0 broadcasts: the adapters paged in
since the last step (its shard of their rows into the named pages), the merged adapter, then the
forward over its shard, all-reducing the row-parallel outputs with the other ranks. It computes no
logits. It runs until rank 0 stops it; any error ends it non-zero, which takes the server down
(stepper/tp.py).
"""
from __future__ import annotations

import json
import logging
import os
import sys

import numpy as np
import torch

from asyncserve.lora.batch import LoraBatch
from asyncserve.model.llama import Rope, build_weights, forward
from asyncserve.model.loader import load_model
from asyncserve.model.shard import Shard, shard_config
from asyncserve.pager.pager import DeviceAdapter, copy_rows, place, row_plan, shard_rows
from asyncserve.pager.pool import PagedPool
from asyncserve.stepper.merge import WeightMerger
from asyncserve.stepper.runner import make_lora_backend
from asyncserve.stepper.tp import TpPageIn, TpStep, decode_step, step_inputs
from ipc import names
from ipc.arena import read_adapter
from ipc.collective import RankDied, ShmGroup
from ipc.dist import DistGroup, attach_group
from ipc.layout import DIR_ENTRY

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
        self.arena = names.attach_shm(settings["arena"])
        self.directory = np.frombuffer(self.arena, dtype=DIR_ENTRY, count=settings["arena_slots"])
        self.lora = make_lora_backend(settings["lora_backend"], self.pool, config)
        self.merger = WeightMerger(config, self.weights, self.pool, self.lora)
        self.rope = Rope(config, self.pool.device, dtype)
        self.resident: dict[int, DeviceAdapter] = {}        # by rank 0's DeviceAdapter.generation
        self.lora.warm_up()

    def page_in(self, p: TpPageIn) -> None:
        """The rank's shard of an adapter's rows into the pages rank 0 gave it."""
        entry = self.directory[p.slot]
        if not entry["live"] or int(entry["generation"]) != p.arena_generation:
            return      # evicted from the host tier (and so from the pool) since rank 0 copied it: never used
        view = read_adapter(self.arena, entry)
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
        forward(self.weights, self.config, self.rope, self.pool.kv_view(), inputs, self.lora,
                self.group.all_reduce_)

    def serve(self) -> None:
        """Step after step until rank 0 stops this process (or dies: the group's wait raises)."""
        while True:
            self.step(decode_step(self.group.broadcast(None)))


def main(argv: list[str]) -> None:
    spec, rank, settings = argv[0], int(argv[1]), json.loads(argv[2])
    logging.basicConfig(level=logging.WARNING, format=f"tp rank {rank}: %(levelname)s %(message)s")
    group = attach_group(spec, rank)
    try:
        worker = Rank(group, settings)
        group.barrier()                  # ready
        worker.serve()
    except RankDied as e:
        # the group failed (rank 0 gone or closing, or another rank dead): why, in one line
        log.warning("stopping: %s", e)
        sys.exit(1)
    finally:
        group.close()


if __name__ == "__main__":
    main(sys.argv[1:])
