"""LoRA on a mixture's routed experts (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers+PEFT, fp32.

Adapters come in both forms PEFT saves: ``target_parameters`` on transformers v5's stacked experts
(mlp.experts.gate_up_proj and down_proj, one or both: both nest, gate_up_proj one "base_layer." deeper),
and the per-expert modules of transformers v4 (Qwen's mlp.experts.{e}.gate_proj, Mixtral's
block_sparse_moe.experts.{e}.w1), which PEFT's own conversion loads on v5 for the reference. The base
and the adapters share one generate call on every step path; expert adapters are neither merged nor
CPU-assisted, and what is wrong with one is refused alone. The native kernel (experts.h's forward_lora)
is checked against the torch-ops form in bf16 and fp32, and refuses tables that point outside the pool.
"""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncserve import LLM
from asyncserve.model import llama
from asyncserve.model.config import ModelConfig, MoeConfig
from asyncserve.model.linear import make_linear
from family_models import (GREEDY_TOKENS, MOE_FAMILIES, assert_refused_each_alone, build_with_adapters, cases_of,
                           check_greedy, greedy_tokens, llm_on_path, renamed, split_stacked_experts)
from reference import TEST_DEVICE, peft_references, record_calls, record_steps, require_native_kernels

STACKED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ROUTER = "mlp.gate.weight"            # transformers v5's router is a parameter of its own module
# name -> (rank, target_modules, LoraConfig extras); "per_expert" is written from its stacked twin
ADAPTERS = {
    "experts": (4, [], {"target_parameters": STACKED}),
    "gate_up": (8, ["q_proj"], {"target_parameters": STACKED[:1], "rslora": True}),
    "per_expert": (4, ["v_proj"], {"target_parameters": STACKED + [ROUTER]}),
}


def family_adapters(family: str) -> dict:
    """ADAPTERS, and one on the router and the experts' down_proj (Qwen2-MoE: and its shared expert's gate,
    which PEFT's all-linear takes)."""
    router_targets = ["shared_expert_gate"] if family == "qwen2_moe" else []
    return ADAPTERS | {"router": (2, router_targets, {"target_parameters": [ROUTER, STACKED[1]]})}


def write_per_expert(stacked: Path, folder: Path, family: str, experts: int) -> None:
    """A stacked-experts adapter's weights as PEFT saved LoRA on transformers v4's per-expert modules
    (split_stacked_experts); Mixtral's under block_sparse_moe with w1, w3, w2, its router too."""
    config = json.loads((stacked / "adapter_config.json").read_text())
    split = split_stacked_experts(load_file(stacked / "adapter_model.safetensors"), config["target_parameters"],
                                  experts)
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if family == "mixtral" else {}
    out = {}
    for key, tensor in split.items():
        if names:
            key = re.sub(r"\.mlp\.experts\.(\d+)\.(\w+)\.", lambda m: f".block_sparse_moe.experts.{m.group(1)}."
                         f"{names[m.group(2)]}.", key).replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[key] = tensor
    folder.mkdir(parents=True)
    save_file(out, folder / "adapter_model.safetensors")
    routed = {names.get(p, p) for p in ("gate_proj", "up_proj", "down_proj")}
    router = {"gate"} if ROUTER in config["target_parameters"] else set()
    config["target_modules"] = sorted(set(config["target_modules"]) | routed | router)
    config["target_parameters"] = None
    config["init_lora_weights"] = True     # Qwen2-MoE's shared expert modules, targeted by name but not in the file
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def expert_model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = build_with_adapters(root, request.param, family_adapters(request.param))
    experts = MOE_FAMILIES[request.param].get("num_experts") or MOE_FAMILIES[request.param]["num_local_experts"]
    reference_paths = dict(model.adapters)
    write_per_expert(model.adapters["per_expert"], root / "per_expert", request.param, experts)
    model.adapters["per_expert"] = root / "per_expert"
    # PEFT converts a per-expert adapter onto v5's stacked experts for Mixtral and Qwen3-MoE, but not for
    # Qwen2-MoE (0.21: it loads none of its expert tensors); there the stacked twin gives the reference
    if request.param != "qwen2_moe":
        reference_paths["per_expert"] = model.adapters["per_expert"]
    cases = cases_of(model)
    return model, cases, fresh_references(model.base, reference_paths, cases)


