"""The language models of multimodal checkpoints (Gemma 3, Mistral 3, Llava, Qwen2.5-VL, Qwen3-VL), served
for text as vLLM serves them text-only requests: greedy tokens against transformers' own multimodal class
with PEFT adapters trained "all-linear" (LoRA on the vision tower and projector too, which text never runs).
The wrappers save their language models under three namings (language_model.model.*, model.language_model.*,
model.* beside visual.*), all read here."""
from __future__ import annotations

import json

import pytest

from family_models import (GREEDY_TOKENS, MULTIMODAL_TEXT, WRAPPERS, build_multimodal, cases_of, check_greedy,
                           generate_greedy)
from reference import peft_references


def stored_names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_language_model_of_a_multimodal_checkpoint_gives_transformers_tokens(wrapper, tmp_path):
    """Base model and two adapters in one generate call; the all-linear adapter's tower LoRA is skipped."""
    model = build_multimodal(tmp_path, wrapper)
    towers = ("vision_tower.", "visual.", "model.visual.", "model.vision_tower.", "base_model.model.model.visual.",
              "base_model.model.model.vision_tower.")
    assert any(k.startswith(towers) for k in stored_names(model.adapters["all"] / "adapter_model.safetensors"))
    assert any(k.startswith(towers) for k in stored_names(model.folder / "model.safetensors"))
    cases = cases_of(model)
    refs = peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)
    llm, tokens = generate_greedy(model, cases)
    assert llm.engine.model_config.family.name == model.family
    check_greedy(tokens, cases, refs, wrapper)


def test_gemma3_config_as_the_hub_writes_it(tmp_path):
    """google/gemma-3-4b-it's config.json lists only what differs from Gemma3TextConfig's defaults, and its
    RoPE scaling by the older rope_scaling key: transformers fills the rest, and so must the loader."""
    import transformers

    model = build_multimodal(tmp_path, "gemma3", dict(
        num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=8, layer_types=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}))
    config_file = model.folder / "config.json"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    config["text_config"] = {key: text[key] for key in ("hidden_size", "intermediate_size", "model_type",
                                                        "num_hidden_layers", "sliding_window", "vocab_size",
                                                        "bos_token_id", "eos_token_id")}
    config["text_config"]["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
    config.pop("tie_word_embeddings")
    config_file.write_text(json.dumps(config))
    reread = transformers.Gemma3ForConditionalGeneration.from_pretrained(model.folder).eval()
    assert reread.config.text_config.num_attention_heads == 8       # transformers filled the defaults
    model.base = reread
    cases = cases_of(model, lengths=(4, 21))
    refs = peft_references(model.base, model.adapters, cases, GREEDY_TOKENS)
    llm, tokens = generate_greedy(model, cases)
    mc = llm.engine.model_config
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.rope_local_theta) == (8, 4, 256, 10000.0)
    assert mc.rope_scaling["rope_type"] == "linear" and mc.layer_windows == [8] * 5 + [None]
    check_greedy(tokens, cases, refs, "gemma3 (Hub config)")


@pytest.mark.parametrize("wrapper", ["Gemma3Config", "Mistral3Config", "LlavaConfig", "Qwen2VLConfig",
                                     "Qwen2_5_VLConfig", "Qwen3VLConfig"])
def test_multimodal_defaults_are_transformers_text_config_defaults(wrapper):
    """Every default the loader fills a text_config with is the value transformers' class gives it."""
    import transformers

    from asyncserve.model.loader_hf import MULTIMODAL

    config = getattr(transformers, wrapper)()
    architecture = next(a for a in MULTIMODAL if a.startswith(wrapper.removesuffix("Config")) and
                        a.removesuffix("ForConditionalGeneration") == wrapper.removesuffix("Config"))
    model_type, tied, defaults = MULTIMODAL[architecture]
    text = config.text_config.to_dict()
    assert text["model_type"] == model_type and config.tie_word_embeddings == tied
    rope = text["rope_parameters"]
    theirs = {**text, "rope_theta": rope.get("full_attention", rope)["rope_theta"]}
    if "sliding_attention" in rope:
        theirs["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        theirs["sliding_window_pattern"] = text["_sliding_window_pattern"]
    assert {key: theirs[key] for key in defaults} == defaults


def test_qwen2_5_vl_config_before_text_config(tmp_path):
    """Qwen2.5-VL's Hub configs keep the language model's keys at the top, with "mrope" RoPE scaling."""
    from asyncserve.model.loader_hf import language_model_config, model_config

    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            **MULTIMODAL_TEXT, "vocab_size": 300, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "vision_config": {"depth": 1}, "tie_word_embeddings": True}
    config = model_config(language_model_config(flat, "m")[0], "m")
    assert (config.family.name, config.rope_scaling, config.rope_theta) == ("qwen2", None, 1e6)
    assert config.tie_word_embeddings


def test_text_weight_names():
    from asyncserve.model.loader_hf import text_weight_name

    assert text_weight_name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert text_weight_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_weight_name("model.language_model.norm.weight") == "model.norm.weight"
    assert text_weight_name("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert text_weight_name("lm_head.weight") == "lm_head.weight"
    for tower in ("vision_tower.encoder.layers.0.self_attn.q_proj.weight", "model.visual.blocks.0.attn.qkv.weight",
                  "visual.merger.mlp.0.weight", "multi_modal_projector.linear_1.weight",
                  "model.multi_modal_projector.mm_input_projection_weight"):
        assert text_weight_name(tower) is None


def test_image_parts_are_refused_with_the_reason():
    import msgspec

    from asyncserve.ingress.prepare import chat_messages
    from asyncserve.ingress.protocol import ApiError, ChatCompletionRequest

    for part in ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                 {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}, {"text": "no type"},
                 {"type": "text\n" + "x" * 500, "text": "forged"}):
        req = msgspec.convert({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, part]}]}, ChatCompletionRequest)
        with pytest.raises(ApiError) as e:
            chat_messages(req)
        assert e.value.status == 400 and e.value.param == "messages[0].content[1]"
        assert "serves text only" in e.value.message and "\n" not in e.value.message and len(e.value.message) < 300
