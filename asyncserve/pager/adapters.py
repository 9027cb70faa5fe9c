"""PEFT LoRA adapters read from disk into host memory, validated against the base model.

Every registered adapter keeps its weights here (S-LoRA keeps all adapters in host RAM); the pager
copies them into pool pages while requests use them. Rows are stored the way the pool wants them:
A as [r, in] and B transposed, [r, out], per (layer, projection), zero-padded to one rank per
projection (rank_pattern may vary it across layers; zero rows contribute nothing).

Registering an adapter reads no weights: ``inspect_peft_folder`` reads adapter_config.json and the
safetensors header only, and checks all they tell (the disk tier: thousands of adapters cost little).

Loading is two halves so that a large adapter never holds up the steps: ``read_peft_folder`` reads
the files and checks everything the safetensors header and the config tell (no torch; the server
runs it in a worker thread), and ``build_in_pieces`` lays the tensors out one layer per piece (the
server runs each piece in the torch thread between two steps). Weights that are not finite in the
serving dtype are refused: one NaN would reach every sequence batched with the adapter. A DoRA
adapter's magnitudes become its per-output scales as it is built (lora/dora.py, given the base weights).

A folder is untrusted input: whatever is wrong with it is an AdapterError that says why, never
another exception. adapter_config.json is read as a typed, bounded AdapterConfig, and its
rank_pattern / alpha_pattern keys by the bounded matcher of ``patterns.py``; the safetensors header's
length is checked against the file and MAX_HEADER_BYTES before the header is read, and the header
before any weight: its entries are typed (HeaderEntry), no name appears twice, they tile the data
without gaps or overlaps, and the file ends where the data does.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, BinaryIO, Iterator, NamedTuple

import msgspec
import torch

from asyncserve.model.checkpoint import all_finite
from asyncserve.model.config import EXPERT_PROJECTIONS, PROJ_INDEX, PROJECTIONS, ModelConfig
from asyncserve.pager.gguf_adapter import BadAdapterFile, is_gguf_file, read_gguf_adapter
from asyncserve.pager.patterns import PatternError, PatternTable


class AdapterError(ValueError):
    """An adapter that cannot be served with this base model; the message says why."""


# a decoder layer's module, in its attention or MLP (Qwen2-MoE's: the shared expert): which ones the base
# model has is ModelConfig.peft_modules; its tensor: lora_A, lora_B, or DoRA's magnitude ("M" below)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp(?:\.shared_expert)?)\.(\w+)\."
                  r"(?:lora_([AB])(?:\.[\w-]+)?\.weight|(lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")

# LoRA on a routed expert's projection (a mixture of experts, ModelConfig.moe), as PEFT names it on the
# per-expert Linear modules of transformers before v5: Qwen's mlp.experts.{e}.{gate,up,down}_proj, Mixtral's
# block_sparse_moe.experts.{e}.{w1,w3,w2}
_EXPERT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.(?:lora_([AB])(?:\.[\w-]+)?\.weight|(lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# ... and as PEFT's target_parameters names it on transformers v5's stacked experts (mlp.experts.gate_up_proj
# [experts, 2 inter, hidden], down_proj [experts, hidden, inter]): one LoRA per parameter, lora_A [r * experts,
# in], lora_B [out, r * experts] (expert e: rows e*r.. of A, columns e::experts of B). Two targeted parameters
# nest: the one registered first (gate_up_proj) is the inner wrapper, its keys one "base_layer." deeper.
_STACKED_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])(?:\.[\w-]+)?\.weight$")
STACKED_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# LoRA on the router (Qwen's and transformers v5's mlp.gate, Mixtral's v4 block_sparse_moe.gate; PEFT's
# all-linear takes it on v4) or on Qwen2-MoE's shared expert gate
_GATE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(mlp|block_sparse_moe)\.(gate|shared_expert_gate)\."
                       r"(?:lora_([AB])(?:\.[\w-]+)?\.weight|(lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")

# LoRA on the token embeddings (PEFT: embed_tokens.lora_embedding_A/B) or the LM head (lm_head.lora_A/B),
# and the copies of their base weights PEFT saves beside them (save_embedding_layers)
_VOCAB_KEY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.(?:lora_embedding_([AB])|lora_([AB])(?:\.[\w-]+)?\.weight"
                        r"|(base_layer)\.weight|(lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
VOCAB_MODULES = {"embed_tokens": "embed", "lm_head": "head"}
# LoRA on a linear-attention layer's projections (Qwen3.5's Gated DeltaNet, ModelConfig.linear_layers)
_LINEAR_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\."
                         r"(?:lora_([AB])(?:\.[\w-]+)?\.weight|(lora_magnitude_vector)(?:\.[\w-]+)?(?:\.weight)?)$")
# modules_to_save: PEFT saves the trained copy of a whole module under the module's own name
_SAVED_KEY = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.weight$")

# safetensors dtype -> (torch dtype, bytes per element); adapters are float tensors
_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
           "BF16": (torch.bfloat16, 2)}

# what a folder may hold before anything past it is read: an adapter's header is ~150 bytes a tensor
MAX_CONFIG_BYTES = 4 << 20
MAX_HEADER_BYTES = 16 << 20
MAX_TENSOR_NAME = 1024
MAX_RANK = 65536
MAX_ALPHA = 1e6
MAX_NAME_CHARS = 256          # adapter names (they become metric labels and log text)

Rank = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANK)]
Alpha = Annotated[float, msgspec.Meta(ge=-MAX_ALPHA, le=MAX_ALPHA)]


class AdapterConfig(msgspec.Struct, forbid_unknown_fields=False):
    """The adapter_config.json fields this server reads, typed and bounded; PEFT's defaults."""
    peft_type: str = "LORA"
    r: Rank | None = None                       # None: the weights' rank
    lora_alpha: Alpha | None = None             # None: r
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    use_dora: bool = False
    lora_bias: bool = False
    bias: str | None = "none"
    modules_to_save: list[str] | None = None
    ensure_weight_tying: bool = False
    rank_pattern: dict[str, Rank] | None = None
    alpha_pattern: dict[str, Alpha] | None = None
    target_parameters: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_TENSOR_NAME)]],
                                 msgspec.Meta(max_length=64)] | None = None


Size = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]      # safetensors sizes and offsets (msgspec: int64)


class HeaderEntry(msgspec.Struct):
    """One tensor of a safetensors header."""
    dtype: str
    shape: Annotated[list[Size], msgspec.Meta(max_length=8)]
    data_offsets: tuple[Size, Size]