def fresh_references(base, adapters: dict, cases) -> list:
    """peft_references with each adapter on a fresh copy of the base: PEFT's unload of a stacked-experts
    adapter registers the experts' parameters again in another order, and the next adapter's wrappers
    would then nest the other way round from its keys."""
    refs = [None] * len(cases)
    for adapter in dict.fromkeys(a for _, a in cases):
        mine = [i for i, c in enumerate(cases) if c[1] == adapter]
        runs = peft_references(copy.deepcopy(base), adapters, [cases[i] for i in mine], GREEDY_TOKENS)
        for i, run in zip(mine, runs):
            refs[i] = run
    return refs


@pytest.mark.parametrize("path", ["ops", "eager", "triton"])
def test_expert_adapters_give_peft_tokens_beside_the_base(expert_model, path, monkeypatch):
    """The base and the three adapters in one generate call, prefill chunks and decodes sharing steps:
    each token's experts get its own adapter's LoRA (or none). ops: the native experts kernel with the
    LoRA read from the pool (forward_lora); eager: torch ops; triton: the Triton LoRA kernels for the
    attention (interpreter on CPU), the native experts kernel for the experts."""
    model, cases, refs = expert_model
    layers, eager_runs = [], []
    record_calls(monkeypatch, llama, "moe_mlp", lambda x, experts, moe, native, shared, lora, layer:
                 layers.append((native, lora is not None)))
    record_calls(monkeypatch, llama, "_expert_lora_", lambda *a: eager_runs.append(1))
    llm = llm_on_path(model, path, monkeypatch)
    tokens = greedy_tokens(llm, cases)
    check_greedy(tokens, cases, refs, f"{model.family} {path}")
    native = path != "eager"
    assert (True, True) in layers if native else ((False, True) in layers and eager_runs)
    assert all(n == native for n, _ in layers)
    # the experts-only adapter changes tokens: its LoRA on the experts is applied
    base = {tuple(c[0]): t for c, t in zip(cases, tokens) if c[1] is None}
    assert any(t != base[tuple(c[0])] for c, t in zip(cases, tokens) if c[1] == "experts")


def test_expert_adapters_are_neither_merged_nor_assisted(expert_model, tmp_path):
    """dLoRA's merged mode would fold an adapter into the base weights, the experts' stacks among them,
    and CaraServe's workers see no routing: an adapter with LoRA on the experts is refused the merge with
    its reason, and with cpu_assist="on" it waits for its copy to the device instead of starting on the
    workers, its tokens still PEFT's."""
    model, cases, refs = expert_model
    llm = LLM(model=str(model.folder), adapters={k: str(v) for k, v in model.adapters.items()}, dtype="float32",
              device=TEST_DEVICE, max_step_tokens=24, cpu_workers=1, cpu_assist="on", cpu_profile_dir=str(tmp_path))
    try:
        for name in model.adapters:
            assert "LoRA on the routed experts or the router, which is not merged" in llm.engine.merge_refusal(name)
        plans = record_steps(llm.engine)
        tokens = greedy_tokens(llm, cases)
        assert plans and not any(p.assisted for p in plans)
        check_greedy(tokens, cases, refs, f"{model.family} cpu assist on")
    finally:
        llm.engine.close()


def _edit_key(part: str, change):
    """Replace every tensor whose name holds ``part`` by change(tensor)."""
    def edit(weights: dict) -> None:
        for key in [k for k in weights if part in k]:
            weights[key] = change(weights[key])
    return edit


def _add_key(part: str, new: str):
    """Beside every tensor whose name ends with ``part``, one named with ``new`` in its place (its first row)."""
    def edit(weights: dict) -> None:
        for key in [k for k in weights if k.endswith(part)]:
            weights[key.replace(part, new)] = weights[key][0].clone()
    return edit


def _copy_key(part: str, new: str):
    """A copy of every tensor whose name holds ``part``, named with ``new`` in its place."""
    def edit(weights: dict) -> None:
        for key in [k for k in weights if part in k]:
            weights[key.replace(part, new)] = weights[key].clone()
    return edit


def _config(**changes):
    return lambda config: {**config, **changes}


