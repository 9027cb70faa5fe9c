"""OpenAI request/response shapes (completions and chat), with vLLM's sampling extensions.

Requests are decoded straight into typed msgspec Structs: a wrong type or an unknown-to-us but
meaningful field becomes a 400 naming the field.
"""
from __future__ import annotations

import time
from typing import Union

import msgspec

from asyncserve.sampling_params import SamplingParams, StructuredOutputs


class ApiError(Exception):
    """A client-visible error, rendered as OpenAI's {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error",
             504: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=False):
    name: str = ""
    schema: Union[dict, None] = None
    strict: Union[bool, None] = None
    description: Union[str, None] = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=False):
    """OpenAI's response_format; LoRAX also sends {"type": "json_object", "schema": {...}}."""
    type: str
    json_schema: Union[JsonSchemaFormat, None] = None
    schema: Union[dict, None] = None


class StructuredOutputsField(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's structured_outputs."""
    json: Union[dict, str, None] = None
    regex: Union[str, None] = None
    choice: Union[list[str], None] = None
    json_object: Union[bool, None] = None


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    max_tokens: Union[int, None] = None
    temperature: Union[float, None] = None
    top_p: Union[float, None] = None
    n: int = 1
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    stop: Union[str, list[str], None] = None
    seed: Union[int, None] = None
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    logit_bias: Union[dict[str, float], None] = None
    user: Union[str, None] = None
    # vLLM extensions
    top_k: Union[int, None] = None
    min_p: Union[float, None] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Union[list[int], None] = None
    repetition_penalty: Union[float, None] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Union[list[int], None] = None
    bad_words: Union[list[str], None] = None
    truncate_prompt_tokens: Union[int, None] = None     # keep only the prompt's last N tokens (-1: the context)
    return_token_ids: bool = False                      # the prompt's and the choice's token ids too
    # vLLM fields with no equivalent here, refused rather than ignored
    use_beam_search: bool = False
    prompt_logprobs: Union[int, None] = None
    prompt_embeds: Union[str, list, None] = None
    priority: int = 0
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_* fields
    response_format: Union[ResponseFormat, None] = None
    structured_outputs: Union[StructuredOutputsField, None] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: Union[str, None] = None
    guided_choice: Union[list[str], None] = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Union[str, list]          # str, [token ids], [str] or [[token ids]]: checked by prompts_of()
    add_special_tokens: bool = True   # to a text prompt (vLLM)
    logprobs: Union[int, None] = None
    echo: bool = False
    best_of: Union[int, None] = None
    suffix: Union[str, None] = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Union[str, list[dict], None] = None
    name: Union[str, None] = None
    tool_calls: Union[list[dict], None] = None      # an assistant's earlier calls
    tool_call_id: Union[str, None] = None           # a tool message's answer to one
    reasoning: Union[str, None] = None              # an assistant's earlier thinking (vLLM)
    reasoning_content: Union[str, None] = None      # the same, by its older name


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=False):
    name: str
    description: Union[str, None] = None
    parameters: Union[dict, None] = None            # a JSON schema of the arguments


class Tool(msgspec.Struct, forbid_unknown_fields=False):
    function: FunctionDefinition
    type: str = "function"


