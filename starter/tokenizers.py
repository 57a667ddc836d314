"""Offline, deterministic tokenizer fixtures for four model families.

``build_tokenizer(out_dir, family, vocab_size)`` trains a byte-level BPE with the
``tokenizers`` library on a fixed list of CPython stdlib modules plus a
multilingual/emoji snippet defined here, and writes the files a Hugging Face
checkpoint ships with its tokenizer:

- ``tokenizer.json``          the trained BPE, the family's special tokens, its
                              normalizer / pre-tokenizer / post-processor / decoder
- ``tokenizer_config.json``   special tokens, ``chat_template`` (Jinja),
                              ``tokenizer_class: PreTrainedTokenizerFast``
- ``special_tokens_map.json``
- ``generation_config.json``  ``eos_token_id`` list and sampling defaults
- ``fixture.json``            what was built (family, vocab, builder version,
                              corpus hash); ignored by every loader

Every family gets the special tokens and a chat template in the style of the
real family (Llama 3.1, Qwen3 ChatML, Gemma 4, MiniCPM5), written for this
project (not copied), rich enough that mlx-lm's ``TokenizerWrapper`` infers the
same thinking / tool-parser behaviour it infers for the real checkpoints:

============  ===================  ==================  ======================
family        special-token ids    thinking            mlx-lm tool parser
============  ===================  ==================  ======================
llama         last 16 ids          none                none (JSON in text)
qwen3         last 26 ids          ``<think>``         ``json_tools``
gemma4        first 19 ids         ``<|channel>``      ``gemma4``
minicpm       0-2, last 9 ids      ``<think>``         ``minicpm5``
============  ===================  ==================  ======================

The total vocabulary (BPE + added tokens) is exactly ``vocab_size`` for every
family, so the model's embedding size equals ``len(tokenizer)``.

Pad token choices (documented because real checkpoints differ):
llama has no pad in Llama 3.1; we use ``<|finetune_right_pad_id|>`` (as Llama 3.2
does). qwen3 pads with ``<|endoftext|>``. gemma4 has ``<pad>`` at id 0. minicpm
pads with ``<unk>`` (id 0), which byte-level BPE never produces.

Determinism: the same (family, vocab_size, corpus) gives byte-identical files.
``ensure_tokenizer(family, vocab_size)`` caches builds under
``starter.cache_root()`` (``$MLXP_FIXTURE_DIR``, else the user cache), keyed by family,
vocab size, ``BUILDER_VERSION`` and a hash of the corpus.

Run ``python -m starter.tokenizers OUT FAMILY [VOCAB]`` to build one by hand.
(Not ``python starter/tokenizers.py``: that puts this directory on
``sys.path`` and this module would shadow the ``tokenizers`` package.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

from .chat_templates import GEMMA3_TEMPLATE, QWEN25_TEMPLATE

__all__ = [
    "BUILDER_VERSION",
    "TOKENIZER_FAMILIES",
    "build_tokenizer",
    "ensure_tokenizer",
    "fixture_root",
    "MULTILINGUAL_SNIPPET",
]

BUILDER_VERSION = "tok2"
TOKENIZER_FAMILIES = ("llama", "qwen3", "gemma4", "minicpm", "qwen2", "gemma3")

# Top-level stdlib modules present in every CPython >= 3.10 (sorted, fixed).
CORPUS_MODULES = (
    "abc argparse ast base64 bisect calendar cmd codecs colorsys contextlib copy csv "
    "dataclasses datetime difflib enum fnmatch fractions functools gettext glob gzip "
    "heapq hmac inspect ipaddress keyword linecache locale numbers operator optparse "
    "pathlib pprint queue random shlex shutil statistics string struct textwrap "
    "threading tokenize traceback types typing uuid warnings weakref zipfile"
).split()

# Repeated in the training text so that merges of multi-byte UTF-8 sequences
# exist (tokens holding part of a character, whole CJK characters, emoji ...).
MULTILINGUAL_SNIPPET = (
    "Héllo wörld! Ça va? Señor, naïve café, façade, smørrebrød, Łódź, Dvořák.\n"
    "Привет, мир! Как дела? Съешь же ещё этих мягких французских булок.\n"
    "Γειά σου Κόσμε. Ἐν ἀρχῇ ἦν ὁ λόγος.\n"
    "你好，世界！我们今天学习分词器。中文没有空格，所以每个字都很重要。\n"
    "こんにちは世界。ひらがなとカタカナ、そして漢字。トークナイザーのテストです。\n"
    "안녕하세요 세계! 한국어 문장입니다.\n"
    "مرحبا بالعالم. هذه جملة عربية.\n"
    "שלום עולם. זה משפט בעברית.\n"
    "नमस्ते दुनिया। यह हिंदी वाक्य है।\n"
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง\n"
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🔥 🚀 🐍 ✅ ⚠️ 🤖 🧠\n"
    "Math: ∀x∈ℝ, x²≥0; ∑ᵢ aᵢ = π ≈ 3.14159; √2 ≠ ∞; α→β ⇒ γ.\n"
    "Rare: 𠮷野家 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚 ﷺ ẞ ǅ ﬁ e\u0301 a\u0308\n"
    "Spaces:\tTab\u00a0NBSP\u3000ideographic\u2003em  double   triple\r\nCRLF\n"
)
SNIPPET_REPEATS = 40


# ---------------------------------------------------------------------------
# Family specifications
# ---------------------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ----- Llama 3.1 style ------------------------------------------------------
LLAMA_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- The system message is taken out of the loop. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, respond with JSON for a function call. " }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Tools go into the first user message by default. #}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
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

# ----- Qwen3 ChatML style ---------------------------------------------------
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
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
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
{%- endif %}
"""

