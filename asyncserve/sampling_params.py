"""Per-request sampling parameters, validated against vLLM's ranges."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# vLLM treats temperatures below this as greedy (dividing logits by ~0 would overflow).
GREEDY_TEMPERATURE = 1e-5
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class ThinkingMarks:
    """A model's thinking markers as single tokens: where a constraint starts when the model thinks first."""
    end: int                      # the token that ends the thinking: the constraint holds from the next one
    begin: int | None = None      # the token that begins it: allowed as the first one where the prompt has not
    open: bool = False            # the prompt leaves the answer thinking


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the generated text (vLLM's StructuredOutputsParams): exactly one of these."""
    json: dict | str | None = None       # a JSON schema, as an object or as JSON text
    regex: str | None = None             # the whole output matches it (Rust regex syntax)
    choice: tuple[str, ...] | None = None   # the output is one of these strings
    json_object: bool = False            # any JSON object
    # the constraint holds after the model's thinking (vLLM's structured outputs with a reasoning
    # parser): set by the chat route for a model whose template thinks; None: from the first token
    thinking: ThinkingMarks | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, json_object; got "
                             f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"a JSON schema must be an object or its JSON text, got {type(self.json).__name__}")
        if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
            raise ValueError("regex must be a non-empty string")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single str is accepted and wrapped
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token only; N: chosen + top-N
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (vLLM's name)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputs | None = None  # held to a schema, expression or choice list
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM)
    bad_words: list[str] = field(default_factory=list)  # never generated, with or without a leading space (vLLM)
    n: int = 1

    def __post_init__(self) -> None:
        # OpenAI clients send a bare string or null for `stop`
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.bad_words = list(self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.n != 1:
            raise ValueError(f"n must be 1 (only n=1 is supported), got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.allowed_token_ids is not None and not (
                self.allowed_token_ids and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be non-blank strings, got {self.bad_words!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether anything changes the logits before sampling (penalties, logit_bias, allowed or bad tokens)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words))