def test_bad_expert_adapters_are_refused_each_alone(expert_model, tmp_path):
    """Each refused at load with its reason, alone, the adapters loaded before keeping their tokens: per
    expert, an expert the model does not have, a layer it does not have, an expert's projection named
    twice (Qwen's and Mixtral's names), DoRA; stacked, rows that are not a multiple of the experts, a B
    of another width, a rank that is not the config's, nesting deeper than target_parameters names,
    no target_parameters, fan_in_fan_out; both forms in one file; NaN in one expert's rows; and the
    router and the shared expert's gate, still not adapted."""
    model, cases, refs = expert_model
    experts = MOE_FAMILIES[model.family].get("num_experts") or MOE_FAMILIES[model.family]["num_local_experts"]
    per_expert, stacked = "per_expert", "experts"
    qwen_names = model.family != "mixtral"
    gate = "mlp.experts.0.gate_proj" if qwen_names else "block_sparse_moe.experts.0.w1"
    routers = (".mlp.gate.", ".block_sparse_moe.gate.")[::1 if qwen_names else -1]     # its name, the other

    def nan_in_expert_1(weights: dict) -> None:
        key = next(k for k in weights if k.endswith("experts.lora_B.weight"))
        weights[key][:, 1::experts] = float("nan")

    def twice(weights: dict) -> None:
        other = "block_sparse_moe.experts.0.w1" if qwen_names else "mlp.experts.0.gate_proj"
        for key in [k for k in weights if gate + "." in k]:
            weights[key.replace(gate, other)] = weights[key].clone()

    def both_forms(weights: dict) -> None:
        stacked_file = load_file(model.adapters[stacked] / "adapter_model.safetensors")
        weights.update({k: v for k, v in stacked_file.items() if ".mlp.experts.lora_" in k})

    bad = {
        "expert out of range": (per_expert, None, renamed(".experts.0.", f".experts.{experts}."),
                                f"is for expert {experts}; the base model's layers have {experts} experts"),
        "expert far out of range": (per_expert, None, renamed(".experts.1.", ".experts.99999999999."),
                                    "is for expert 99999999999"),
        "layer out of range": (per_expert, None, renamed("layers.1.", "layers.7."), "is for layer 7"),
        "named twice": (per_expert, None, twice, "names expert 0's gate_proj twice"),
        "DoRA": (per_expert, _config(use_dora=True), None, "DoRA on the routed experts.* is not served"),
        "rows not a multiple": (stacked, None, _edit_key("mlp.experts.base_layer.lora_A.weight", lambda t: t[:-1].clone()),
                                r"need A \[r \* \d+, \d+\] and B"),
        "B of another width": (stacked, None, _edit_key("mlp.experts.lora_B.weight", lambda t: t[:-1].clone()),
                               r"need A \[r \* \d+, \d+\] and B"),
        "rank not the config's": (stacked, _config(r=2), None, "has rank 4 in the weights but 2 in the config"),
        "too deep": (stacked, _config(target_parameters=STACKED[1:]), None,
                     r"names 1 of the experts' parameters"),
        "no target_parameters": (stacked, _config(target_parameters=None), None,
                                 r"names 0 of the experts' parameters"),
        "fan_in_fan_out": (stacked, _config(fan_in_fan_out=True), None,
                           "fan_in_fan_out is not supported on the stacked experts"),
        "both forms": (per_expert, None, both_forms, "has LoRA on both the per-expert modules and the stacked"),
        "NaN in expert 1": (stacked, None, nan_in_expert_1, "holds NaN or infinite values"),
        "router of another width": ("router", None, _edit_key(".mlp.gate.lora_B.", lambda t: t[:-1].clone()),
                                    r"router has lora_A \(2, 64\) and lora_B \(\d+, 2\)"),
        "DoRA on the router": ("router", None, _add_key(".mlp.gate.lora_A.weight", ".mlp.gate.lora_magnitude_vector"),
                               "DoRA on the router is not served"),
        "router named twice": (per_expert, None, _copy_key(*routers), "names its gate twice"),
    }
    for source in (per_expert, stacked, "router"):
        assert_refused_each_alone(model, cases, refs, source,
                                  {label: rest for label, (s, *rest) in bad.items() if s == source}, tmp_path / source)