def check_adapter_name(name: str) -> None:
    """A name a client or a folder gives an adapter: printable (no forged log lines) and bounded."""
    if not isinstance(name, str) or not name:
        raise AdapterError("an adapter name must be a non-empty string")
    if len(name) > MAX_NAME_CHARS:
        raise AdapterError(f"adapter name {name[:40]!r}... is {len(name)} characters; at most {MAX_NAME_CHARS}")
    if not name.isprintable():
        raise AdapterError(f"adapter name {name!r} has control or other non-printable characters")


def printable(text: str) -> str:
    """``text`` for a log line: as it is where printable, else escaped (a newline cannot start a forged line)."""
    return text if text.isprintable() else repr(text)[1:-1]


@dataclass
class VocabRows:
    """LoRA on the token embeddings ("embed") or the LM head ("head"), kept whole beside the pool's pages
    (vocabulary-sized rows): y += (x·A^T)·B^T·scaling, x a token's one-hot (embed) or its final hidden
    state (head). A linear-attention layer's projection keeps its LoRA the same way, as the head's."""
    a: torch.Tensor              # embed: A^T [vocab, r], a token's row; head: A [r, hidden]
    bt: torch.Tensor             # embed: B^T [r, hidden]; head: B^T [r, vocab]
    scaling: float

    def to(self, device: torch.device) -> VocabRows:
        return VocabRows(self.a.to(device), self.bt.to(device), self.scaling)


@dataclass
class SavedModule:
    """A module the adapter trained whole (PEFT's modules_to_save): its embeddings or its head replace the
    base's for the adapter's rows, kept beside the pool's pages as VocabRows are."""
    weight: torch.Tensor         # [vocab, hidden]: a token's embedding row, or the head's row of a token

    def to(self, device: torch.device) -> SavedModule:
        return SavedModule(self.weight.to(device))


@dataclass
class HostAdapter:
    name: str
    path: str
    ranks: list[int]                     # per projection (ModelConfig.lora_projections order), 0 = not targeted
    scaling: torch.Tensor                # [L, P] float32
    a_rows: dict[tuple[int, int], torch.Tensor]   # (layer, proj) -> [r_p, in]
    b_rows: dict[tuple[int, int], torch.Tensor]   # (layer, proj) -> [r_p, out] (B transposed)
    dora_scale: torch.Tensor | None = None        # DoRA's g, [L, all projections' outputs] float32 (lora/dora.py)
    embed: VocabRows | SavedModule | None = None
    head: VocabRows | SavedModule | None = None
    # LoRA on the linear-attention layers' projections: (layer, module) -> its A [r, in] and B^T [r, out]
    linear_attn: dict[tuple[int, str], VocabRows] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of its pool rows."""
        return sum(t.numel() * t.element_size() for d in (self.a_rows, self.b_rows) for t in d.values())

    @property
    def unpaged_nbytes(self) -> int:
        """Bytes it keeps beside the pool: DoRA's scales, the vocabulary's LoRA rows or saved modules."""
        parts = [self.dora_scale] + [t for v in (self.embed, self.head) if v is not None
                                     for t in ((v.weight,) if isinstance(v, SavedModule) else (v.a, v.bt))]
        parts += [t for v in (self.linear_attn or {}).values() for t in (v.a, v.bt)]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def row_lengths(self, config: ModelConfig) -> list[int]:
        return row_lengths(self.ranks, config)

    def info(self, file_bytes: int) -> AdapterInfo:
        """What registering it records (its file's size given): the same as inspect_peft_folder finds."""
        vocab = self.embed is not None or self.head is not None
        return AdapterInfo(self.name, self.path, self.ranks, file_bytes, vocab, self.linear_attn is not None)


def row_lengths(ranks: list[int], config: ModelConfig) -> list[int]:
    """An adapter's row lengths in pool packing order: per layer, per projection, A rows then B^T rows."""
    shapes = config.projection_shapes()
    lengths = []
    for layer in range(config.num_layers):
        for p, proj in enumerate(config.lora_projections()):
            r = ranks[p]
            fan_in, fan_out = shapes[proj]
            lengths += [fan_in] * r + [fan_out] * r
    return lengths


@dataclass
class StoredTensor:
    """Where one tensor lies in the safetensors data, as its header says."""
    key: str
    dtype: str                           # safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    begin: int                           # byte offsets into PeftFolder.weights
    end: int
    # a stacked expert's B (_STACKED_KEY): the bytes hold [shape[0], shape[1] * every], of whose columns
    # this tensor is every every-th from ``column``
    every: int = 1
    column: int = 0


@dataclass
class PeftFolder:
    """A PEFT folder read into memory and checked against the base model, before any tensor is built."""
    name: str
    path: str
    config: ModelConfig
    ranks: list[int]                     # per projection, the largest rank over the layers
    scaling: list[list[float]]           # [L][P]
    modules: dict[tuple[int, int], dict[str, StoredTensor]]   # (layer, proj) -> {"A", "B", DoRA's "M"}
    fan_in_fan_out: bool
    weights: bytearray                   # adapter_model.safetensors
    dora: bool = False                   # use_dora: every module has a magnitude "M"
    vocab: dict[str, tuple[StoredTensor, StoredTensor, float] | StoredTensor] | None = None
    # "embed"/"head": LoRA's A, B and scaling, or the saved module's weight (modules_to_save)
    linear_attn: dict[tuple[int, str], tuple[StoredTensor, StoredTensor, float]] | None = None
    # (layer, linear_attn module): LoRA's A, B and scaling


@dataclass
class AdapterInfo:
    """What registration knows of a PEFT folder without reading its weights."""
    name: str
    path: str
    ranks: list[int]                     # per projection, the largest rank over the layers
    file_bytes: int                      # adapter_model.safetensors
    vocab: bool = False                  # LoRA on the embeddings or the head, or either saved whole
    linear_attn: bool = False            # LoRA on the linear-attention layers' projections


def load_peft_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                      dora=None) -> HostAdapter:
    return build_host_adapter(read_peft_folder(name, path, config), dtype, dora)


