"""The chat template used for a model that has none but whose tokenizer knows ChatML's
`<|im_start|>` and `<|im_end|>` (the default model): Qwen's ChatML, tools included."""

from __future__ import annotations

# Qwen2.5 / Qwen3 layout: tools in the system turn, calls as <tool_call> JSON, results in
# <tool_response> blocks of a user turn.
CHATML_WITH_TOOLS = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role }}
{%- if message.content or not message.tool_calls %}{{- '\\n' + (message.content or '') }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set function = call.function or call %}
{%- set arguments = function.arguments if function.arguments is string else function.arguments | tojson %}
{{- '\\n<tool_call>\\n{"name": "' + function.name + '", "arguments": ' + arguments + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
