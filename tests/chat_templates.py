"""Chat templates that write tool calls and thinking as the families' own templates do, for the tests.

Each writes an assistant's tool calls (and Qwen's thinking) in the family's format; the text they
give for an assistant turn was checked against the families' published templates (Qwen2.5-7B-
Instruct, Qwen3-0.6B, Qwen3-Coder, Qwen3.5-4B, Hermes-3, Llama-3.1/3.2/3.3-Instruct,
Mistral-Nemo-Instruct-2407, Mistral-Small-3.2-24B-Instruct-2506, Devstral-Small-2507) on the same
conversation: the same characters up to the end-of-turn token. Written short here, not copied."""

# Qwen3.5-style: the tools in the system turn, calls in <tool_call> blocks, the thinking begun in the
# generation prompt (closed there by enable_thinking=false), earlier thinking from reasoning_content.
HERMES = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}{{ '\\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '\\n</think>\\n\\n' }}{% endif %}{% endif %}")

# Qwen3-Coder / Qwen3.5: a call's parameters as XML-like blocks of raw text (objects and lists as JSON,
# other values as Jinja's string of them)
QWEN3_CODER = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{% if m.content and m.content | trim %}{{ '\\n' + m.content | trim + '\\n' }}{% endif %}"
    "{% for c in m.tool_calls %}{{ '\\n<tool_call>\\n<function=' + c.function.name + '>\\n' }}"
    "{% for k, v in c.function.arguments | items %}{{ '<parameter=' + k + '>\\n' }}"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
    "{{ '\\n</parameter>\\n' }}{% endfor %}{{ '</function>\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama 3.1-3.3: the tools in the user turn, a call as {"name", "parameters"}
LLAMA3_JSON = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Mistral 7B v0.3 / Nemo: [TOOL_CALLS] and a JSON list, each call with its 9-character id
MISTRAL_LIST = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{{ (c.function | tojson)[:-1] }}, \"id\": \"{{ c.id }}\"}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{{ eos_token }}{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")

# Mistral Small 3.2: [TOOL_CALLS]name[CALL_ID]id[ARGS]{...} after any content; Devstral leaves out [CALL_ID]
MISTRAL_ARGS = (
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}{% for c in m.tool_calls or [] %}"
    "[TOOL_CALLS]{{ c.function.name }}{% if with_ids %}[CALL_ID]{{ c.id }}{% endif %}"
    "[ARGS]{{ c.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{% else %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}")

# Llama 3.2/4's pythonic templates: a Python list of calls with keyword arguments
PYTHONIC = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]{% else %}{{ m.content }}{% endif %}"
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

END_OF_TURN = ("<|im_end|>\n", "<|eot_id|>", "</s>")

# the tools the tests' conversations offer (chat's shape), and a regex that has a model write a hermes
# call of one or two of them after some content
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
CALL_REGEX = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo|Rome)"\}\}\n'
              r'</tool_call>(\n<tool_call>\n\{"name": "search", "arguments": \{"q": "[a-z]{1,6}"\}\}\n</tool_call>)?')