def inspect_peft_folder(name: str, path: str | Path, config: ModelConfig) -> AdapterInfo:
    """adapter_config.json and the safetensors header, checked as read_peft_folder checks them; no
    weights are read (a bad folder found later, at load, fails then). A llama.cpp GGUF adapter file:
    its header, checked the same way."""
    if is_gguf_file(path):
        acfg, stored, _ = _gguf_contents(name, Path(path).expanduser(), config, weights=False)
        c = _check_against_model(name, str(path), acfg, stored, config)
        return AdapterInfo(name, str(path), c.ranks, os.path.getsize(Path(path).expanduser()), bool(c.vocab),
                           bool(c.linear_attn))
    folder, acfg, weights_file = _peft_files(name, path)
    with open(weights_file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        stored = _read_safetensors_header(name, f, size)
    c = _check_against_model(name, str(folder), acfg, stored, config)
    return AdapterInfo(name, str(folder), c.ranks, size, bool(c.vocab), bool(c.linear_attn))


def read_peft_folder(name: str, path: str | Path, config: ModelConfig) -> PeftFolder:
    """File reads and every check the config and the safetensors header allow (no torch: the server
    runs this off the torch thread). A llama.cpp GGUF adapter file is read whole, as float32 (torch
    there, off the torch thread too)."""
    if is_gguf_file(path):
        acfg, stored, weights = _gguf_contents(name, Path(path).expanduser(), config, weights=True)
        c = _check_against_model(name, str(path), acfg, stored, config)
        return PeftFolder(name, str(path), config, c.ranks, c.scaling, c.modules, False, weights, False, c.vocab,
                          c.linear_attn)
    folder, acfg, weights_file = _peft_files(name, path)
    with open(weights_file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        stored = _read_safetensors_header(name, f, size)      # before a byte of the weights is read
        weights = bytearray(size)
        f.seek(0)
        if f.readinto(weights) != size:
            raise AdapterError(f"adapter {name!r}: adapter_model.safetensors changed while it was read")
    c = _check_against_model(name, str(folder), acfg, stored, config)
    return PeftFolder(name, str(folder), config, c.ranks, c.scaling, c.modules, c.fan_in_fan_out, weights,
                      acfg.use_dora, c.vocab, c.linear_attn)


def _gguf_contents(name: str, path: Path, config: ModelConfig, weights: bool
                   ) -> tuple[AdapterConfig, list[StoredTensor], bytearray | None]:
    """A llama.cpp adapter file (gguf_adapter.py) as a PEFT folder's config, header and data: its tensors
    float32 end to end. llama.cpp's alpha 0 (scaling 1 per tensor) is alpha = rank where ranks agree."""
    try:
        alpha, tensors, data = read_gguf_adapter(name, path, config, weights)
    except BadAdapterFile as e:
        raise AdapterError(str(e)) from None
    stored, offset = [], 0
    for key, shape in tensors:
        size = math.prod(shape) * 4
        stored.append(StoredTensor(key, "F32", shape, offset, offset + size))
        offset += size
    if alpha is None:
        ranks = {t.shape[0] for t in stored if ".lora_A." in t.key}
        if len(ranks) != 1:
            raise AdapterError(f"adapter {name!r}: {path} has adapter.lora.alpha 0 (no scaling) and tensors of ranks "
                               f"{sorted(ranks)}; give it an alpha")
        alpha = float(ranks.pop())
    return AdapterConfig(lora_alpha=alpha), stored, data


def _peft_files(name: str, path: str | Path) -> tuple[Path, AdapterConfig, Path]:
    """(folder, its adapter_config.json, its safetensors file), checked to be a supported PEFT LoRA."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is neither a PEFT adapter folder nor a llama.cpp GGUF "
                           "adapter file")
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise AdapterError(f"adapter {name!r}: {cfg_file} is missing (expected a PEFT LoRA folder)")
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(
                f"adapter {name!r}: only adapter_model.bin (a pickle) was found; pickles can run code and "
                "are not loaded. Re-save it with safetensors (PeftModel.save_pretrained(..., "
                "safe_serialization=True)).")
        raise AdapterError(f"adapter {name!r}: {weights_file} is missing")
    acfg = _read_config(name, cfg_file)
    if acfg.peft_type.upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {acfg.peft_type!r} is not LORA")
    if acfg.lora_bias:
        raise AdapterError(f"adapter {name!r}: LoRA bias adapters are not supported")
    if acfg.bias not in ("none", None):
        raise AdapterError(f"adapter {name!r}: bias={acfg.bias!r} is not supported (only 'none')")
    others = [m for m in acfg.modules_to_save or () if m.rsplit(".", 1)[-1] not in VOCAB_MODULES]
    if others:
        raise AdapterError(f"adapter {name!r}: modules_to_save {others} would replace base weights every "
                           "request shares; of saved modules, only embed_tokens and lm_head are served")
    return folder, acfg, weights_file


def _read_config(name: str, cfg_file: Path) -> AdapterConfig:
    """adapter_config.json: a UTF-8 JSON object of bounded size whose fields we use have their types."""
    def bad(why: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: adapter_config.json is not a valid PEFT config ({why})")

    with open(cfg_file, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise bad(f"more than {MAX_CONFIG_BYTES} bytes")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8: {e.reason} at byte {e.start}") from None
    try:
        return msgspec.json.decode(raw, type=AdapterConfig)
    except msgspec.ValidationError as e:
        raise bad(str(e)) from None
    except (msgspec.DecodeError, RecursionError, ValueError) as e:
        raise bad(f"not JSON: {e}") from None


def _read_safetensors_header(name: str, f: BinaryIO, file_size: int) -> list[StoredTensor]:
    """The tensors a safetensors file of ``file_size`` bytes holds (8-byte header length, JSON header,
    data), read from ``f`` at its start: the header's length is checked against the file and
    MAX_HEADER_BYTES before the header is read, and the header's entries must tile the data exactly
    (no duplicate names, gaps or overlaps), each the size its shape and dtype give, the data ending
    where the file does. Nothing past the header is read."""
    def bad(why: str) -> AdapterError:
        return AdapterError(f"adapter {name!r}: adapter_model.safetensors is not a valid safetensors file ({why})")

    head = f.read(8)
    if file_size < 8 or len(head) < 8:
        raise bad("shorter than its header length")
    n = int.from_bytes(head, "little")
    if n > file_size - 8:
        raise bad(f"header length {n} runs past the end of the file")
    if n > MAX_HEADER_BYTES:
        raise bad(f"header of {n} bytes; at most {MAX_HEADER_BYTES}")
    raw = f.read(n)
    if len(raw) != n:
        raise bad("shorter than its header length")

    def no_duplicates(pairs: list) -> dict:
        names = [k for k, _ in pairs]
        if len(set(names)) != len(names):
            raise bad(f"the name {next(k for k in names if names.count(k) > 1)!r} appears twice")
        return dict(pairs)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except AdapterError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"header is not UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad("__metadata__ is not an object of strings")
    try:
        entries = msgspec.convert(header, type=dict[str, HeaderEntry])
    except msgspec.ValidationError as e:
        raise bad(f"malformed entry: {e}") from None
    start, size = 8 + n, file_size - 8 - n
    out, data_end = [], 0
    for key, entry in sorted(entries.items(), key=lambda item: item[1].data_offsets):
        begin, end = entry.data_offsets
        if len(key) > MAX_TENSOR_NAME:
            raise bad(f"a tensor name of {len(key)} characters; at most {MAX_TENSOR_NAME}")
        if entry.dtype not in _DTYPES:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is {entry.dtype}; LoRA weights must be one of "
                               f"{', '.join(_DTYPES)}")
        if begin != data_end:
            raise bad(f"tensor {key!r} starts at {begin}, not where the one before it ends ({data_end}): "
                      "a gap or an overlap")
        if not begin <= end <= size or end - begin != math.prod(entry.shape) * _DTYPES[entry.dtype][1]:
            raise bad(f"tensor {key!r}'s data offsets [{begin}, {end}] do not fit its shape {entry.shape} or the file")
        data_end = end
        out.append(StoredTensor(key, entry.dtype, tuple(entry.shape), start + begin, start + end))
    if data_end != size:
        raise bad(f"the file is {file_size} bytes; its header says {8 + n + data_end}")
    return out


class Checked(NamedTuple):
    """What _check_against_model finds, as PeftFolder holds it."""
    ranks: list[int]
    scaling: list[list[float]]
    modules: dict
    fan_in_fan_out: bool
    vocab: dict
    linear_attn: dict


def _check_against_model(name: str, path: str, acfg: AdapterConfig, stored: list[StoredTensor],
                         config: ModelConfig) -> Checked:
    """The folder's tensors as PeftFolder holds them, checked against the base model."""
    alpha = acfg.lora_alpha if acfg.lora_alpha is not None else (acfg.r or 8)
    fan_in_fan_out = acfg.fan_in_fan_out
    try:
        rank_pattern = PatternTable(acfg.rank_pattern or {}, "rank_pattern")
        alpha_pattern = PatternTable(acfg.alpha_pattern or {}, "alpha_pattern")
    except PatternError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from None

    shapes = config.projection_shapes()
    peft_modules = config.peft_modules()
    found: dict[tuple[int, str], dict[str, StoredTensor]] = {}
    experts = ExpertsFound()
    vocab_found: dict[str, dict[str, StoredTensor]] = {}
    base_copies: dict[str, StoredTensor] = {}
    saved: dict[str, StoredTensor] = {}
    linear_found: dict[tuple[int, str], dict[str, StoredTensor]] = {}
    prefixes: dict[int, str] = {}         # per layer, the path PEFT names its modules under (model.)
    for t in stored:
        if config.towers and _module_root(t.key) in config.towers:
            continue       # a multimodal base's vision encoder or projector: text never runs through them
        if config.moe is not None and experts.add(name, t, config):
            continue
        if (v := _SAVED_KEY.search(t.key)) is not None:
            saved[VOCAB_MODULES[v.group(1)]] = t
            continue
        if (v := _VOCAB_KEY.search(t.key)) is not None:
            module = VOCAB_MODULES[v.group(1)]
            if v.group(5):
                raise AdapterError(f"adapter {name!r}: DoRA on {v.group(1)} is not served (DoRA on the decoder "
                                   "layers' projections is)")
            if v.group(4):
                base_copies[module] = t
            elif (v.group(2) is None) == (module == "embed"):
                raise AdapterError(f"adapter {name!r}: {t.key!r} is not how PEFT names LoRA on {v.group(1)}")
            else:
                vocab_found.setdefault(module, {})[v.group(2) or v.group(3)] = t
            continue
        if config.linear_layers and (v := _LINEAR_KEY.search(t.key)) is not None:
            layer = int(v.group(1))
            if v.group(4):
                raise AdapterError(f"adapter {name!r}: DoRA on the linear-attention layers' {v.group(2)} is not "
                                   "served (DoRA on the attention layers' and the MLPs' projections is)")
            if layer >= config.num_layers or not config.is_linear(layer):
                raise AdapterError(f"adapter {name!r}: {t.key!r} is for layer {layer}, which is not a "
                                   "linear-attention layer of the base model")
            linear_found.setdefault((layer, v.group(2)), {})[v.group(3)] = t
            prefixes.setdefault(layer, _module_path(t.key[:v.start(1)]).removesuffix("layers."))
            continue
        m = _KEY.search(t.key)
        if m is None or m.group(3) not in peft_modules or m.group(2) != _container(config, m.group(3)):
            raise AdapterError(f"adapter {name!r}: tensor {t.key!r} targets a module that {config.family.name} "
                               f"models do not have (their LoRA targets: {_targets(config, peft_modules)})")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4) or "M"
        if ab == "M" and not acfg.use_dora:
            raise AdapterError(f"adapter {name!r}: {t.key!r} is a DoRA magnitude but adapter_config.json does "
                               "not set use_dora")
        if layer >= config.num_layers:
            raise AdapterError(f"adapter {name!r}: {t.key!r} is for layer {layer}, the base model has "
                               f"{config.num_layers} layers")
        if m.group(2) == "self_attn" and config.is_linear(layer):
            raise AdapterError(f"adapter {name!r}: {t.key!r} is for layer {layer}, a linear-attention layer, "
                               "which has no self_attn")
        found.setdefault((layer, module), {})[ab] = t
        prefixes.setdefault(layer, _module_path(t.key[:m.start(1)]).removesuffix("layers."))
    if not found and not experts.any:
        raise AdapterError(f"adapter {name!r}: no LoRA tensors on the decoder layers' projections in "
                           f"{path}/adapter_model.safetensors (LoRA on the embeddings or the head alone is not served)")
    modules = _split_fused_modules(name, found, peft_modules, shapes, fan_in_fan_out)
    expert_modules, expert_names = experts.modules(name, acfg, config)
    modules.update(expert_modules)
    vocab = _check_vocab(name, acfg, vocab_found, base_copies, config, rank_pattern, alpha_pattern, alpha)
    vocab.update(_check_saved(name, acfg, saved, vocab, config))
    linear_attn = {}
    for (layer, module), ab in sorted(linear_found.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} linear_attn.{module} has lora_{''.join(sorted(ab))} "
                               "but not both A and B")
        fan_in, fan_out = _linear_attention_shape(config, module)
        a_shape, b_shape = (s.shape[::-1] if fan_in_fan_out else s.shape for s in (ab["A"], ab["B"]))
        r = a_shape[0] if a_shape else 0
        if a_shape != (r, fan_in) or b_shape != (fan_out, r) or r == 0:
            raise AdapterError(f"adapter {name!r}: layer {layer} linear_attn.{module} has lora_A {a_shape} and lora_B "
                               f"{b_shape}; this base model needs A [r, {fan_in}] and B [{fan_out}, r]")
        path_name = f"{prefixes.get(layer, 'model.')}layers.{layer}.linear_attn.{module}"
        linear_attn[(layer, module)] = (ab["A"], ab["B"],
                                        _module_scaling(name, acfg, path_name, r, rank_pattern, alpha_pattern, alpha))

    projections = config.lora_projections()
    ranks = [0] * len(projections)
    scaling = [[0.0] * len(projections) for _ in range(config.num_layers)]
    for (layer, p), ab in modules.items():
        proj = projections[p]
        if set(ab) - {"M"} != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {proj} has lora_{''.join(sorted(set(ab) - {'M'}))} "
                               "but not both A and B")
        fan_in, fan_out = shapes[proj]
        if acfg.use_dora:
            if "M" not in ab:
                raise AdapterError(f"adapter {name!r}: use_dora is set but layer {layer} {proj} has no "
                                   "lora_magnitude_vector")
            if ab["M"].shape != (fan_out,):
                raise AdapterError(f"adapter {name!r}: layer {layer} {proj}'s lora_magnitude_vector is "
                                   f"{list(ab['M'].shape)}; this base model needs [{fan_out}]")
        a_shape, b_shape = (s.shape[::-1] if fan_in_fan_out else s.shape for s in (ab["A"], ab["B"]))
        r = a_shape[0] if a_shape else 0
        if a_shape != (r, fan_in) or b_shape != (fan_out, r) or r == 0:
            raise AdapterError(
                f"adapter {name!r}: layer {layer} {proj} has lora_A {a_shape} and lora_B {b_shape}; this base "
                f"model needs A [r, {fan_in}] and B [{fan_out}, r] — was it trained for a different base model?")
        if (module := expert_names.get((layer, p))) is None:
            peft_name = _peft_name(config, proj)
            module = f"{prefixes.get(layer, 'model.')}layers.{layer}.{_container(config, peft_name)}.{peft_name}"
        scaling[layer][p] = _module_scaling(name, acfg, module, r, rank_pattern, alpha_pattern, alpha)
        ranks[p] = max(ranks[p], r)
    return Checked(ranks, scaling, modules, fan_in_fan_out, vocab, linear_attn)


