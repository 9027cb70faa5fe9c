"""LoRA on the token embeddings and the LM head (PEFT's target_modules "embed_tokens" and "lm_head"),
and those modules trained whole (PEFT's modules_to_save).

Their rows are vocabulary-sized, so an adapter keeps them whole beside its pool pages
(pager/adapters.py's VocabRows and SavedModule). A step does, per run of one adapter's rows, what
PEFT's layers do:

    embeddings: h[t] += (A^T[token t] · B^T) · s       before the family's embedding scale (Gemma)
                h[t] = E[token t]                       saved whole
    head:       logits[i] += ((hs[i] · A^T) · B^T) · s   before the final soft cap (Gemma 2)
                logits[i] = hs[i] · W^T                  saved whole

The one-call native layer loop does the head's with the same calls (kernels/cpu/decoder.h, native_head).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from asyncserve.pager.adapters import SavedModule, VocabRows


class VocabRun(NamedTuple):
    start: int
    end: int
    rows: VocabRows | SavedModule


def add_vocab_run(runs: list[VocabRun], start: int, end: int, rows: VocabRows | SavedModule | None) -> None:
    """Rows [start, end) of an adapter join the runs if it has such LoRA (a run right after the same
    adapter's previous one extends it)."""
    if rows is None or start == end:
        return
    if runs and runs[-1].end == start and runs[-1].rows is rows:
        runs[-1] = runs[-1]._replace(end=end)
    else:
        runs.append(VocabRun(start, end, rows))


@dataclass
class VocabStep:
    """A step's LoRA on the embeddings (runs of token rows) and on the head (runs of logits rows, i.e.
    of StepInputs.sample_index)."""
    embed_runs: list[VocabRun] = field(default_factory=list)
    head_runs: list[VocabRun] = field(default_factory=list)

    def embed_(self, h: torch.Tensor, ids: torch.Tensor) -> None:
        """h [T, hidden]: each run's tokens ids [T] embedded by its adapter's own embeddings, or plus its
        embedding LoRA."""
        for start, end, v in self.embed_runs:
            if isinstance(v, SavedModule):
                h[start:end] = v.weight[ids[start:end]]
            else:
                h[start:end] += (v.a[ids[start:end]] @ v.bt) * v.scaling             # [n, r] @ [r, hidden]

    def head_(self, logits: torch.Tensor, hs: torch.Tensor) -> None:
        """logits [n, vocab]: each run's final hidden states hs [n, hidden] through its adapter's own head,
        or plus its head LoRA."""
        for start, end, v in self.head_runs:
            if isinstance(v, SavedModule):
                logits[start:end] = hs[start:end] @ v.weight.T                      # [n, hidden] @ [hidden, vocab]
            else:
                logits[start:end] += ((hs[start:end] @ v.a.T) @ v.bt) * v.scaling     # [n, r] @ [r, vocab]

    def native_head(self) -> tuple:
        """head_'s runs as decoder.h's forward takes them: (runs [n, 3] int64: first row, end row, index
        into the lists, or None; A per adapter; B^T per adapter; scaling per adapter). A head saved whole
        goes as an empty A and its weight [vocab, hidden] for B^T."""
        if not self.head_runs:
            return None, [], [], []
        adapters = list({id(r.rows): r.rows for r in self.head_runs}.values())
        index = {id(v): i for i, v in enumerate(adapters)}
        runs = torch.tensor([(r.start, r.end, index[id(r.rows)]) for r in self.head_runs], dtype=torch.int64)
        saved = [isinstance(v, SavedModule) for v in adapters]
        return (runs, [v.weight.new_empty(0) if s else v.a for v, s in zip(adapters, saved)],
                [v.weight if s else v.bt for v, s in zip(adapters, saved)],
                [1.0 if s else v.scaling for v, s in zip(adapters, saved)])
