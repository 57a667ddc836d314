"""Chat templates of the Qwen2.5 and Gemma 3 fixture tokenizers, written for
this project in the format the real families render (Qwen2.5: ChatML with a
default system prompt and JSON tool calls inside `<tool_call>` tags; Gemma 3:
`<start_of_turn>user|model` turns, the system prompt folded into the first
user turn, strictly alternating roles)."""

QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN25_TEMPLATE = r"""{%- set default_system = '""" + QWEN25_DEFAULT_SYSTEM + r"""' %}
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
{%- else %}
    {%- set system = default_system %}
{%- endif %}
{{- '<|im_start|>system\n' + system }}
{%- if tools %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" + (tool | tojson) }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + (tool_call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

GEMMA3_TEMPLATE = r"""{{- bos_token }}
{%- set prefix = '' %}
{%- set turns = messages %}
{%- if messages and messages[0].role == 'system' %}
    {%- if messages[0].content is string %}
        {%- set prefix = messages[0].content + '\n\n' %}
    {%- else %}
        {%- set prefix = messages[0].content[0].text + '\n\n' %}
    {%- endif %}
    {%- set turns = messages[1:] %}
{%- endif %}
{%- for message in turns %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) + '\n' }}
    {%- if loop.first %}
        {{- prefix }}
    {%- endif %}
    {%- if message.content is string %}
        {{- message.content | trim }}
    {%- else %}
        {%- for part in message.content %}
            {%- if part.type == 'image' %}
                {{- '<start_of_image>' }}
            {%- elif part.type == 'text' %}
                {{- part.text | trim }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<start_of_turn>model\n' }}
{%- endif %}
"""
