"""Built-in chat templates, used only when a converted directory carries none (no `chat_template` in
tokenizer_config.json, no chat_template.jinja): a DeepSeek-V3 conversation format written for ktrun.

DeepSeek-V3's format (as its hub tokenizer_config.json renders it):
  BOS, then every system message's text (joined by a blank line, hoisted to the front), then per turn
  `<｜User｜>{user}` / `<｜Assistant｜>{answer}<｜end▁of▁sentence｜>`; an assistant turn with tool calls is
  `<｜Assistant｜>{content}<｜tool▁calls▁begin｜>` + calls joined by "\\n", each
  `<｜tool▁call▁begin｜>{type}<｜tool▁sep｜>{name}\\n```json\\n{arguments}\\n```<｜tool▁call▁end｜>`, then
  `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`; a run of tool results is
  `<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{r1}<｜tool▁output▁end｜>\\n<｜tool▁output▁begin｜>{r2}...` closed by
  `<｜tool▁outputs▁end｜>` (the assistant answer after tool results follows that directly, with no Assistant tag);
  the generation prompt is `<｜Assistant｜>` (none right after tool results: the model answers there).
Where the original V3 template drops `<｜tool▁calls▁end｜>` after a single tool call, this one closes every call list
(as DeepSeek's later V3 revisions do).
"""
from __future__ import annotations

USER, ASSISTANT, EOS = "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"

DEEPSEEK_V3 = (
    "{%- set sys = namespace(text='', n=0) -%}"
    "{%- for m in messages if m['role'] == 'system' -%}"
    "{%- set sys.text = sys.text ~ ('\n\n' if sys.n else '') ~ m['content'] -%}{%- set sys.n = sys.n + 1 -%}"
    "{%- endfor -%}"
    "{{- bos_token ~ sys.text -}}"
    "{%- set st = namespace(in_outputs=false) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{{- ('\n' if st.in_outputs else '<｜tool▁outputs▁begin｜>') ~ '<｜tool▁output▁begin｜>' ~ m['content']"
    " ~ '<｜tool▁output▁end｜>' -}}"
    "{%- set st.in_outputs = true -%}"
    "{%- elif m['role'] == 'user' -%}"
    "{{- ('<｜tool▁outputs▁end｜>' if st.in_outputs else '') ~ '<｜User｜>' ~ m['content'] -}}"
    "{%- set st.in_outputs = false -%}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') -%}"
    "{{- ('<｜tool▁outputs▁end｜>' if st.in_outputs else '') ~ '<｜Assistant｜>' ~ (m['content'] or '')"
    " ~ '<｜tool▁calls▁begin｜>' -}}"
    "{%- for call in m['tool_calls'] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- ('\n' if not loop.first else '') ~ '<｜tool▁call▁begin｜>' ~ call.get('type', 'function')"
    " ~ '<｜tool▁sep｜>' ~ call['function']['name'] ~ '\n```json\n'"
    " ~ (args if args is string else args | tojson) ~ '\n```<｜tool▁call▁end｜>' -}}"
    "{%- endfor -%}"
    "{{- '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' -}}"
    "{%- set st.in_outputs = false -%}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{{- ('<｜tool▁outputs▁end｜>' if st.in_outputs else '<｜Assistant｜>') ~ (m['content'] or '')"
    " ~ '<｜end▁of▁sentence｜>' -}}"
    "{%- set st.in_outputs = false -%}"
    "{%- elif m['role'] != 'system' -%}"
    "{{- raise_exception('DeepSeek-V3 chat format: unknown role ' ~ m['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if st.in_outputs -%}{{- '<｜tool▁outputs▁end｜>' -}}"
    "{%- elif add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def builtin_template(vocab: dict[str, int]) -> tuple[str, str] | None:
    """(name, template) of the built-in template that fits a tokenizer's vocabulary, or None."""
    if USER in vocab and ASSISTANT in vocab:
        return "deepseek_v3", DEEPSEEK_V3
    return None