def _linear_attention_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a linear-attention layer's projection."""
    la, h = config.linear_attention, config.hidden_size
    return {"in_proj_qkv": (h, la.conv_dim), "in_proj_z": (h, la.value_dim), "in_proj_b": (h, la.num_v_heads),
            "in_proj_a": (h, la.num_v_heads), "out_proj": (la.value_dim, h)}[module]


def _module_path(key: str) -> str:
    """A tensor's name as the model names it: without PEFT's base_model.model. wrapper."""
    return key.removeprefix("base_model.model.")


def _module_root(key: str) -> str:
    """The top module a tensor is in, under the model's "model." (a multimodal model's vision_tower)."""
    return _module_path(key).removeprefix("model.").split(".", 1)[0]


def _module_scaling(name: str, acfg: AdapterConfig, module: str, r: int, rank_pattern: PatternTable,
                    alpha_pattern: PatternTable, alpha: float) -> float:
    """A module's LoRA scaling, alpha / r (or / sqrt(r) with rsLoRA), by its rank and alpha patterns;
    its rank in the weights must be the one the config gives it."""
    try:
        r_cfg = rank_pattern.lookup(module, acfg.r if acfg.r is not None else r)
        a = alpha_pattern.lookup(module, alpha)
    except PatternError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from None
    if r_cfg != r:
        raise AdapterError(f"adapter {name!r}: {module} has rank {r} in the weights but {r_cfg} in the config")
    return a / math.sqrt(r) if acfg.use_rslora else a / r


