"""Test helpers: tiny random Llama checkpoints, random PEFT adapters, transformers+PEFT references."""
from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

# Where the engine runs in the reference tests: cpu here and in CI; ASYNCSERVE_TEST_DEVICE=cuda on a GPU box.
TEST_DEVICE = os.environ.get("ASYNCSERVE_TEST_DEVICE", "cpu")


def require_native_kernels() -> None:
    """Skip a native-kernel test only where no C++ compiler exists; where one does, a library that
    does not build fails the test instead of skipping it (a broken kernel source must not pass CI)."""
    import pytest

    import kernels.cpu as cpu_kernels
    if cpu_kernels.library() is not None:
        return
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip(f"native CPU kernels cannot be built here: {cpu_kernels.error()}")
    pytest.fail(f"native CPU kernels failed to build: {cpu_kernels.error()}")


def record_calls(monkeypatch, owner, name: str, note) -> None:
    """Replace ``owner.name`` (for the test) with a wrapper that calls note(*args), then the original."""
    original = getattr(owner, name)

    def recorded(*args):
        note(*args)
        return original(*args)

    monkeypatch.setattr(owner, name, recorded)


def bf16_runs_by_layer_loop(folder, adapters: dict, cases, monkeypatch, new_tokens: int) -> dict[str, tuple]:
    """Greedy (prompt ids, adapter) cases in bf16 on CPU with the one-call native layer loop
    (ASYNCSERVE_NATIVE_DECODER "1") and the Python loop ("0"): per mode, (each case's tokens, logprobs and
    top-5 logprobs; how many steps ran the native loop)."""
    from asyncserve import LLM, SamplingParams
    from asyncserve.model import llama

    loop_steps = []
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: loop_steps.append(1))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("ASYNCSERVE_NATIVE_DECODER", mode)
        before = len(loop_steps)
        llm = LLM(model=str(folder), adapters={k: str(v) for k, v in adapters.items()}, dtype="bfloat16",
                  device="cpu", max_step_tokens=16)
        outs = llm.generate([c[0] for c in cases], params, adapters=[c[1] for c in cases])
        runs[mode] = ([(o.token_ids, o.logprobs, o.top_logprobs) for o in outs], len(loop_steps) - before)
    return runs


def record_native_loop(engine, monkeypatch, marked) -> tuple[list[bool], list[bool]]:
    """(per step the engine runs, marked(plan); per call of the one-call native layer loop, whether its
    step was marked), filled as the engine runs."""
    from asyncserve.model import llama

    steps, loop = [], []
    run = engine.runner.run

    def recording(plan):
        steps.append(marked(plan))
        return run(plan)
    engine.runner.run = recording
    record_calls(monkeypatch, llama, "_forward_native", lambda *a: loop.append(steps[-1]))
    return steps, loop


def record_steps(engine) -> list:
    """The plans the engine runs, in order; each gets ``copies_waiting``: per CPU-assisted load already
    paged in, whether its copy to the device was still pending after the step (off its path)."""
    plans, run, pager = [], engine.runner.run, engine.pager

    def recording(plan):
        plans.append(plan)
        result = run(plan)
        plan.copies_waiting = {load: any(p.load == load for p in pager.pending)
                               for load in plan.assisted if load in pager.resident}
        return result
    engine.runner.run = recording
    return plans


def run_merged(engine, cases, merged_for, params, after_step=None) -> list:
    """Run (prompt ids, adapter) cases to the end through schedule -> run -> postprocess, each plan's
    ``merged`` set to merged_for(plan, step index); after_step(step index) runs after each step.
    Returns the cases' sequences."""
    seqs = [engine.make_sequence(ids, params, adapter) for ids, adapter in cases]
    for seq in seqs:
        engine.add(seq)
    step = 0
    while engine.has_unfinished():
        plan = engine.schedule()
        assert plan
        plan.merged = merged_for(plan, step)
        engine.postprocess(plan, engine.run(plan))
        if after_step is not None:
            after_step(step)
        step += 1
    return seqs