# ----- Gemma 4 style --------------------------------------------------------
# Turns are <|turn>ROLE\n ... <turn|>\n, the assistant's role is "model".
# Tools are declared in the system turn as <|tool>declaration:NAME{...}<tool|>,
# calls are <|tool_call>call:NAME{key:value}<tool_call|>, results are
# <|tool_response>response:NAME{...}<tool_response|> inside the model turn, and
# strings inside these blocks are delimited by the <|"|> token. Thinking is
# switched on by <|think|> at the top of the system turn; the model then
# answers <|channel>thought\n...<channel|>. With thinking off the generation
# prompt closes an empty channel itself.
GEMMA4_TEMPLATE = r"""{%- macro format_value(v, upper_types=false, key='') -%}
    {%- if v is mapping -%}
        {{- '{' -}}
        {%- for k, item in v | dictsort -%}
            {{- k + ':' -}}{{- format_value(item, upper_types, k) -}}
            {%- if not loop.last -%}{{- ',' -}}{%- endif -%}
        {%- endfor -%}
        {{- '}' -}}
    {%- elif v is string -%}
        {%- if upper_types and key == 'type' -%}
            {{- '<|"|>' + v | upper + '<|"|>' -}}
        {%- else -%}
            {{- '<|"|>' + v + '<|"|>' -}}
        {%- endif -%}
    {%- elif v is boolean -%}
        {{- 'true' if v else 'false' -}}
    {%- elif v is none -%}
        {{- 'null' -}}
    {%- elif v is iterable -%}
        {{- '[' -}}
        {%- for item in v -%}
            {{- format_value(item, upper_types, key) -}}
            {%- if not loop.last -%}{{- ',' -}}{%- endif -%}
        {%- endfor -%}
        {{- ']' -}}
    {%- else -%}
        {{- v | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content | trim -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text | trim -}}
            {%- elif part.type == 'image' or part.type == 'image_url' -%}
                {{- image_token -}}
            {%- elif part.type == 'audio' -%}
                {{- audio_token -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro strip_thinking(text) -%}
    {%- if '<channel|>' in text -%}
        {{- text.split('<channel|>')[-1] | trim -}}
    {%- else -%}
        {{- text | trim -}}
    {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set loop_messages = messages -%}
{%- set has_system = messages | length > 0 and messages[0].role in ['system', 'developer'] -%}
{%- if thinking or tools or has_system -%}
    {{- '<|turn>system\n' -}}
    {%- if thinking -%}
        {{- '<|think|>\n' -}}
    {%- endif -%}
    {%- if has_system -%}
        {{- render_content(messages[0].content) -}}
        {%- set loop_messages = messages[1:] -%}
    {%- endif -%}
    {%- if tools -%}
        {%- for tool in tools -%}
            {%- set fn = tool.function if tool.function is defined else tool -%}
            {{- '<|tool>declaration:' + fn.name + '{' -}}
            {{- 'description:<|"|>' + (fn.description or '') + '<|"|>' -}}
            {%- if fn.parameters is defined and fn.parameters -%}
                {{- ',parameters:' + format_value(fn.parameters, true) -}}
            {%- endif -%}
            {{- '}<tool|>' -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- set ns = namespace(in_model=false, call_names=[], call_index=0) -%}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if not ns.in_model -%}
            {{- '<|turn>model\n' -}}
            {%- set ns.in_model = true -%}
        {%- endif -%}
        {%- if message.content is defined -%}
            {{- strip_thinking(render_content(message.content)) -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- set ns.call_names = message.tool_calls | map(attribute='function.name') | list -%}
            {%- set ns.call_index = 0 -%}
            {%- for tool_call in message.tool_calls -%}
                {%- set call = tool_call.function -%}
                {{- '<|tool_call>call:' + call.name -}}
                {%- if call.arguments is mapping -%}
                    {{- format_value(call.arguments) -}}
                {%- else -%}
                    {{- call.arguments -}}
                {%- endif -%}
                {{- '<tool_call|>' -}}
            {%- endfor -%}
        {%- else -%}
            {{- '<turn|>\n' -}}
            {%- set ns.in_model = false -%}
        {%- endif -%}
    {%- elif message.role == 'tool' -%}
        {%- if not ns.in_model -%}
            {{- raise_exception('A tool message must follow an assistant message with tool_calls.') -}}
        {%- endif -%}
        {%- if message.name is defined -%}
            {%- set tool_name = message.name -%}
        {%- elif ns.call_index < ns.call_names | length -%}
            {%- set tool_name = ns.call_names[ns.call_index] -%}
        {%- else -%}
            {%- set tool_name = 'unknown' -%}
        {%- endif -%}
        {%- set ns.call_index = ns.call_index + 1 -%}
        {{- '<|tool_response>response:' + tool_name -}}
        {%- if message.content is mapping -%}
            {{- format_value(message.content) -}}
        {%- else -%}
            {{- '{value:<|"|>' + render_content(message.content) + '<|"|>}' -}}
        {%- endif -%}
        {{- '<tool_response|>' -}}
    {%- else -%}
        {%- if ns.in_model -%}
            {{- '<turn|>\n' -}}
            {%- set ns.in_model = false -%}
        {%- endif -%}
        {%- set role = 'system' if message.role == 'developer' else message.role -%}
        {{- '<|turn>' + role + '\n' + render_content(message.content) + '<turn|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if not ns.in_model -%}
        {{- '<|turn>model\n' -}}
    {%- endif -%}
    {%- if not thinking -%}
        {{- '<|channel>thought\n<channel|>' -}}
    {%- endif -%}
{%- elif ns.in_model -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
"""

