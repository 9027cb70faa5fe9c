"""The engine on the real default model (SmolLM2-135M-Instruct GGUF) against transformers+PEFT, fp32."""
import pytest
import torch

from asyncserve import LLM, SamplingParams
from reference import ReferenceRun, assert_greedy_matches, save_random_adapter

NEW_TOKENS = 8
ADAPTERS = {
    "r2_qv": (2, ["q_proj", "v_proj"], False),
    "r8_attn_rs": (8, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    "r64_mlp": (64, ["gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Low-rank adapters let one base model serve many tasks because",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def smol(smollm2_gguf, smollm2_reference, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = smollm2_reference
    root = tmp_path_factory.mktemp("smol_adapters")
    paths = {}
    for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        save_random_adapter(model, paths[name], r=r, targets=targets, rslora=rs, seed=7 + i)
    return tok, model, paths


def hf_greedy(model, ids: list[int]) -> ReferenceRun:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return ReferenceRun(out.sequences[0, len(ids):].tolist(), [l[0].float() for l in out.logits])


def test_smollm2_adapters_and_base_in_one_generate_call(smol):
    from peft import PeftModel

    tok, model, paths = smol
    prompts = [tok(p).input_ids for p in PROMPTS]
    cases = [(ids, a) for ids in prompts for a in [None, *ADAPTERS]]
    refs = {}
    for adapter in [None, *ADAPTERS]:
        m = model if adapter is None else PeftModel.from_pretrained(model, paths[adapter]).eval()
        for i, (ids, a) in enumerate(cases):
            if a == adapter:
                refs[i] = hf_greedy(m, ids)
        if adapter is not None:
            m.unload()
    # the dequantized weights transformers runs too (the blocks kept: tests/test_quant_engine.py)
    llm = LLM(model=None, adapters={k: str(v) for k, v in paths.items()}, dtype="float32", device="cpu",
              max_step_tokens=32, keep_quantized=False)
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                              ignore_eos=True), adapters=[c[1] for c in cases])
    exact = sum(assert_greedy_matches(o.token_ids, refs[i], tie_tol=1e-3, label=f"case {i} {cases[i][1]}")
                for i, o in enumerate(outs))
    assert exact >= len(cases) - 1
    base = {tuple(c[0]): o.token_ids for c, o in zip(cases, outs) if c[1] is None}
    assert sum(o.token_ids != base[tuple(c[0])] for c, o in zip(cases, outs) if c[1]) >= len(prompts)
    # the tokenizer agrees with transformers' GGUF tokenizer on the prompts and the outputs decode the same
    assert [llm.tokenizer.encode(p) for p in PROMPTS] == prompts
    assert outs[0].text == tok.decode(outs[0].token_ids, skip_special_tokens=True)


def test_smollm2_json_schema_output_is_the_asked_json():
    """Structured outputs on the real model's 49k byte-level vocabulary, through its chat template."""
    import json

    from asyncserve.sampling_params import StructuredOutputs

    schema = {"type": "object", "required": ["name", "age", "indoor"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                             "indoor": {"type": "boolean"}}}
    llm = LLM(model=None, dtype="float32", device="cpu")
    conversations = [[{"role": "user", "content": "Describe a cat called Tom, aged 3, who lives indoors, as JSON."}],
                     [{"role": "user", "content": "Give me a JSON object about a dog named Rex."}]]
    outs = llm.chat(conversations, SamplingParams(max_tokens=60, temperature=0.0,
                                                  structured_outputs=StructuredOutputs(json=schema)))
    values = [json.loads(out.text) for out in outs]
    assert [out.finish_reason for out in outs] == ["stop", "stop"]
    assert values[0] == {"name": "Tom", "age": 3, "indoor": True}
    assert values[1]["name"] == "Rex" and isinstance(values[1]["age"], int) and isinstance(values[1]["indoor"], bool)