def _check_vocab(name: str, acfg: AdapterConfig, found: dict[str, dict[str, StoredTensor]],
                 base_copies: dict[str, StoredTensor], config: ModelConfig, rank_pattern: PatternTable,
                 alpha_pattern: PatternTable, alpha: float) -> dict[str, tuple[StoredTensor, StoredTensor, float]]:
    """LoRA on the embeddings and the head: "embed"/"head" -> (A, B, scaling), checked against the base.
    The copies of the base weights PEFT saves beside them are not read (the base's own are used), but
    their shape must be the base's: a resized vocabulary (added tokens) is refused."""
    vocab_size, hidden = config.vocab_size, config.hidden_size
    out = {}
    for module, ab in found.items():
        peft_name = "embed_tokens" if module == "embed" else "lm_head"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {peft_name} has LoRA {''.join(sorted(ab))} but not both A and B")
        r = ab["A"].shape[0] if len(ab["A"].shape) == 2 else 0
        want = ((r, vocab_size), (hidden, r)) if module == "embed" else ((r, hidden), (vocab_size, r))
        if r == 0 or (ab["A"].shape, ab["B"].shape) != want:
            raise AdapterError(f"adapter {name!r}: {peft_name}'s LoRA A {list(ab['A'].shape)} and B "
                               f"{list(ab['B'].shape)}; this base model needs A {list(want[0])} and B {list(want[1])} "
                               f"(its vocabulary has {vocab_size} tokens, hidden size {hidden})")
        module_name = "model.embed_tokens" if module == "embed" else "lm_head"
        out[module] = (ab["A"], ab["B"], _module_scaling(name, acfg, module_name, r, rank_pattern, alpha_pattern, alpha))
    for module, t in base_copies.items():
        if module not in out:
            raise AdapterError(f"adapter {name!r}: {t.key!r} is a copy of a base weight with no LoRA on it")
        if t.shape != (vocab_size, hidden):
            raise AdapterError(f"adapter {name!r}: its {t.key!r} is {list(t.shape)}, the base's is "
                               f"[{vocab_size}, {hidden}]: a resized vocabulary (added tokens) is not served")
    if out and acfg.ensure_weight_tying:
        raise AdapterError(f"adapter {name!r}: ensure_weight_tying (one LoRA shared by tied embeddings and head) "
                           "is not served")
    return out