def _random_expert_lora(dtype: torch.dtype, experts: int, hidden: int, inter: int, layers: int = 2):
    """A flat pool of random rows and tables over it for three adapters: 0 of rank 4 on every expert
    projection and the router, 1 of rank 2 on the first half of the experts' gate and up only, 2 of rank
    3 on their down and the router (rows the tables' layer 1 points at; layer 0's stay 0)."""
    router = ModelConfig.expert_column(experts)
    P = router + 1
    ranks = torch.zeros(3, P, dtype=torch.int32)
    ranks[0, router], ranks[2, router] = 4, 3
    for e in range(experts):
        column = ModelConfig.expert_column(e)
        ranks[0, column:column + 3] = 4
        if e < experts // 2:
            ranks[1, column:column + 2] = 2
        ranks[2, column + 2] = 3
    a_ptr = torch.zeros(3, layers, P, 4, dtype=torch.int64)
    b_ptr = torch.zeros_like(a_ptr)
    scaling = torch.rand(3, layers, P) + 0.5
    cursor = 0
    for n in range(3):
        shapes = [(hidden, inter), (hidden, inter), (inter, hidden)] * experts + [(hidden, experts)]
        for column, (fan_in, fan_out) in enumerate(shapes, start=ModelConfig.expert_column(0)):
            for k in range(int(ranks[n, column])):
                a_ptr[n, 1, column, k] = cursor
                b_ptr[n, 1, column, k] = cursor + fan_in
                cursor += fan_in + fan_out
    flat = (torch.randn(cursor) * 0.2).to(dtype)
    return flat, (ranks, a_ptr, b_ptr, scaling)


def _expected(x, experts: llama.ExpertWeights, moe: MoeConfig, flat, tables, token_rows, layer: int):
    """Each token's router and experts with its adapter's LoRA, in float32, one token at a time."""
    ranks, a_ptr, b_ptr, scaling = tables

    def lora(row: int, column: int, v: torch.Tensor, width: int) -> torch.Tensor:
        r = int(ranks[row, column])
        if row < 0 or r == 0:
            return torch.zeros(width)
        a = llama.pool_rows(flat, a_ptr[row, layer, column, :r], v.shape[0]).float()
        b = llama.pool_rows(flat, b_ptr[row, layer, column, :r], width).float()
        return (a @ v) * scaling[row, layer, column] @ b

    router = ModelConfig.expert_column(moe.num_experts)
    logits = experts.router(x).float()
    logits = torch.stack([logits[t] + lora(int(token_rows[t]), router, x[t].float(), moe.num_experts)
                          for t in range(x.shape[0])])
    top_p, top_e = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
    top_p /= top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float32)

    for t in range(x.shape[0]):
        v, row = x[t].float(), int(token_rows[t])
        for p, e in zip(top_p[t].tolist(), top_e[t].tolist()):
            column = ModelConfig.expert_column(e)
            w_gu, w_d = experts.gate_up[e].dense_weight().float(), experts.down[e].dense_weight().float()
            inter = w_gu.shape[0] // 2
            gate = w_gu[:inter] @ v + lora(row, column, v, inter)
            up = w_gu[inter:] @ v + lora(row, column + 1, v, inter)
            h = torch.nn.functional.silu(gate) * up
            out[t] += p * (w_d @ h + lora(row, column + 2, h, w_d.shape[0]))
    return out