# family -> (transformers config class, model class)
FAMILY_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def save_tiny_model(folder: Path, tokenizer_source, family: str = "llama", *, seed=0, max_shard_size=None,
                    random_vectors=False, **config):
    """A random model of ``family`` made with transformers' own config class (``config``: its
    arguments) and saved as an HF folder with the given HF tokenizer. random_vectors: norm weights
    and biases random too (transformers starts them at 1 or 0, which hides a wrong (1 + w) or bias)."""
    import transformers

    config_class, model_class = (getattr(transformers, name) for name in FAMILY_CLASSES[family])
    torch.manual_seed(seed)
    cfg = config_class(vocab_size=len(tokenizer_source), bos_token_id=tokenizer_source.bos_token_id,
                       eos_token_id=tokenizer_source.eos_token_id, **config)
    model = model_class(cfg).eval()
    save_random_model(folder, model, tokenizer_source, family, random_vectors, max_shard_size)
    return model


def save_random_model(folder: Path, model, tokenizer_source, family: str, random_vectors=False, max_shard_size=None):
    """``model``'s weights drawn wider than transformers' init, saved as an HF folder with the tokenizer."""
    from transformers import GenerationConfig

    # the default init is tiny (std 0.02): widen it so logits are far from ties and LoRA deltas matter
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:             # a projection, or a mixture's experts stacked [experts, out, in]
                p.normal_(0, 0.08)
            elif random_vectors and name.endswith("bias"):
                p.normal_(0, 0.1)
            elif random_vectors:         # a norm: Gemma's weights are offsets from 1, the others' scale
                p.normal_(0 if family.startswith("gemma") else 1, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    tokenizer_source.save_pretrained(folder)
    text = model.config.get_text_config()
    GenerationConfig(bos_token_id=text.bos_token_id, eos_token_id=[text.eos_token_id]).save_pretrained(folder)


def save_tiny_llama(folder: Path, tokenizer_source, *, hidden=64, layers=2, heads=4, kv_heads=2,
                    intermediate=128, tie=False, seed=0, rope_theta=10000.0, max_pos=512,
                    max_shard_size=None):
    """A random LlamaForCausalLM saved as an HF folder with the given HF tokenizer (GQA, untied)."""
    return save_tiny_model(folder, tokenizer_source, "llama", seed=seed, max_shard_size=max_shard_size,
                           hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                           rope_theta=rope_theta, tie_word_embeddings=tie)


def save_random_adapter(base_model, folder: Path, *, r: int, targets: list[str], alpha: float | None = None,
                        rslora: bool = False, seed: int = 0, **extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, target_modules=targets,
                     init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0, **extra)
    peft_model = get_peft_model(copy.deepcopy(base_model), cfg)
    with torch.no_grad():   # random B (init_lora_weights=False) at a scale where adapters change tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3 / max(1, r) ** 0.5)
            elif ".modules_to_save." in name:     # a module trained whole: moved as far as its own spread
                p.add_(torch.randn_like(p) * p.std())
        if extra.get("use_dora"):
            _trained_magnitudes(peft_model)
    peft_model.save_pretrained(folder)


def _trained_magnitudes(peft_model) -> None:
    """DoRA's magnitudes as training leaves them: near the norms of the adapted rows (PEFT starts them
    there), each row's moved by up to 40%, a few rows' sign flipped."""
    for module in peft_model.modules():
        if hasattr(module, "lora_magnitude_vector") and "default" in module.lora_magnitude_vector:
            w = module.get_base_layer().weight.float()
            delta = module.lora_B["default"].weight.float() @ module.lora_A["default"].weight.float()
            norm = torch.linalg.norm(w + module.scaling["default"] * delta, dim=1)
            factor = torch.empty_like(norm).uniform_(0.6, 1.4)
            factor[torch.rand_like(norm) < 0.05] *= -1
            module.lora_magnitude_vector["default"].weight.copy_(norm * factor)


@dataclass
class ReferenceRun:
    tokens: list[int]
    logits: list[torch.Tensor]        # reference logits at each generated position


def reference_greedy(model, prompt_ids: list[int], n: int) -> ReferenceRun:
    """Greedy decoding by full recomputation (no cache) in float32, keeping each step's logits."""
    ids = list(prompt_ids)
    out, logits = [], []
    with torch.no_grad():
        for _ in range(n):
            step = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(step.argmax())
            logits.append(step)
            out.append(tok)
            ids.append(tok)
    return ReferenceRun(out, logits)


def peft_references(base, adapter_paths: dict, cases, new_tokens: int) -> list[ReferenceRun]:
    """transformers+PEFT greedy runs of (prompt ids, adapter name or None) cases on ``base``, one
    adapter active at a time."""
    from peft import PeftModel

    refs = [None] * len(cases)
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    for adapter in dict.fromkeys(a for _, a in cases):
        model = base if adapter is None else PeftModel.from_pretrained(base, adapter_paths[adapter]).eval()
        for i, (ids, a) in enumerate(cases):
            if a == adapter:
                refs[i] = reference_greedy(model, ids, new_tokens)
        if adapter is not None:
            model.unload()   # restore the base modules for the next adapter
            base.load_state_dict(weights)    # unload leaves modules_to_save's trained copies in their place
    return refs


def assert_greedy_matches(ours: list[int], ref: ReferenceRun, tie_tol: float, label: str) -> bool:
    """Tokens must equal the reference; a difference is allowed only at a near-tie of the reference's
    top-2 logits, after which the continuations legitimately differ. Returns True if fully equal."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            top2 = ref.logits[i].topk(2).values
            gap = float(top2[0] - top2[1])
            ref_ours_gap = float(ref.logits[i][b] - ref.logits[i][a])
            assert ref_ours_gap <= tie_tol, (
                f"{label}: token {i} is {a}, reference {b}; reference logit gap {ref_ours_gap:.3g} "
                f"(top-2 gap {gap:.3g}) is not a near-tie (tolerance {tie_tol})")
            return False
    assert len(ours) == len(ref.tokens), f"{label}: {len(ours)} tokens, reference {len(ref.tokens)}"
    return True


CORPUS = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "LoRA adapters fine-tune large language models with low-rank updates to their projections.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
    "Ünïcödé text, emoji 🙂🚀 and 中文字符 appear in the byte-level vocabulary too.",
    "Serving many adapters at once batches their tokens through one base model per step.",
]

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE trained on a few sentences, as an HF fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                 unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


# name: (rank, targets, rslora, extra LoraConfig kwargs) — ranks 1..64, different module sets, rsLoRA, patterns
ADAPTERS = {
    "r1_qv": (1, ["q_proj", "v_proj"], False, {}),
    "r2_mlp": (2, ["gate_proj", "up_proj", "down_proj"], False, {}),
    "r8_attn_rs": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], True, {}),
    "r64_all": (64, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False, {}),
    "r16_patterns": (16, ["q_proj", "v_proj", "down_proj"], False,
                     {"rank_pattern": {"v_proj": 4}, "alpha_pattern": {"down_proj": 5.0}}),
}


@dataclass
class TinyModel:
    root: Path
    tokenizer: object              # the HF tokenizer saved with the model
    base: object                   # the transformers model (reference)
    adapters: dict[str, Path]


def build_tiny_model(root: Path) -> TinyModel:
    tok = make_tiny_tokenizer()
    base = save_tiny_llama(root / "base", tok, max_shard_size="200KB")
    paths = {}
    for i, (name, (r, targets, rs, extra)) in enumerate(ADAPTERS.items()):
        paths[name] = root / "adapters" / name
        save_random_adapter(base, paths[name], r=r, targets=targets, rslora=rs, seed=100 + i, **extra)
    return TinyModel(root / "base", tok, base, paths)
