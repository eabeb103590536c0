#!/usr/bin/env python3
"""Build the tiny random-weight test models and independent reference outputs
under tests/fixtures/ (see tests/fixtures/README.md for the layout).

How to run (Linux or macOS, CPU only, ~1-2 minutes):

    python3 -m venv /tmp/fixvenv
    /tmp/fixvenv/bin/pip install -r scripts/requirements-fixtures.txt
    # (on Linux the mlx wheel needs its CPU backend: the requirements file pins
    #  "mlx[cpu]"; on macOS plain "mlx" works too)
    /tmp/fixvenv/bin/python scripts/make_fixtures.py            # rewrites tests/fixtures/
    /tmp/fixvenv/bin/python scripts/make_fixtures.py --out /tmp/fx   # elsewhere (e.g. to diff)
    /tmp/fixvenv/bin/python scripts/make_fixtures.py --only qwen3,llama_q4

Everything is deterministic (fixed seeds, fixed training corpus), so running it
twice with the pinned versions gives byte-identical files.

What is built:
  * tokenizer/      one byte-level BPE tokenizer trained here with `tokenizers`
                    (vocab VOCAB_SIZE incl. 8 special tokens), the shared source
                    of every model folder's tokenizer.json.
  * llama3, llama_gqa2_tied, mistral, qwen2, qwen3
                    float32 HF-style model folders, random weights; references
                    (prompt logits, greedy continuations, chat-template
                    renderings, decodes) come from HF transformers on CPU.
  * llama_q4        MLX affine 4-bit (group 32) model made by mlx-lm's convert
                    from a float llama; references come from mlx-lm (mlx CPU).
  * rope_llama3, rope_linear, rope_yarn
                    one small float model per scaled rope type, prompts longer
                    than original_max_position_embeddings; HF references.
  * qwen2_bf16, qwen3_bf16
                    bfloat16 weights (what CUDA's fused kernels run on); float32
                    HF references on them, and a tolerance measured by running
                    transformers in bfloat16 ("tolerance" in reference.json).
Float folders get config.json as transformers 5 writes it (rope_parameters) and
config.legacy.json (top-level rope_theta / rope_scaling): the same model.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import warnings  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

REPO = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

VOCAB_SIZE = 384  # total, special tokens included
SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
]
N_TRAINED = VOCAB_SIZE - len(SPECIAL_TOKENS)  # 256 byte symbols + merges
# Special tokens sit at the end of the vocabulary, as in Llama 3 / Qwen.
SPECIAL_IDS = {t: N_TRAINED + i for i, t in enumerate(SPECIAL_TOKENS)}
BOS = SPECIAL_IDS["<|begin_of_text|>"]
END_OF_TEXT = SPECIAL_IDS["<|end_of_text|>"]
EOT = SPECIAL_IDS["<|eot_id|>"]
IM_END = SPECIAL_IDS["<|im_end|>"]
ENDOFTEXT = SPECIAL_IDS["<|endoftext|>"]

# Pre-tokenizer split patterns of the real tokenizers.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox
ran back into the forest where the other foxes were waiting for their dinner.
Once upon a time, in a small village by the sea, there lived an old fisherman and
his wife. Every morning he went out in his boat, and every evening he came home
with a basket of fish. The people of the village said that he was the best
fisherman they had ever seen, and the children loved to hear his stories.

Language models read text as a sequence of tokens. A tokenizer splits the text
into pieces, and each piece is mapped to a number. The model then predicts the
next token, one step at a time, until it reaches the end of the answer or the
limit on the number of tokens. Good tests check that the same text always gives
the same tokens, and that decoding the tokens gives back the original text.

What is the capital of France? The capital of France is Paris. What is the
capital of Japan? The capital of Japan is Tokyo. How many days are there in a
week? There are seven days in a week, and there are twelve months in a year.
In 2024 there were 366 days, because it was a leap year; 1, 2, 3, 10, 100, 1000.

You are a helpful assistant. Please answer the question as well as you can, and
say so when you do not know the answer. Thank you for your help! I hope this
helps you with your work. Let me know if there is anything else I can do.

Some words come from other languages: café, naïve, résumé, über, Zürich, São
Paulo, piñata, crème brûlée, déjà vu, jalapeño. Héllo wörld! 日本語 and 日本 and
東京; Привет, мир; Ελληνικά; emoji 🙂 and symbols — dash, “quotes”, and … dots.
"""

# The prompt texts are repeated so that BPE learns whole-word tokens for them
# (short prompts keep reference.safetensors small) and multi-byte merges such
# as " 日本" or the partial-character token for the first two bytes of 日.
CORPUS += (
    "The quick brown fox jumps over the lazy dog. " * 3
    + "\nhéllo wörld — 日本. Héllo wörld — 日本!\n" * 3
    + "Once upon a time, 2024 cats and 2024 dogs.\n" * 3
)

# Training lines (deterministic order).
CORPUS_LINES = [line for line in CORPUS.splitlines() if line.strip()]