def _check_saved(name: str, acfg: AdapterConfig, saved: dict[str, StoredTensor], lora: dict, config: ModelConfig
                 ) -> dict[str, StoredTensor]:
    """modules_to_save's embed_tokens and lm_head: "embed"/"head" -> the trained weight, each one the
    config names, of the base's shape, and not also given LoRA."""
    listed = {VOCAB_MODULES[m.rsplit(".", 1)[-1]] for m in acfg.modules_to_save or ()}
    peft_names = {module: peft for peft, module in VOCAB_MODULES.items()}
    if missing := sorted(peft_names[m] for m in listed - set(saved)):
        raise AdapterError(f"adapter {name!r}: modules_to_save names {', '.join(missing)}, but "
                           "adapter_model.safetensors holds no weight of it")
    if saved and acfg.ensure_weight_tying:
        raise AdapterError(f"adapter {name!r}: ensure_weight_tying (one saved module shared by tied embeddings "
                           "and head) is not served")
    want = (config.vocab_size, config.hidden_size)
    for module, t in saved.items():
        if module not in listed:
            raise AdapterError(f"adapter {name!r}: {t.key!r} replaces a base weight, but modules_to_save does "
                               f"not name {peft_names[module]}")
        if module in lora:
            raise AdapterError(f"adapter {name!r}: {peft_names[module]} is both saved whole and given LoRA")
        if t.shape != want:
            raise AdapterError(f"adapter {name!r}: its {t.key!r} is {list(t.shape)}, the base's is {list(want)}"
                               + (": a resized vocabulary (added tokens) is not served" if len(t.shape) == 2
                                  and t.shape[1] == want[1] else ""))
    return saved


def _split_fused_modules(name: str, found: dict[tuple[int, str], dict[str, StoredTensor]],
                         peft_modules: dict[str, tuple[str, ...]], shapes: dict[str, tuple[int, int]],
                         fan_in_fan_out: bool) -> dict[tuple[int, int], dict[str, StoredTensor]]:
    """(layer, PEFT module) -> (layer, projection). A fused module (Phi-3's qkv_proj, gate_up_proj)
    covers several projections: each takes the module's A and the rows of B at its output slice
    (B [out, r] is row-major, so a slice is a contiguous byte range of the file)."""
    modules: dict[tuple[int, int], dict[str, StoredTensor]] = {}
    for (layer, module), ab in found.items():
        parts = peft_modules[module]
        if len(parts) == 1:
            modules[(layer, PROJ_INDEX[parts[0]])] = ab
            continue
        a, b, magnitude = ab.get("A"), ab.get("B"), ab.get("M")
        if a is None or b is None:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(sorted(set(ab) - {'M'}))} "
                               "but not both A and B")
        if fan_in_fan_out:
            raise AdapterError(f"adapter {name!r}: fan_in_fan_out is not supported on the fused module {module}")
        widths = [shapes[p][1] for p in parts]
        r = b.shape[1] if len(b.shape) == 2 else 0
        if b.shape != (sum(widths), r):
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_B {b.shape}; this base model "
                               f"needs [{sum(widths)}, r] — was it trained for a different base model?")
        if magnitude is not None and magnitude.shape != (sum(widths),):
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} has lora_magnitude_vector "
                               f"{list(magnitude.shape)}; this base model needs [{sum(widths)}]")
        row_bytes = r * _DTYPES[b.dtype][1]
        offset = 0
        for proj, width in zip(parts, widths):
            rows = StoredTensor(b.key, b.dtype, (width, r), b.begin + offset * row_bytes,
                                b.begin + (offset + width) * row_bytes)
            modules[(layer, PROJ_INDEX[proj])] = {"A": a, "B": rows}
            if magnitude is not None:
                size = _DTYPES[magnitude.dtype][1]
                modules[(layer, PROJ_INDEX[proj])]["M"] = StoredTensor(
                    magnitude.key, magnitude.dtype, (width,), magnitude.begin + offset * size,
                    magnitude.begin + (offset + width) * size)
            offset += width
    return modules


class ExpertsFound:
    """An adapter's tensors on a mixture's routed experts, as _check_against_model finds them: per-expert
    modules (_EXPERT_KEY) or stacked parameters (_STACKED_KEY), never both; and on its gates (_GATE_KEY)."""

    def __init__(self):
        self.per_expert: dict[tuple[int, int, str], dict[str, StoredTensor]] = {}   # (layer, expert, PEFT module)
        self.stacked: dict[tuple[int, int], dict[str, StoredTensor]] = {}           # (layer, base_layer depth)
        self.gates: dict[tuple[int, str, str], dict[str, StoredTensor]] = {}        # (layer, container, module)

    @property
    def any(self) -> bool:
        return bool(self.per_expert or self.stacked or self.gates)

    def add(self, name: str, t: StoredTensor, config: ModelConfig) -> bool:
        """Whether t is LoRA on the experts or a gate (then it is kept); refuses what the model lacks."""
        if (m := _GATE_KEY.search(t.key)) is not None:
            container, module = m.group(2), m.group(3)
            if m.group(5):
                raise AdapterError(f"adapter {name!r}: {t.key!r}: DoRA on the router is not served")
            if module == "shared_expert_gate" and not (config.moe.shared_size and container == "mlp"):
                return False            # a target the model lacks: _KEY's refusal names the ones it has
            self.gates.setdefault((int(m.group(1)), container, module), {})[m.group(4)] = t
        elif (m := _EXPERT_KEY.search(t.key)) is not None:
            expert, module = int(m.group(2)), m.group(3)
            if m.group(5):
                raise AdapterError(f"adapter {name!r}: {t.key!r}: DoRA on the routed experts is not served "
                                   "(DoRA on the attention's projections is)")
            if expert >= config.moe.num_experts:
                raise AdapterError(f"adapter {name!r}: {t.key!r} is for expert {expert}; the base model's layers "
                                   f"have {config.moe.num_experts} experts")
            self.per_expert.setdefault((int(m.group(1)), expert, module), {})[m.group(4)] = t
        elif (m := _STACKED_KEY.search(t.key)) is not None:
            self.stacked.setdefault((int(m.group(1)), m.group(2).count(".")), {})[m.group(3)] = t
        else:
            return False
        if int(m.group(1)) >= config.num_layers:
            raise AdapterError(f"adapter {name!r}: {t.key!r} is for layer {m.group(1)}, the base model has "
                               f"{config.num_layers} layers")
        return True

    def modules(self, name: str, acfg: AdapterConfig, config: ModelConfig
                ) -> tuple[dict[tuple[int, int], dict[str, StoredTensor]], dict[tuple[int, int], str]]:
        """(layer, tables column) -> {"A", "B"}, as _split_fused_modules gives the others, and each one's
        module name for rank_pattern and alpha_pattern."""
        if not self.any:
            return {}, {}
        if self.per_expert and self.stacked:
            raise AdapterError(f"adapter {name!r} has LoRA on both the per-expert modules and the stacked expert "
                               "parameters; a PEFT adapter has one or the other")
        if self.any and acfg.use_dora:
            raise AdapterError(f"adapter {name!r}: DoRA on the routed experts or the router is not served (DoRA on the "
                               "attention's projections is)")
        if self.stacked and acfg.fan_in_fan_out:
            raise AdapterError(f"adapter {name!r}: fan_in_fan_out is not supported on the stacked experts")
        modules, names = {}, {}
        for (layer, expert, module), ab in self.per_expert.items():
            proj = _MIXTRAL_EXPERT.get(module, module)
            column = config.expert_column(expert) + EXPERT_PROJECTIONS.index(proj)
            if (layer, column) in modules:
                raise AdapterError(f"adapter {name!r}: layer {layer} names expert {expert}'s {proj} twice "
                                   f"({names[(layer, column)].rpartition('.')[2]} and {module})")
            modules[(layer, column)] = ab
            container = "block_sparse_moe" if module in _MIXTRAL_EXPERT else "mlp"
            names[(layer, column)] = f"model.layers.{layer}.{container}.experts.{expert}.{module}"
        # the targeted parameters, innermost wrapper first (the order transformers registers them)
        targeted = [p for p in STACKED_PARAMETERS
                    if any(t.rpartition(".")[2] == p for t in acfg.target_parameters or ())]
        for (layer, depth), ab in self.stacked.items():
            if depth >= len(targeted):
                raise AdapterError(f"adapter {name!r}: layer {layer} has LoRA on the stacked experts "
                                   f"{'base_layer.' * depth}lora_*, but adapter_config.json's target_parameters "
                                   f"({acfg.target_parameters}) names {len(targeted)} of the experts' parameters "
                                   f"({', '.join(STACKED_PARAMETERS)})")
            parameter = targeted[len(targeted) - 1 - depth]
            module = f"model.layers.{layer}.mlp.experts.{parameter}"
            split = _split_stacked(name, module, ab, parameter, config)
            modules.update(split)
            names.update(dict.fromkeys(split, module))
        router = config.expert_column(config.moe.num_experts)
        for (layer, container, module), ab in self.gates.items():
            column = router + (module == "shared_expert_gate")
            if (layer, column) in modules:
                raise AdapterError(f"adapter {name!r}: layer {layer} names its {module} twice "
                                   f"({names[(layer, column)].split('.')[3]} and {container})")
            modules[(layer, column)] = ab
            names[(layer, column)] = f"model.layers.{layer}.{container}.{module}"
        return modules, names