@pytest.mark.parametrize("steps", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_expert_lora_equals_torch_ops_and_a_token_by_token_sum(dtype, steps):
    """moe_mlp natively (lora_segments on the router, experts.h's forward_lora) and in torch ops over the
    same pool and tables: each token's router and experts with its own adapter's LoRA on them (adapters
    of different ranks, some experts or the router not targeted by some adapters, tokens of no adapter
    among them) equal a token-by-token float32 sum. decode: 30 tokens of alternating adapters, runs of a
    row or two per expert and adapter; prefill: 240 tokens in four blocks, runs of several of
    lora_segments' tiles."""
    require_native_kernels()
    torch.manual_seed(0)
    E, H, I = 6, 48, 40
    T = 30 if steps == "decode" else 240
    moe = MoeConfig(E, 2, I, True)
    experts = llama.ExpertWeights(router=make_linear((torch.randn(E, H) * 0.3).to(dtype)),
                                  gate_up=[make_linear((torch.randn(2 * I, H) * 0.15).to(dtype)) for _ in range(E)],
                                  down=[make_linear((torch.randn(H, I) * 0.15).to(dtype)) for _ in range(E)],
                                  shared_gate=None)
    flat, tables = _random_expert_lora(dtype, E, H, I)
    if steps == "decode":
        token_rows = torch.tensor([(t % 4) - 1 for t in range(T)], dtype=torch.int32)      # -1, 0, 1, 2, -1, ...
        runs = torch.tensor([(t, t + 1, int(row)) for t, row in enumerate(token_rows) if row >= 0])
    else:
        token_rows = torch.tensor([t // 60 - 1 for t in range(T)], dtype=torch.int32)      # -1 x 60, 0 x 60, ...
        runs = torch.tensor([(60 * (row + 1), 60 * (row + 2), row) for row in range(3)])
    lora = llama.ExpertLora(flat, token_rows, runs, tables)
    x = torch.randn(T, H).to(dtype)
    expected = _expected(x, experts, moe, flat, tables, token_rows, layer=1)
    tol = dict(rtol=0.02, atol=0.02) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for native in (True, False):
        got = llama.moe_mlp(x, experts, moe, native, lora=lora, layer=1)
        torch.testing.assert_close(got.float(), expected, **tol)
    without = llama.moe_mlp(x, experts, moe, True)
    assert (without.float() - expected).abs().max() > 10 * tol["atol"]      # the LoRA is not negligible


def test_native_expert_lora_refuses_tables_outside_the_pool():
    """Tables that would have the kernel read past the pool or outside themselves are refused before
    any row is read: a token's row past the tables, a row offset past the pool, the experts' columns
    past the tables, a layer outside them."""
    require_native_kernels()
    torch.manual_seed(1)
    E, H, I, T = 4, 32, 24, 6
    experts = llama.ExpertWeights(make_linear(torch.randn(E, H)),
                                  [make_linear(torch.randn(2 * I, H)) for _ in range(E)],
                                  [make_linear(torch.randn(H, I)) for _ in range(E)], None)
    flat, (ranks, a_ptr, b_ptr, scaling) = _random_expert_lora(torch.float32, E, H, I)
    x = torch.randn(T, H)
    chosen = torch.tensor([[t % E, (t + 1) % E] for t in range(T)])
    probs = torch.full((T, 2), 0.5)
    rows = torch.zeros(T, dtype=torch.int32)
    kernel = experts.native()
    past_pool = a_ptr.clone()
    past_pool[0, 1, ModelConfig.expert_column(1), 0] = flat.numel() - 3
    cases = [(dict(token_rows=torch.full((T,), 3, dtype=torch.int32)), "outside the tables"),
             (dict(token_rows=torch.full((T,), -2, dtype=torch.int32)), "outside the tables"),
             (dict(a_ptr=past_pool), "adapter row outside the pool"),
             (dict(first=ModelConfig.expert_column(1)), "the experts' columns run past the tables"),
             (dict(layer=2), "outside the tables")]
    for change, why in cases:
        args = dict(token_rows=rows, a_ptr=a_ptr, first=ModelConfig.expert_column(0), layer=1) | change
        with pytest.raises(RuntimeError, match=why):
            kernel.forward_lora(x, chosen, probs, flat, args["token_rows"], ranks, args["a_ptr"], b_ptr, scaling,
                                args["layer"], args["first"])


def test_make_adapters_writes_expert_adapters_peft_loads(expert_model, tmp_path):
    """scripts/make_adapters.py --targets q_proj,experts on a mixture: per-expert folders (v4's names, what
    llama.cpp's converter reads, and what the benchmarks serve) that asyncserve serves with the tokens
    PEFT's conversion gives (Qwen3-MoE's names; Mixtral's v4 adapters have their own)."""
    import importlib.util

    model, _, _ = expert_model
    if model.family != "qwen3_moe":
        pytest.skip("PEFT converts per-expert adapters with Qwen's names for Qwen3-MoE (see expert_model)")
    spec = importlib.util.spec_from_file_location("make_adapters", Path(__file__).parents[1] / "scripts/make_adapters.py")
    make_adapters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_adapters)
    make_adapters.main(["2", str(tmp_path), "--model", str(model.folder), "--ranks", "2", "4",
                        "--targets", "q_proj,experts"])
    config = json.loads((tmp_path / "a0000" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {name: tmp_path / name for name in ("a0000", "a0001")}
    cases = cases_of(model, lengths=(5, 13), adapters=list(adapters))
    refs = fresh_references(model.base, adapters, cases)
    llm = LLM(model=str(model.folder), adapter_dir=str(tmp_path), dtype="float32", device=TEST_DEVICE,
              max_step_tokens=16)
    tokens = greedy_tokens(llm, cases)
    check_greedy(tokens, cases, refs, "make_adapters experts")
    assert llm.engine.pager.registry["a0000"].experts