# ----- MiniCPM5 style -------------------------------------------------------
# ChatML turns; tool calls are bare XML blocks
# <function name="fn"><param name="p">value</param></function>, values with
# <, & or a newline go in CDATA; thinking is off unless enable_thinking is set.
MINICPM_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_param(value) -%}
    {%- if value is string -%}
        {%- if '<' in value or '&' in value or '\n' in value -%}
            {{- '<![CDATA[' + value + ']]>' -}}
        {%- else -%}
            {{- value -}}
        {%- endif -%}
    {%- else -%}
        {{- value | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools or has_system -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) -}}
        {%- if tools -%}{{- '\n\n' -}}{%- endif -%}
    {%- endif -%}
    {%- if tools -%}
        {{- '# Tools\n\nYou can call the functions below. Their signatures are given inside <tools></tools>:\n<tools>\n' -}}
        {%- for tool in tools -%}
            {{- (tool.function if tool.function is defined else tool) | tojson -}}
            {{- '\n' -}}
        {%- endfor -%}
        {{- '</tools>\n\nTo call a function, reply with one or more blocks of the form\n' -}}
        {{- '<function name="function-name"><param name="param-name">value</param></function>\n' -}}
        {{- 'Wrap a value that contains <, & or a newline in <![CDATA[...]]>.' -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- set content = render_content(message.content) if message.content is defined else '' -%}
        {%- if '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] | trim -%}
            {%- set content = content.split('</think>')[-1] | trim -%}
        {%- elif message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content | trim -%}
        {%- else -%}
            {%- set reasoning = '' -%}
        {%- endif -%}
        {%- if reasoning and loop.index0 > ns.last_user -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
                {{- '<function name="' + call.name + '">' -}}
                {%- if call.arguments is mapping -%}
                    {%- for key, value in call.arguments.items() -%}
                        {{- '<param name="' + key + '">' + render_param(value) + '</param>' -}}
                    {%- endfor -%}
                {%- else -%}
                    {{- call.arguments -}}
                {%- endif -%}
                {{- '</function>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>tool\n<tool_response>\n' + render_content(message.content) + '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if thinking -%}
        {{- '<think>\n' -}}
    {%- else -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def _tok(content: str, special: bool = True) -> dict:
    return {"content": content, "special": special}


# head: added tokens that take the first ids (trained as BPE special tokens);
# tail: added tokens appended after the BPE vocabulary. Each entry is
# (content, special). named: the tokenizer_config special-token attributes.
FAMILIES: dict[str, dict] = {
    "llama": dict(
        head=[],
        tail=[
            ("<|begin_of_text|>", True),
            ("<|end_of_text|>", True),
            ("<|reserved_special_token_0|>", True),
            ("<|reserved_special_token_1|>", True),
            ("<|finetune_right_pad_id|>", True),
            ("<|reserved_special_token_2|>", True),
            ("<|start_header_id|>", True),
            ("<|end_header_id|>", True),
            ("<|eom_id|>", True),
            ("<|eot_id|>", True),
            ("<|python_tag|>", True),
        ]
        + [(f"<|reserved_special_token_{i}|>", True) for i in range(3, 8)],
        named=dict(
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            pad_token="<|finetune_right_pad_id|>",
        ),
        split=LLAMA3_SPLIT,
        normalizer=None,
        bos_processor="<|begin_of_text|>",
        template=LLAMA_TEMPLATE,
        config_extra=dict(
            clean_up_tokenization_spaces=True,
            model_input_names=["input_ids", "attention_mask"],
            model_max_length=131072,
        ),
        generation=dict(
            eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
            bos="<|begin_of_text|>",
            extra=dict(do_sample=True, temperature=0.6, top_p=0.9),
        ),
        config_bos="<|begin_of_text|>",
    ),
    "qwen3": dict(
        head=[],
        tail=[
            ("<|endoftext|>", True),
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<|object_ref_start|>", True),
            ("<|object_ref_end|>", True),
            ("<|box_start|>", True),
            ("<|box_end|>", True),
            ("<|quad_start|>", True),
            ("<|quad_end|>", True),
            ("<|vision_start|>", True),
            ("<|vision_end|>", True),
            ("<|vision_pad|>", True),
            ("<|image_pad|>", True),
            ("<|video_pad|>", True),
            ("<tool_call>", False),
            ("</tool_call>", False),
            ("<|fim_prefix|>", False),
            ("<|fim_middle|>", False),
            ("<|fim_suffix|>", False),
            ("<|fim_pad|>", False),
            ("<|repo_name|>", False),
            ("<|file_sep|>", False),
            ("<tool_response>", False),
            ("</tool_response>", False),
            ("<think>", False),
            ("</think>", False),
        ],
        named=dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None),
        split=QWEN2_SPLIT,
        normalizer="NFC",
        bos_processor=None,
        template=QWEN3_TEMPLATE,
        config_extra=dict(
            clean_up_tokenization_spaces=False,
            errors="replace",
            model_max_length=131072,
            split_special_tokens=False,
        ),
        generation=dict(
            eos=["<|im_end|>", "<|endoftext|>"],
            bos="<|endoftext|>",
            extra=dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95),
        ),
        config_bos="<|endoftext|>",
    ),
    "gemma4": dict(
        head=[
            ("<pad>", True),
            ("<eos>", True),
            ("<bos>", True),
            ("<unk>", True),
            ("<mask>", True),
            ("<|turn>", True),
            ("<turn|>", True),
            ("<|think|>", True),
            ("<|channel>", True),
            ("<channel|>", True),
            ("<|tool>", True),
            ("<tool|>", True),
            ("<|tool_call>", True),
            ("<tool_call|>", True),
            ("<|tool_response>", True),
            ("<tool_response|>", True),
            ('<|"|>', False),
            ("<|image|>", True),
            ("<|audio|>", True),
        ],
        tail=[],
        named=dict(
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            unk_token="<unk>",
            mask_token="<mask>",
        ),
        split=None,
        normalizer=None,
        bos_processor="<bos>",
        template=GEMMA4_TEMPLATE,
        config_extra=dict(
            add_bos_token=True,
            add_eos_token=False,
            audio_token="<|audio|>",
            clean_up_tokenization_spaces=False,
            image_token="<|image|>",
            model_max_length=131072,
            padding_side="left",
        ),
        generation=dict(
            eos=["<eos>", "<turn|>", "<|tool_response>"],
            bos="<bos>",
            extra=dict(do_sample=True, temperature=1.0, top_k=64, top_p=0.95),
        ),
        config_bos="<bos>",
    ),
    "minicpm": dict(
        head=[("<unk>", True), ("<s>", True), ("</s>", True)],
        tail=[
            ("<|im_start|>", True),
            ("<|im_end|>", True),
            ("<think>", True),
            ("</think>", True),
            ("<|fim_prefix|>", True),
            ("<|fim_middle|>", True),
            ("<|fim_suffix|>", True),
            ("<tool_response>", True),
            ("</tool_response>", True),
        ],
        named=dict(bos_token="<s>", eos_token="<|im_end|>", pad_token="<unk>", unk_token="<unk>"),
        split=None,
        normalizer=None,
        bos_processor="<s>",
        template=MINICPM_TEMPLATE,
        config_extra=dict(
            add_bos_token=True,
            add_eos_token=False,
            clean_up_tokenization_spaces=False,
            model_max_length=32768,
        ),
        generation=dict(
            eos=["</s>", "<|im_end|>"],
            bos="<s>",
            extra=dict(do_sample=True, temperature=0.7, top_p=0.95),
        ),
        config_bos="<s>",
    ),
}


# Qwen2.5: Qwen3's ChatML tokens without the thinking pair, its own template.
FAMILIES["qwen2"] = dict(
    FAMILIES["qwen3"],
    tail=[t for t in FAMILIES["qwen3"]["tail"] if t[0] not in ("<think>", "</think>")],
    template=QWEN25_TEMPLATE,
    config_extra=dict(FAMILIES["qwen3"]["config_extra"], model_max_length=32768),
    generation=dict(eos=["<|im_end|>", "<|endoftext|>"], bos="<|endoftext|>",
                    extra=dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                               repetition_penalty=1.05)),
)

# Gemma 3: <pad>/<eos>/<bos>/<unk>/<mask> first, then the turn and image markers.
FAMILIES["gemma3"] = dict(
    FAMILIES["gemma4"],
    head=[("<pad>", True), ("<eos>", True), ("<bos>", True), ("<unk>", True), ("<mask>", True),
          ("<start_of_turn>", True), ("<end_of_turn>", True), ("<start_of_image>", True),
          ("<end_of_image>", True), ("<image_soft_token>", True)],
    template=GEMMA3_TEMPLATE,
    config_extra=dict(add_bos_token=True, add_eos_token=False, clean_up_tokenization_spaces=False,
                      image_token="<image_soft_token>", model_max_length=131072,
                      padding_side="left"),
    generation=dict(eos=["<eos>", "<end_of_turn>"], bos="<bos>",
                    extra=dict(do_sample=True, top_k=64, top_p=0.95)),
)


# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f"{name}.py" for name in CORPUS_MODULES]
    return [f for f in files if f.is_file()]


def corpus_texts() -> list[str]:
    texts = [f.read_bytes().decode("utf-8", "replace") for f in corpus_files()]
    texts.extend([MULTILINGUAL_SNIPPET] * SNIPPET_REPEATS)
    return texts


def corpus_hash() -> str:
    h = hashlib.sha256()
    for t in corpus_texts():
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _pre_tokenizer(spec: dict):
    if spec["split"] is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _post_processor(spec: dict, ids: dict[str, int]):
    bl = processors.ByteLevel(trim_offsets=False)
    bos = spec["bos_processor"]
    if bos is None:
        return bl
    tp = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos}:1 $B:1",
        special_tokens=[(bos, ids[bos])],
    )
    return processors.Sequence([bl, tp])


def _train(spec: dict, vocab_size: int) -> Tokenizer:
    head, tail = spec["head"], spec["tail"]
    n_bpe = vocab_size - len(tail)
    if n_bpe < 256 + len(head) + 16:
        raise ValueError(f"vocab_size {vocab_size} too small for this family")
    tok = Tokenizer(models.BPE())
    if spec["normalizer"] == "NFC":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(spec)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(c, special=s, normalized=False) for c, s in head],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = corpus_texts()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.get_vocab_size(with_added_tokens=True) != n_bpe:
        raise RuntimeError(
            f"BPE reached {tok.get_vocab_size(with_added_tokens=True)} tokens, wanted {n_bpe}"
        )
    # The trainer registers every head token as special; _fix_added_token_flags
    # sets the family's flags in the serialized form.
    for c, s in tail:
        if tok.token_to_id(c) is not None:
            raise RuntimeError(f"{c!r} already in the trained vocabulary")
        tok.add_tokens([AddedToken(c, special=s, normalized=False)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError("vocabulary size mismatch after adding special tokens")
    ids = {c: tok.token_to_id(c) for c, _ in head + tail}
    tok.post_processor = _post_processor(spec, ids)
    return tok


def _dump(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fix_added_token_flags(tokenizer_json: dict, spec: dict) -> None:
    """Make the serialized added tokens carry exactly the family's special flags."""
    flags = {c: s for c, s in spec["head"] + spec["tail"]}
    seen = {}
    for t in tokenizer_json["added_tokens"]:
        t["special"] = flags[t["content"]]
        t["normalized"] = False
        seen[t["content"]] = t["id"]
    if set(seen) != set(flags):
        raise RuntimeError("added tokens do not match the family's token list")
    tokenizer_json["added_tokens"].sort(key=lambda t: t["id"])


def build_tokenizer(out_dir: str | Path, family: str, vocab_size: int = 1024) -> dict:
    """Train and write a fixture tokenizer; return the ids a model config needs.

    Returns ``{"bos_token_id", "eos_token_id" (list), "pad_token_id",
    "vocab_size", "special_tokens" ({content: id})}``. ``bos_token_id`` is the
    config-level bos (for qwen3 that is ``<|endoftext|>``, although its
    tokenizer has no ``bos_token``); ``eos_token_id`` is the generation_config
    list.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {TOKENIZER_FAMILIES}")
    spec = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _train(spec, vocab_size)
    tj = json.loads(tok.to_str())
    _fix_added_token_flags(tj, spec)
    _dump(out / "tokenizer.json", tj)

    ids = {t["content"]: t["id"] for t in tj["added_tokens"]}
    flags = {t["content"]: t["special"] for t in tj["added_tokens"]}
    named = spec["named"]

    added_decoder = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
        for t in tj["added_tokens"]
    }
    named_values = {v for v in named.values() if v is not None}
    extra = [c for c, _ in spec["head"] + spec["tail"] if flags[c] and c not in named_values]

    cfg: dict = {}
    for key in ("add_bos_token", "add_eos_token"):
        if key in spec["config_extra"]:
            cfg[key] = spec["config_extra"][key]
    cfg["added_tokens_decoder"] = added_decoder
    cfg["additional_special_tokens"] = extra
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
        if key in named:
            cfg[key] = named[key]
    cfg["chat_template"] = spec["template"]
    for key, value in spec["config_extra"].items():
        if key not in ("add_bos_token", "add_eos_token"):
            cfg[key] = value
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    _dump(out / "tokenizer_config.json", cfg)

    stm: dict = {"additional_special_tokens": extra}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token"):
        if named.get(key) is not None:
            stm[key] = {
                "content": named[key],
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
            }
    _dump(out / "special_tokens_map.json", stm)

    gen = spec["generation"]
    eos_ids = [ids[c] for c in gen["eos"]]
    pad_id = ids[named["pad_token"]]
    gcfg = {"bos_token_id": ids[gen["bos"]], "eos_token_id": eos_ids, "pad_token_id": pad_id}
    gcfg.update(gen["extra"])
    gcfg["transformers_version"] = "5.24.0"
    _dump(out / "generation_config.json", gcfg)

    info = {
        "bos_token_id": ids[spec["config_bos"]],
        "eos_token_id": eos_ids,
        "pad_token_id": pad_id,
        "vocab_size": vocab_size,
        "special_tokens": ids,
    }
    _dump(
        out / "fixture.json",
        {
            "builder": "starter.tokenizers",
            "builder_version": BUILDER_VERSION,
            "family": family,
            "vocab_size": vocab_size,
            "corpus_sha256": corpus_hash(),
            "ids": info,
        },
    )
    return info


# ---------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def fixture_root() -> Path:
    from .paths import cache_root
    return cache_root()


def ensure_tokenizer(family: str, vocab_size: int = 1024) -> Path:
    """Return a cached fixture tokenizer directory, building it if needed."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {TOKENIZER_FAMILIES}")
    key = f"tokenizer-{family}-v{vocab_size}-{BUILDER_VERSION}-{corpus_hash()[:10]}"
    root = fixture_root()
    final = root / key
    if (final / "fixture.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    try:
        build_tokenizer(tmp, family, vocab_size)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; keep its copy.
            if not (final / "fixture.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_fixture_ids(path: str | Path) -> dict:
    """The ids dict ``build_tokenizer`` returned for a built directory."""
    return json.loads((Path(path) / "fixture.json").read_text(encoding="utf-8"))["ids"]


def _main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m starter.tokenizers OUT FAMILY [VOCAB]", file=sys.stderr)
        return 2
    vocab = int(argv[2]) if len(argv) == 3 else 1024
    info = build_tokenizer(argv[0], argv[1], vocab)
    print(json.dumps({k: v for k, v in info.items() if k != "special_tokens"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