def _split_stacked(name: str, module: str, ab: dict[str, StoredTensor], parameter: str,
                   config: ModelConfig) -> dict[tuple[int, int], dict[str, StoredTensor]]:
    """A stacked parameter's LoRA cut per expert and projection: expert e's A is rows e*r.. of lora_A
    (a byte range), its B columns e::experts of lora_B, and gate_up_proj's rows of B split into gate's
    and up's (byte ranges of rows)."""
    layer = int(module.split(".")[2])
    if set(ab) != {"A", "B"}:
        raise AdapterError(f"adapter {name!r}: {module} has lora_{''.join(sorted(ab))} but not both A and B")
    a, b = ab["A"], ab["B"]
    experts, projs = config.moe.num_experts, STACKED_PARAMETERS[parameter]
    shapes = config.projection_shapes()
    fan_in = shapes[f"experts.0.{projs[0]}"][0]
    widths = [shapes[f"experts.0.{p}"][1] for p in projs]
    rows = a.shape[0] if len(a.shape) == 2 else 0
    r = rows // experts
    if (a.shape != (rows, fan_in) or b.shape != (sum(widths), rows) or rows % experts or r == 0):
        raise AdapterError(
            f"adapter {name!r}: {module} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; the base model's "
            f"{experts} experts need A [r * {experts}, {fan_in}] and B [{sum(widths)}, r * {experts}] — was it "
            "trained for a different base model?")
    size = _DTYPES[a.dtype][1]
    a_bytes, b_row_bytes = r * fan_in * size, rows * _DTYPES[b.dtype][1]
    out = {}
    for e in range(experts):
        expert_a = StoredTensor(a.key, a.dtype, (r, fan_in), a.begin + e * a_bytes, a.begin + (e + 1) * a_bytes)
        offset = 0
        for j, (proj, width) in enumerate(zip(projs, widths)):
            column = config.expert_column(e) + EXPERT_PROJECTIONS.index(proj)
            out[(layer, column)] = {"A": expert_a, "B": StoredTensor(
                b.key, b.dtype, (width, r), b.begin + offset * b_row_bytes, b.begin + (offset + width) * b_row_bytes,
                every=experts, column=e)}
            offset += width
    return out


def _container(config: ModelConfig, module: str) -> str:
    """Where a PEFT module sits in a decoder layer: self_attn, or the MLP's (ModelConfig.mlp_module)."""
    return "self_attn" if set(config.family.peft_modules()[module]) <= set(PROJECTIONS[:4]) else config.mlp_module()


def _targets(config: ModelConfig, peft_modules: dict[str, tuple[str, ...]]) -> str:
    """The layers' LoRA targets, for a refusal; a mixture of experts says what of it is not one."""
    targets = ", ".join(f"{_container(config, m)}.{m}" for m in peft_modules)
    if config.moe is not None:
        targets += (", the routed experts' mlp.experts.{e}.gate_proj, up_proj, down_proj (Mixtral's "
                    "block_sparse_moe.experts.{e}.w1, w3, w2; or target_parameters mlp.experts.gate_up_proj, down_proj),"
                    " the router mlp.gate (block_sparse_moe.gate)"
                    + (", mlp.shared_expert_gate" if config.moe.shared_size else ""))
    return targets + " of the decoder layers"


def _peft_name(config: ModelConfig, proj: str) -> str:
    """The PEFT module that covers a projection in this family (Phi-3's q_proj: qkv_proj)."""
    return next(module for module, parts in config.family.peft_modules().items() if proj in parts)


def build_host_adapter(folder: PeftFolder, dtype: torch.dtype, dora=None) -> HostAdapter:
    for adapter in build_in_pieces(folder, dtype, dora):
        pass
    return adapter


# bytes of rows one piece builds: a piece waits for a step to end, so a piece per layer made every
# cold adapter take a step per layer (32 for SmolLM2) and starved a server fetching many small ones;
# a rank-256 adapter on every projection (150 MB for SmolLM2) still builds in 15 pieces
PIECE_BYTES = 8 << 20