class FunctionName(msgspec.Struct, forbid_unknown_fields=False):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=False):
    function: FunctionName
    type: str = "function"


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    # how the messages are rendered through the chat template (vLLM's fields; /tokenize's too)
    add_generation_prompt: bool = True
    continue_final_message: bool = False    # the last (assistant) message is left open, to be continued
    chat_template_kwargs: Union[dict, None] = None    # more template variables, as enable_thinking
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None
    add_special_tokens: bool = False  # the chat template writes them (vLLM)
    tools: Union[list[Tool], None] = None
    tool_choice: Union[str, NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True    # with a reasoning parser: the thinking is sent (vLLM)


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered through the chat template."""
    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[list[ChatMessage], None] = None
    add_special_tokens: Union[bool, None] = None      # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Union[dict, None] = None


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: Union[str, None] = None
    tokens: list[int]


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str
    lora_path: str
    pinned: bool = False              # kept on the device for good


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str


def decode_body(raw: bytes, kind: type):
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        # messages look like "Expected `int`, got `str` - at `$.max_tokens`"
        text = str(e)
        param = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_value") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8: {e.reason} at byte {e.start}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None


def structured_outputs_of(req: _SamplingFields) -> tuple[StructuredOutputs | None, str | None]:
    """The request's output constraint and the field that gave it (at most one may)."""
    given = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema.schema",
                               param="response_format", code="invalid_value")
            given.append(("response_format", {"json": fmt.json_schema.schema}))
        elif fmt.type == "json_object":
            given.append(("response_format", {"json": fmt.schema} if fmt.schema is not None else {"json_object": True}))
        elif fmt.type != "text":
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, got {fmt.type!r}",
                           param="response_format", code="invalid_value")
    so = req.structured_outputs
    if so is not None:
        given.append(("structured_outputs", {"json": so.json, "regex": so.regex, "choice": so.choice,
                                             "json_object": bool(so.json_object)}))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if getattr(req, name) is not None:
            given.append((name, {field: getattr(req, name)}))
    if len(given) > 1:
        raise ApiError(400, f"give one output constraint, not {' and '.join(name for name, _ in given)}",
                       param=given[1][0], code="invalid_value")
    if not given:
        return None, None
    param, fields = given[0]
    try:
        return StructuredOutputs(**fields), param
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None


UNSUPPORTED = {   # field: (whether a value asks for it, what to say)
    "use_beam_search": (lambda v: v, "beam search is not supported"),
    "prompt_logprobs": (lambda v: v is not None, "prompt_logprobs is not supported; /v1/completions with echo "
                                                 "and logprobs scores the prompt"),
    "prompt_embeds": (lambda v: v is not None, "prompt_embeds are not supported"),
    "priority": (lambda v: v != 0, "priority needs a priority scheduling policy, which this server does not run"),
}


def refuse_unsupported(req: _SamplingFields) -> None:
    for name, (asks, message) in UNSUPPORTED.items():
        if asks(getattr(req, name)):
            raise ApiError(400, message, param=name, code="invalid_value")


def truncated_prompt(prompt_ids: list[int], req: _SamplingFields, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (N = -1: the context length)."""
    n = req.truncate_prompt_tokens
    if n is None:
        return prompt_ids
    if n == -1:
        n = max_model_len
    if n < 1:
        raise ApiError(400, f"truncate_prompt_tokens must be -1 or at least 1, got {n}",
                       param="truncate_prompt_tokens", code="invalid_value")
    return prompt_ids[-n:]


def sampling_params(req: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None, structured: StructuredOutputs | None = None
                    ) -> SamplingParams:
    try:
        logit_bias = {int(token): bias for token, bias in (req.logit_bias or {}).items()}
    except ValueError:
        raise ApiError(400, "logit_bias keys must be token ids", param="logit_bias", code="invalid_value") from None
    fields = {
        "max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
        "min_p": req.min_p, "min_tokens": req.min_tokens, "seed": req.seed, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "logit_bias": logit_bias,
        "presence_penalty": req.presence_penalty, "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty, "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens, "structured_outputs": structured,
        "allowed_token_ids": req.allowed_token_ids, "bad_words": req.bad_words,
    }
    kwargs = {k: v for k, v in fields.items() if v is not None}
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        param = str(e).split(" ", 1)[0]          # SamplingParams errors start with the field name
        raise ApiError(400, str(e), param=param, code="invalid_value") from None


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request, each as text or token ids: ``prompt`` is one prompt (a
    string or a list of token ids) or a non-empty list of them."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    for p in batch:
        if isinstance(p, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those",
                           param="prompt", code="invalid_value")
        if not isinstance(p, (str, list)):
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of those",
                           param="prompt", code="invalid_value")
    return batch


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