def train_base_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=N_TRAINED,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS_LINES, trainer=trainer)
    if tok.get_vocab_size() != N_TRAINED:
        raise SystemExit(f"corpus too small: trained vocab {tok.get_vocab_size()} != {N_TRAINED}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    for t, i in SPECIAL_IDS.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok


def llama_style_tokenizer(base: Tokenizer) -> str:
    """Llama-3 layout: Split+ByteLevel pre-tokenizer, ignore_merges, BOS added by
    a TemplateProcessing post-processor."""
    tok = Tokenizer.from_str(base.to_str())
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", BOS)],
            ),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    return json.dumps(j, ensure_ascii=False)


def qwen_style_tokenizer(base: Tokenizer) -> str:
    """Qwen2/Qwen3 layout: NFC normalizer, Qwen split regex, no BOS."""
    tok = Tokenizer.from_str(base.to_str())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = False
    return json.dumps(j, ensure_ascii=False)


def added_tokens_decoder() -> dict:
    return {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in SPECIAL_IDS.items()
    }


# ----------------------------------------------------------------------------
# Chat templates (verbatim copies of the real ones; see README)
# ----------------------------------------------------------------------------

# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json chat_template.
LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json chat_template.
MISTRAL_V03_TEMPLATE = r"""{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Qwen/Qwen2.5-*-Instruct tokenizer_config.json chat_template.
QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen/Qwen3-* (hybrid thinking) tokenizer_config.json chat_template.
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def llama_tokenizer_config() -> dict:
    # Modelled on meta-llama/Llama-3.1-8B-Instruct (clean_up_tokenization_spaces
    # is false here, see README).
    return {
        "added_tokens_decoder": added_tokens_decoder(),
        "bos_token": "<|begin_of_text|>",
        "chat_template": LLAMA31_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def mistral_tokenizer_config() -> dict:
    # Modelled on mistralai/Mistral-7B-Instruct-v0.3, but with this byte-level
    # tokenizer: bos <|begin_of_text|> stands in for <s>, eos <|end_of_text|>
    # for </s>.
    return {
        "added_tokens_decoder": added_tokens_decoder(),
        "bos_token": "<|begin_of_text|>",
        "chat_template": MISTRAL_V03_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|end_of_text|>",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": None,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def qwen_tokenizer_config(template: str) -> dict:
    # Modelled on Qwen/Qwen2.5-*-Instruct and Qwen/Qwen3-*.
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------
# Model fixtures
# ----------------------------------------------------------------------------

INIT_STD = 0.25
MAX_POS = 4096

LLAMA3_ROPE_SCALING = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    # head_dim 8, theta 5e5: wavelengths 6.3, 167, 4443, 1.2e5. With 256 the
    # three llama3 branches all occur: 6.3 < 64 (kept), 64 < 167 < 256
    # (smoothed), 4443 and 1.2e5 > 256 (divided by factor).
    "original_max_position_embeddings": 256,
    "rope_type": "llama3",
}

FIXTURES: dict[str, dict] = {
    "llama3": {
        "family": "llama3",
        "seed": 1001,
        "tokenizer": "llama",
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS,
            "eos_token_id": [END_OF_TEXT, EOT],
            "head_dim": 8,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": INIT_STD,
            "intermediate_size": 128,
            "max_position_embeddings": MAX_POS,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": LLAMA3_ROPE_SCALING,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": VOCAB_SIZE,
        },
        "generation_config": {"bos_token_id": BOS, "eos_token_id": [END_OF_TEXT, EOT]},
    },
    "llama_gqa2_tied": {
        "family": "llama3",
        "seed": 1002,
        "tokenizer": "llama",
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": BOS,
            "eos_token_id": [END_OF_TEXT, EOT],
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": INIT_STD,
            "intermediate_size": 32,
            "max_position_embeddings": MAX_POS,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": VOCAB_SIZE,
        },
        "generation_config": None,  # deliberately absent
    },
    "mistral": {
        "family": "mistral",
        "seed": 1003,
        "tokenizer": "mistral",
        "config": {
            "architectures": ["MistralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": BOS,
            "eos_token_id": END_OF_TEXT,
            "head_dim": 8,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": INIT_STD,
            "intermediate_size": 32,
            "max_position_embeddings": MAX_POS,
            "model_type": "mistral",
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "vocab_size": VOCAB_SIZE,
        },
        "generation_config": {"bos_token_id": BOS, "eos_token_id": END_OF_TEXT},
    },
    "qwen2": {
        "family": "qwen2",
        "seed": 1004,
        "tokenizer": "qwen2",
        "config": {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": IM_END,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": INIT_STD,
            "intermediate_size": 32,
            "max_position_embeddings": MAX_POS,
            "max_window_layers": 2,
            "model_type": "qwen2",
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": MAX_POS,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": VOCAB_SIZE,
        },
        "generation_config": {
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": [IM_END, ENDOFTEXT],
            "pad_token_id": ENDOFTEXT,
        },
    },
    "qwen3": {
        "family": "qwen3",
        "seed": 1005,
        "tokenizer": "qwen3",
        "config": {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": IM_END,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": INIT_STD,
            "intermediate_size": 32,
            "max_position_embeddings": MAX_POS,
            "max_window_layers": 2,
            "model_type": "qwen3",
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": VOCAB_SIZE,
        },
        "generation_config": {
            "bos_token_id": ENDOFTEXT,
            "eos_token_id": [IM_END, ENDOFTEXT],
            "pad_token_id": ENDOFTEXT,
        },
    },
}

# One small fixture per scaled rope type, with prompts longer than the type's
# original_max_position_embeddings (32), so that the reference compares positions
# beyond it (32 greedy tokens go further). hidden 32, 2 heads of 16, 1 KV head.
ROPE_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Language models read text as a sequence of tokens, one at a time.",
]
ROPE_ORIGINAL = 32


def rope_fixture(base: str, seed: int, family: str, theta: float, scaling: dict) -> dict:
    spec = copy.deepcopy(FIXTURES[base])
    spec.update(seed=seed, family=family, prompts=ROPE_PROMPTS)
    if "original_max_position_embeddings" in scaling:
        spec["long_prompts_beyond"] = {"original_max_position_embeddings": ROPE_ORIGINAL}
    spec["config"].update(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=32,
        tie_word_embeddings=True,
        rope_theta=theta,
        rope_scaling=scaling,
    )
    return spec


FIXTURES["rope_llama3"] = rope_fixture(
    "llama3",
    1007,
    "llama3",
    2e4,
    # head_dim 16, theta 2e4: wavelengths 6.3 (< 32/4: kept), 23.6 (smoothed), 89 and up (scaled)
    {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": ROPE_ORIGINAL,
        "rope_type": "llama3",
    },
)
FIXTURES["rope_linear"] = rope_fixture(
    "llama_gqa2_tied", 1008, "llama3", 1e5, {"rope_type": "linear", "factor": 4.0}
)
# Qwen2.5's long-context recipe, in its README's spelling (`type`, not `rope_type`).
FIXTURES["rope_yarn"] = rope_fixture(
    "qwen2",
    1009,
    "qwen2",
    1e5,
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ROPE_ORIGINAL},
)


# The brief asked for intermediate 512; 256 keeps tests/fixtures under 3 MiB.
# Scales/biases and activations are float32: with float16 the mlx-lm logits
# differ from a float32 evaluation of the same quantized weights by ~0.5
# (random weights, peaked attention), too noisy for a greedy reference.
Q4_FIXTURE = {
    "family": "llama3",
    "seed": 1006,
    "tokenizer": "llama",
    "group_size": 32,
    "bits": 4,
    "dtype": "float32",
    "config": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS,
        "eos_token_id": [END_OF_TEXT, EOT],
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": INIT_STD,
        "intermediate_size": 256,
        "max_position_embeddings": MAX_POS,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": LLAMA3_ROPE_SCALING,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    },
    "generation_config": {"bos_token_id": BOS, "eos_token_id": [END_OF_TEXT, EOT]},
}

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — 日本語",
    "Once upon a time, 2024 cats",
]
N_GREEDY = 32

CHATS = [
    # system + user (content with surrounding whitespace: Llama trims it)
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "  What is the capital of France?\n"},
    ],
    # multi-turn, no system, non-ASCII
    [
        {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say héllo in 日本語."},
    ],
    # single user message, no system
    [{"role": "user", "content": "Tell me a story about a fox."}],
    # system + multi-turn; the assistant turn carries a <think> block
    # (Qwen3's template strips it from history, the others keep the text)
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
]

# bfloat16 checkpoints, the dtype real ones come in: on CUDA their decode takes mlxcel's
# kernels (the dense GEMV with its RMSNorm, RoPE + KV-write, SwiGLU and residual epilogues;
# Qwen2's q/k/v biases inside the RoPE epilogue; Qwen3's per-head q/k norm kernel, which
# needs head_dim 64 or 128), which the float32 fixtures never reach. Small (hidden 32) to keep
# tests/fixtures under 4 MiB; the references stay float32 math on the rounded weights, with a
# tolerance measured by running transformers in bfloat16 (reduced_precision_tolerance).
# Weights N(0, 0.1²) rather than 0.25²: attention less peaked, so a correct bfloat16 run stays
# within ~0.02 of the float32 logits and almost every greedy step's top-2 gap is clear of it.
# Two of the three prompts (the longest), for the size.
def reduced_precision_fixture(base: str, seed: int, **config) -> dict:
    spec = copy.deepcopy(FIXTURES[base])
    spec["seed"] = seed
    spec["prompts"] = [PROMPTS[0], PROMPTS[2]]
    spec["config"].update(torch_dtype="bfloat16", initializer_range=0.1, **config)
    return spec


# Heads of 64, a size mlxcel's attention kernel takes, so batched decode on CUDA reads the
# keys and values the q/k/v kernel wrote into the pool itself (with heads of 16, MLX's
# attention over a gather of the pool ran instead, and the cache wrote the pool). Hidden 24
# (rows of 3 16-byte vectors: the GEMV's partial chunk of 4) keeps tests/fixtures under 4 MiB.
FIXTURES["qwen2_bf16"] = reduced_precision_fixture(
    "qwen2",
    1058,
    hidden_size=24,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=64,
)
FIXTURES["qwen3_bf16"] = reduced_precision_fixture(
    "qwen3",
    1011,
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    intermediate_size=64,
    tie_word_embeddings=True,
)


def tokenizer_files(kind: str, base: Tokenizer) -> tuple[str, dict]:
    if kind == "llama":
        return llama_style_tokenizer(base), llama_tokenizer_config()
    if kind == "mistral":
        return llama_style_tokenizer(base), mistral_tokenizer_config()
    if kind == "qwen2":
        return qwen_style_tokenizer(base), qwen_tokenizer_config(QWEN25_TEMPLATE)
    if kind == "qwen3":
        return qwen_style_tokenizer(base), qwen_tokenizer_config(QWEN3_TEMPLATE)
    raise ValueError(kind)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _compact(obj, indent: int = 0) -> str:
    """JSON with 2-space indent, but lists of numbers on one line."""
    pad, pad1 = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad1}{json.dumps(k, ensure_ascii=False)}: {_compact(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in obj):
            return "[" + ", ".join(json.dumps(x) for x in obj) + "]"
        return "[\n" + ",\n".join(pad1 + _compact(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def write_reference_json(path: Path, obj) -> None:
    text = _compact(obj) + "\n"
    assert json.loads(text) == obj
    path.write_text(text, encoding="utf-8")


def write_model_folder(folder: Path, spec: dict, base: Tokenizer) -> None:
    """config.json, tokenizer files, generation_config.json, random float32 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    # spec["config"] is the legacy form (top-level rope_theta / rope_scaling, torch_dtype):
    # kept as config.legacy.json. config.json is what transformers 5 writes for it
    # (rope_parameters, dtype, layer_types, ...), as current checkpoints look.
    write_json(folder / "config.legacy.json", spec["config"])
    shutil.copy(folder / "config.legacy.json", folder / "config.json")
    AutoConfig.from_pretrained(folder).save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert "rope_parameters" in written and "rope_theta" not in written, written
    tok_json, tok_cfg = tokenizer_files(spec["tokenizer"], base)
    (folder / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")
    write_json(folder / "tokenizer_config.json", tok_cfg)
    if spec.get("generation_config"):
        write_json(folder / "generation_config.json", spec["generation_config"])

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(spec["config"]["initializer_range"] * torch.randn(p.shape, generator=gen))
    sd = model.state_dict()
    if spec["config"]["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)
    wdt = getattr(torch, spec["config"].get("torch_dtype", "float32"))
    tensors = {k: v.detach().to(wdt).contiguous().clone() for k, v in sorted(sd.items())}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------


def tokenizer_references(folder: Path, raw_tok: Tokenizer, spec_prompts=PROMPTS):
    """Prompt ids, chat renderings and decodes from HF AutoTokenizer, cross-checked
    against the raw `tokenizers` pipeline of tokenizer.json."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for text in spec_prompts:
        ids = list(tok(text)["input_ids"])
        raw = raw_tok.encode(text, add_special_tokens=True).ids
        assert ids == raw, f"{folder.name}: HF ids {ids} != tokenizers ids {raw}"
        assert tok.decode(ids, skip_special_tokens=True) == text, (folder.name, text)
        prompts.append({"text": text, "ids": ids})

    chats = []
    for messages in CHATS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(rendered, str)
        ids = list(tok(rendered, add_special_tokens=False)["input_ids"])
        assert ids == raw_tok.encode(rendered, add_special_tokens=False).ids
        chats.append({"messages": messages, "rendered": rendered, "ids": ids})
    return tok, prompts, chats


def decode_references(tok, raw_tok: Tokenizer, prompts, chats) -> list:
    """A few decodes: with specials, without, random greedy output (may hold
    partial UTF-8 -> U+FFFD), and a prefix cut in the middle of a multi-byte char."""
    cases = []
    # "日本" is two tokens here, the first ending inside the 3-byte UTF-8 of 日.
    cjk = list(tok("日本", add_special_tokens=False)["input_ids"])
    assert len(cjk) >= 2 and "\ufffd" in tok.decode(cjk[:1]) and "\ufffd" in tok.decode(cjk[1:]), cjk
    id_lists = [
        (prompts[0]["ids"], False),
        (prompts[0]["ids"], True),
        (prompts[1]["ids"], False),
        (cjk, False),
        (cjk[:1], False),
        (cjk[1:], False),
        (prompts[1]["greedy"], False),
        (prompts[-1]["greedy"], False),
        (chats[0]["ids"], False),
        (chats[0]["ids"], True),
    ]
    for ids, skip in id_lists:
        text = tok.decode(ids, skip_special_tokens=skip)
        assert text == raw_tok.decode(ids, skip_special_tokens=skip), (ids, skip)
        cases.append({"ids": list(ids), "skip_special_tokens": skip, "text": text})
    return cases


def top2_gap(logits_row) -> float:
    v = np.sort(np.asarray(logits_row, dtype=np.float32))
    return float(v[-1] - v[-2])


def hf_references(folder: Path, spec: dict, raw_tok: Tokenizer) -> dict:
    from transformers import AutoModelForCausalLM

    tok, prompts, chats = tokenizer_references(folder, raw_tok, spec.get("prompts", PROMPTS))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    check_loaded(model, folder, spec)
    if "original_max_position_embeddings" in spec.get("long_prompts_beyond", {}):
        old = spec["long_prompts_beyond"]["original_max_position_embeddings"]
        assert all(len(p["ids"]) > old for p in prompts), (folder.name, [len(p["ids"]) for p in prompts], old)

    logits_out = {}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = p["ids"]
            full = model(torch.tensor([ids])).logits[0].float()
            logits_out[f"logits.{i}"] = full.contiguous()
            # Greedy with the KV cache, no EOS stop.
            out = model(torch.tensor([ids]), use_cache=True)
            past, last = out.past_key_values, out.logits[0, -1].float()
            greedy, gaps = [], []
            for step in range(N_GREEDY):
                t = int(torch.argmax(last))
                greedy.append(t)
                gaps.append(top2_gap(last.numpy()))
                if step + 1 < N_GREEDY:
                    out = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                    past, last = out.past_key_values, out.logits[0, -1].float()
            # Cross-check against a cache-free forward of the whole sequence.
            seq = ids + greedy
            nc = model(torch.tensor([seq])).logits[0].float()
            nc_argmax = nc[len(ids) - 1 : len(seq) - 1].argmax(-1).tolist()
            assert nc_argmax == greedy, f"{folder.name}: cached vs uncached greedy differ"
            assert torch.allclose(nc[: len(ids)], full, atol=1e-4)
            p["greedy"] = greedy
            p["gaps"] = gaps

    decode = decode_references(tok, raw_tok, prompts, chats)
    save_file(logits_out, str(folder / "reference.safetensors"), metadata={"format": "pt"})
    import transformers

    ref = {
        "family": spec["family"],
        "model_type": spec["config"]["model_type"],
        "generator": f"transformers {transformers.__version__} / torch {torch.__version__}, "
        "float32 CPU, eager attention; greedy = argmax with KV cache, no EOS stop",
        "vocab_size": VOCAB_SIZE,
        "prompts": prompts,
        "chat": chats,
        "decode": decode,
    }
    if spec["config"].get("torch_dtype", "float32") != "float32":
        ref["tolerance"] = reduced_precision_tolerance(folder, spec, prompts, logits_out)
    return ref


def reduced_precision_tolerance(folder: Path, spec: dict, prompts, logits_out) -> dict:
    """For weights stored in bfloat16/float16 (the references above are float32 math on
    them): how far an engine computing in that dtype may be from them. Measured, not
    chosen: transformers itself run in the checkpoint's dtype gives the spread of a correct
    implementation (prompt logits, and every greedy step's logits through its KV cache); the
    tolerance is 3x its worst prompt-logit difference, and a greedy step whose reference top-2
    gap is under 2x the worst difference seen anywhere may pick either of its near-tied tokens
    (an engine's token there must be within that gap of its own best)."""
    from transformers import AutoModelForCausalLM

    dt = getattr(torch, spec["config"]["torch_dtype"])
    low = AutoModelForCausalLM.from_pretrained(folder, dtype=dt, attn_implementation="eager")
    low.eval()
    hi = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    hi.eval()
    prompt_worst, step_worst = 0.0, 0.0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = p["ids"]
            y = low(torch.tensor([ids])).logits[0].float()
            prompt_worst = max(prompt_worst, (y - logits_out[f"logits.{i}"]).abs().max().item())
            # the float32 reference's greedy continuation, teacher-forced through the
            # low-precision cache: the logits of every step the engine's greedy run takes
            out = low(torch.tensor([ids]), use_cache=True)
            past, last = out.past_key_values, out.logits[0, -1].float()
            hout = hi(torch.tensor([ids]), use_cache=True)
            hpast, hlast = hout.past_key_values, hout.logits[0, -1].float()
            for t in p["greedy"]:
                step_worst = max(step_worst, (last - hlast).abs().max().item())
                out = low(torch.tensor([[t]]), past_key_values=past, use_cache=True)
                past, last = out.past_key_values, out.logits[0, -1].float()
                hout = hi(torch.tensor([[t]]), past_key_values=hpast, use_cache=True)
                hpast, hlast = hout.past_key_values, hout.logits[0, -1].float()
    worst = max(prompt_worst, step_worst)
    return {
        "measured_by": f"transformers in {spec['config']['torch_dtype']} against the float32 references: "
        f"prompt logits max-abs {prompt_worst:.3g}, greedy steps {step_worst:.3g}",
        "logits_max_abs": float(f"{3 * prompt_worst:.3g}"),
        "greedy_tie_gap": float(f"{2 * worst:.3g}"),
    }


def check_loaded(model, folder: Path, spec: dict) -> None:
    """Sanity checks that transformers honours the hand-written config."""
    cfg = spec["config"]
    sd = model.state_dict()
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    assert q.shape == (cfg["num_attention_heads"] * head_dim, cfg["hidden_size"]), q.shape
    assert k.shape == (cfg["num_key_value_heads"] * head_dim, cfg["hidden_size"]), k.shape
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    inv = model.model.rotary_emb.inv_freq.double().numpy()
    expected = expected_inv_freq(cfg, head_dim)
    assert np.allclose(inv, expected, rtol=1e-5, atol=0), (folder.name, inv, expected)
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type")) == "yarn":
        want = 0.1 * np.log(rs["factor"]) + 1.0  # the paper's attention factor
        assert abs(model.model.rotary_emb.attention_scaling - want) < 1e-6, folder.name


def expected_inv_freq(cfg: dict, head_dim: int) -> np.ndarray:
    """Independent RoPE frequency computation (incl. Llama 3 scaling)."""
    base = cfg["rope_theta"]
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "yarn":
        return yarn_inv_freq(base, head_dim, rs)
    assert kind == "llama3", kind
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    out = []
    kinds = set()
    for f in inv:
        wl = 2 * np.pi / f
        if wl < high_wl:
            out.append(f)
            kinds.add("kept")
        elif wl > low_wl:
            out.append(f / factor)
            kinds.add("scaled")
        else:
            s = (old / wl - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
            kinds.add("smoothed")
    assert kinds == {"kept", "scaled", "smoothed"}, kinds
    return np.array(out)


def yarn_inv_freq(base: float, dim: int, rs: dict) -> np.ndarray:
    """YaRN (arXiv 2309.00071) frequencies, written out from the paper's formulas in
    float64: dims that rotate more than beta_fast times over the original length keep
    their frequency, those below beta_slow rotations are interpolated by `factor`,
    and a linear ramp (over whole dims) joins the two."""
    factor, old = rs["factor"], rs["original_max_position_embeddings"]
    fast, slow = rs.get("beta_fast", 32), rs.get("beta_slow", 1)

    def dim_of(rotations):
        return dim * np.log(old / (rotations * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(np.floor(dim_of(fast)), 0), min(np.ceil(dim_of(slow)), dim - 1)
    if lo == hi:
        hi += 0.001
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    keep = 1 - np.clip((np.arange(dim // 2) - lo) / (hi - lo), 0, 1)
    assert 0 < keep.sum() < len(keep) and ((keep > 0) & (keep < 1)).any(), keep  # a real ramp
    return inv / factor * (1 - keep) + inv * keep


# ----------------------------------------------------------------------------
# Quantized fixture (mlx-lm)
# ----------------------------------------------------------------------------


def build_q4(folder: Path, spec: dict, base: Tokenizer, raw_tok: Tokenizer) -> dict:
    import mlx.core as mx
    from mlx_lm import convert as mlx_convert
    from mlx_lm import load as mlx_load
    from mlx_lm.models.cache import make_prompt_cache

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "float"
        write_model_folder(src, spec, base)
        # mlx-lm 0.32.2's llama reads only the legacy keys (it would run a transformers-5
        # config with theta 10000 and no scaling): convert from the legacy form, which
        # it then writes, as mlx-community checkpoints have it.
        shutil.copy(src / "config.legacy.json", src / "config.json")
        if folder.exists():
            shutil.rmtree(folder)
        mlx_convert(
            hf_path=str(src),
            mlx_path=str(folder),
            quantize=True,
            q_group_size=spec["group_size"],
            q_bits=spec["bits"],
            dtype=spec["dtype"],
        )

    # Keep only what mlx-lm wrote for the model; tokenizer files are ours
    # (mlx-lm re-saves the tokenizer through transformers, which rewrites it).
    keep = {"config.json", "model.safetensors", "model.safetensors.index.json"}
    for f in folder.iterdir():
        if f.name not in keep:
            f.unlink() if f.is_file() else shutil.rmtree(f)
    tok_json, tok_cfg = tokenizer_files(spec["tokenizer"], base)
    (folder / "tokenizer.json").write_text(tok_json + "\n", encoding="utf-8")
    write_json(folder / "tokenizer_config.json", tok_cfg)
    write_json(folder / "generation_config.json", spec["generation_config"])
    # mlx-lm writes config.json with indent 4 and sorted keys; normalise to ours.
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization"]["group_size"] == spec["group_size"]
    assert cfg["quantization"]["bits"] == spec["bits"]
    write_json(folder / "config.json", cfg)

    tok, prompts, chats = tokenizer_references(folder, raw_tok)
    model, _ = mlx_load(str(folder))
    weights = mx.load(str(folder / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == mx.uint32
    assert "lm_head.scales" in weights and "model.embed_tokens.biases" in weights

    logits_out = {}
    for i, p in enumerate(prompts):
        ids = p["ids"]
        full = model(mx.array([ids]))[0].astype(mx.float32)
        full_np = np.array(full)
        logits_out[f"logits.{i}"] = torch.from_numpy(full_np.copy())
        cache = make_prompt_cache(model)
        last = model(mx.array([ids]), cache=cache)[0, -1].astype(mx.float32)
        greedy, gaps = [], []
        for step in range(N_GREEDY):
            last_np = np.array(last)
            t = int(np.argmax(last_np))
            greedy.append(t)
            gaps.append(top2_gap(last_np))
            if step + 1 < N_GREEDY:
                last = model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32)
        seq = ids + greedy
        nc = np.array(model(mx.array([seq]))[0].astype(mx.float32))
        assert nc[len(ids) - 1 : len(seq) - 1].argmax(-1).tolist() == greedy, "q4 cached vs uncached differ"
        p["greedy"] = greedy
        p["gaps"] = gaps

    decode = decode_references(tok, raw_tok, prompts, chats)
    save_file(logits_out, str(folder / "reference.safetensors"), metadata={"format": "pt"})

    # Loose independent cross-check: transformers on the dequantized weights.
    hf_dequant_check(folder, weights, prompts, logits_out, spec)
    import mlx_lm

    return {
        "family": spec["family"],
        "model_type": "llama",
        "generator": f"mlx {mx.__version__} / mlx-lm {mlx_lm.__version__}, CPU, "
        f"{spec['dtype']} activations; greedy = argmax with mlx-lm KV cache, no EOS stop",
        "vocab_size": VOCAB_SIZE,
        "quantization": {"group_size": spec["group_size"], "bits": spec["bits"], "mode": "affine"},
        "prompts": prompts,
        "chat": chats,
        "decode": decode,
    }


def hf_dequant_check(folder: Path, weights, prompts, logits_out, spec) -> None:
    import mlx.core as mx
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = dict(spec["config"])
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    sd = {}
    for name in [k[: -len(".scales")] for k in weights if k.endswith(".scales")]:
        w = mx.dequantize(
            weights[name + ".weight"],
            weights[name + ".scales"],
            weights[name + ".biases"],
            group_size=spec["group_size"],
            bits=spec["bits"],
        ).astype(mx.float32)
        sd[name + ".weight"] = torch.from_numpy(np.array(w))
    for k, v in weights.items():
        if k.endswith("norm.weight"):
            sd[k] = torch.from_numpy(np.array(v.astype(mx.float32)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    model.eval()
    with torch.no_grad():
        for i, p in enumerate(prompts):
            hf = model(torch.tensor([p["ids"]])).logits[0]
            diff = (hf - logits_out[f"logits.{i}"]).abs().max().item()
            agree = (hf.argmax(-1) == logits_out[f"logits.{i}"].argmax(-1)).float().mean().item()
            print(f"  llama_q4 prompt {i}: HF(dequantized) vs mlx-lm max|dlogit|={diff:.2e} argmax agree={agree:.2f}")
            assert diff < 1e-2, diff


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


GAP_MIN = 5e-3  # wanted minimum top1-top2 logit gap over all greedy steps
SEED_TRIES = 40


def with_clear_gaps(name: str, spec: dict, build):
    """Build with spec's seed; if some greedy step is a near-tie (gap < GAP_MIN),
    deterministically retry with the next seeds."""
    for attempt in range(SEED_TRIES):
        s = dict(spec, seed=spec["seed"] + 100 * attempt)
        ref = build(s)
        if "tolerance" in ref:
            # reduced precision: its checks allow near-ties of up to the tolerance's gap
            # (engines are teacher-forced along the greedy tokens), so any seed serves
            return {**ref, "seed": s["seed"]}
        gap = min(g for p in ref["prompts"] for g in p["gaps"])
        if gap >= GAP_MIN:
            return {**ref, "seed": s["seed"]}
        print(f"  {name}: seed {s['seed']} has min greedy gap {gap:.2e} < {GAP_MIN}; trying next seed")
    raise SystemExit(f"{name}: no seed with clear greedy gaps")


def summarize(name: str, ref: dict) -> None:
    gaps = [g for p in ref["prompts"] for g in p["gaps"]]
    small = [(pi, si) for pi, p in enumerate(ref["prompts"]) for si, g in enumerate(p["gaps"]) if g < 1e-3]
    lens = [len(p["ids"]) for p in ref["prompts"]]
    print(
        f"  {name}: prompt lens {lens}, min greedy gap {min(gaps):.4g}, "
        f"gaps<1e-3: {len(small)}" + (f" first at (prompt,step)={small[0]}" if small else "")
    )


def verify(out: Path) -> None:
    """Reload every fixture folder from disk (transformers, or mlx-lm for
    llama_q4) and check it reproduces reference.json / reference.safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for folder in sorted(p for p in out.iterdir() if (p / "reference.json").exists()):
        ref = json.loads((folder / "reference.json").read_text(encoding="utf-8"))
        if "gguf" in ref:
            continue  # the default model's GGUF references (scripts/gguf_reference.py)
        logits = load_file(str(folder / "reference.safetensors"))
        tok = AutoTokenizer.from_pretrained(folder)
        for p in ref["prompts"]:
            assert list(tok(p["text"])["input_ids"]) == p["ids"], (folder.name, p["text"])
        for c in ref["chat"]:
            r = tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
            assert r == c["rendered"] and list(tok(r, add_special_tokens=False)["input_ids"]) == c["ids"]
        for d in ref["decode"]:
            assert tok.decode(d["ids"], skip_special_tokens=d["skip_special_tokens"]) == d["text"]
        worst = 0.0
        if folder.name == "llama_q4":
            import mlx.core as mx
            from mlx_lm import load as mlx_load

            model, _ = mlx_load(str(folder))
            for i, p in enumerate(ref["prompts"]):
                seq = p["ids"] + p["greedy"]
                y = np.array(model(mx.array([seq]))[0].astype(mx.float32))
                worst = max(worst, float(np.abs(y[: len(p["ids"])] - logits[f"logits.{i}"].numpy()).max()))
                assert y[len(p["ids"]) - 1 : -1].argmax(-1).tolist() == p["greedy"]
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            model.eval()
            with torch.no_grad():
                for i, p in enumerate(ref["prompts"]):
                    seq = p["ids"] + p["greedy"]
                    y = model(torch.tensor([seq])).logits[0]
                    worst = max(worst, (y[: len(p["ids"])] - logits[f"logits.{i}"]).abs().max().item())
                    assert y[len(p["ids"]) - 1 : -1].argmax(-1).tolist() == p["greedy"]
        assert worst < 1e-3, (folder.name, worst)
        legacy = ""
        if (folder / "config.legacy.json").exists():
            # the legacy config describes the same model: same logits from transformers
            with tempfile.TemporaryDirectory() as tmp:
                for f in folder.iterdir():
                    if f.name != "config.json":
                        os.symlink(f, Path(tmp) / f.name)
                os.symlink(folder / "config.legacy.json", Path(tmp) / "config.json")
                lm = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
                lm.eval()
                with torch.no_grad():
                    for i, p in enumerate(ref["prompts"]):
                        y = lm(torch.tensor([p["ids"]])).logits[0]
                        d = (y - logits[f"logits.{i}"]).abs().max().item()
                        assert d < 1e-4, (folder.name, "legacy config", d)
            legacy = ", legacy config.legacy.json gives the same logits"
        print(f"  verify {folder.name}: ok (reload max |dlogit| {worst:.1e}{legacy})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures")
    ap.add_argument("--only", type=str, default="", help="comma-separated fixture names")
    ap.add_argument("--verify", action="store_true", help="only re-check existing fixtures under --out")
    args = ap.parse_args()
    out: Path = args.out
    if args.verify:
        verify(out)
        return
    only = {s for s in args.only.split(",") if s}
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # bitwise-stable CPU reductions
    import transformers

    transformers.utils.logging.disable_progress_bar()

    base = train_base_tokenizer()
    tdir = out / "tokenizer"
    tdir.mkdir(exist_ok=True)
    (tdir / "tokenizer.json").write_text(
        json.dumps(json.loads(base.to_str()), ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(f"tokenizer: vocab {VOCAB_SIZE}, specials {SPECIAL_IDS}")

    for name, spec in FIXTURES.items():
        if only and name not in only:
            continue
        folder = out / name

        def build(s, folder=folder):
            if folder.exists():
                shutil.rmtree(folder)
            write_model_folder(folder, s, base)
            raw_tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
            return hf_references(folder, s, raw_tok)

        ref = with_clear_gaps(name, spec, build)
        write_reference_json(folder / "reference.json", ref)
        summarize(name, ref)

    if not only or "llama_q4" in only:
        folder = out / "llama_q4"
        tok_json, _ = tokenizer_files("llama", base)
        raw_tok = Tokenizer.from_str(tok_json)
        ref = with_clear_gaps("llama_q4", Q4_FIXTURE, lambda s: build_q4(folder, s, base, raw_tok))
        write_reference_json(folder / "reference.json", ref)
        summarize("llama_q4", ref)

    for f in out.rglob("*"):  # safetensors writes 0600 files; normalise
        os.chmod(f, 0o755 if f.is_dir() else 0o644)
    verify(out)
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"total bytes under {out}: {total} ({total / 2**20:.2f} MiB)")


if __name__ == "__main__":
    sys.exit(main())