def build_in_pieces(folder: PeftFolder, dtype: torch.dtype, dora=None) -> Iterator[HostAdapter | None]:
    """Lay the tensors out as pool rows, whole layers at a time: yields None after each run of
    layers that built PIECE_BYTES or more, then the adapter. The server runs one piece per call in
    the torch thread, so steps run in between. A DoRA adapter's scales are worked out per layer by
    ``dora`` (lora/dora.py's DoraBase: it reads the base weights)."""
    config, ranks = folder.config, folder.ranks
    shapes = config.projection_shapes()
    a_rows, b_rows = {}, {}
    dora_scale = []
    if folder.dora and dora is None:
        raise AdapterError(f"adapter {folder.name!r} is a DoRA adapter, whose scales need the base weights")
    if folder.vocab and dora is not None and (why := dora.refusal()) is not None:
        raise AdapterError(f"adapter {folder.name!r} has LoRA on the embeddings or the head, {why}")
    built = 0
    for layer in range(config.num_layers):
        for p, proj in enumerate(config.lora_projections()):
            if not ranks[p]:
                continue
            ab = folder.modules.get((layer, p))
            if ab is None:      # a targeted projection absent from some layers (layers_to_transform): zero rows
                fan_in, fan_out = shapes[proj]
                a_rows[(layer, p)] = torch.zeros(ranks[p], fan_in, dtype=dtype)
                b_rows[(layer, p)] = torch.zeros(ranks[p], fan_out, dtype=dtype)
                continue
            a, b = _stored(folder, ab["A"]), _stored(folder, ab["B"])
            if folder.fan_in_fan_out:
                a, b = a.t(), b.t()
            # a: [r, in], b: [out, r]
            a_rows[(layer, p)] = _rows(folder, ab["A"], a, ranks[p], dtype)
            b_rows[(layer, p)] = _rows(folder, ab["B"], b.t(), ranks[p], dtype)
            built += a_rows[(layer, p)].nbytes + b_rows[(layer, p)].nbytes
        if folder.dora:
            dora_scale.append(dora.layer_scales(folder.name, layer, {
                p: (a_rows[key], b_rows[key], folder.scaling[layer][p], _magnitude(folder, ab["M"]))
                for p in range(len(PROJECTIONS)) if (ab := folder.modules.get(key := (layer, p))) is not None}))
        if built >= PIECE_BYTES:
            built = 0
            yield None
    scaling = torch.tensor(folder.scaling, dtype=torch.float32)      # [L, P]
    vocab = {module: _saved_module(folder, part, dtype) if isinstance(part, StoredTensor)
             else _vocab_rows(folder, module, *part, dtype) for module, part in (folder.vocab or {}).items()}
    linear_attn = {key: _module_rows(folder, a, b, s, dtype) for key, (a, b, s) in (folder.linear_attn or {}).items()}
    yield HostAdapter(name=folder.name, path=folder.path, ranks=list(ranks), scaling=scaling,
                      a_rows=a_rows, b_rows=b_rows, dora_scale=torch.stack(dora_scale) if dora_scale else None,
                      embed=vocab.get("embed"), head=vocab.get("head"), linear_attn=linear_attn or None)


def _vocab_rows(folder: PeftFolder, module: str, a: StoredTensor, b: StoredTensor, scaling: float,
                dtype: torch.dtype) -> VocabRows:
    """The embeddings' LoRA as A^T (a token's row) and B^T, or the head's as A and B^T, in the serving dtype."""
    a_rows, bt = _stored(folder, a), _stored(folder, b).t()
    if module == "embed":
        a_rows = a_rows.t()
    return VocabRows(_rows(folder, a, a_rows, a_rows.shape[0], dtype), _rows(folder, b, bt, bt.shape[0], dtype), scaling)


def _module_rows(folder: PeftFolder, a: StoredTensor, b: StoredTensor, scaling: float, dtype: torch.dtype) -> VocabRows:
    """A projection's LoRA kept beside the pool (a linear-attention layer's) as A [r, in] and B^T [r, out]."""
    a_rows, b_cols = _stored(folder, a), _stored(folder, b)
    if folder.fan_in_fan_out:
        a_rows, b_cols = a_rows.t(), b_cols.t()
    r = a_rows.shape[0]
    return VocabRows(_rows(folder, a, a_rows, r, dtype), _rows(folder, b, b_cols.t(), r, dtype), scaling)


def _saved_module(folder: PeftFolder, t: StoredTensor, dtype: torch.dtype) -> SavedModule:
    """A module saved whole, in the serving dtype (refused unless finite there)."""
    weight = _stored(folder, t)
    return SavedModule(_rows(folder, t, weight, weight.shape[0], dtype))


def _magnitude(folder: PeftFolder, t: StoredTensor) -> torch.Tensor:
    """A DoRA magnitude [out] in float32, refused unless finite."""
    m = _stored(folder, t).float()
    if not all_finite(m):
        raise AdapterError(f"adapter {folder.name!r}: tensor {t.key!r} holds NaN or infinite values")
    return m


def _stored(folder: PeftFolder, t: StoredTensor) -> torch.Tensor:
    """A view of one tensor in the file's bytes (copied first only where its offset is misaligned)."""
    source, size = _DTYPES[t.dtype]
    if t.begin % size == 0:
        flat = torch.frombuffer(folder.weights, dtype=source, count=(t.end - t.begin) // size, offset=t.begin)
    else:
        flat = torch.frombuffer(folder.weights, dtype=torch.uint8, count=t.end - t.begin, offset=t.begin).clone()
    if t.every > 1:             # a stacked expert's columns of lora_B
        return flat.view(source).view(t.shape[0], t.shape[1] * t.every)[:, t.column::t.every]
    return flat.view(source).view(t.shape)


def _rows(folder: PeftFolder, t: StoredTensor, src: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """src [r, n] copied once into rows of the serving dtype, zero-padded to ``rank`` rows; values that
    are not finite there are refused."""
    r, n = src.shape
    out = torch.empty(rank, n, dtype=dtype) if r == rank else torch.zeros(rank, n, dtype=dtype)
    out[:r].copy_(src)
    if not all_finite(out[:r]):
        if not all_finite(src):
            raise AdapterError(f"adapter {folder.name!r}: tensor {t.key!r} holds NaN or infinite values")
        raise AdapterError(f"adapter {folder.name!r}: tensor {t.key!r} has values too large for {dtype} "
                           f"(the serving dtype; largest {torch.finfo(dtype).max:g})")
    return out
