"""Chat templates: the Jinja2 template a model ships, rendered the way transformers renders it.

A template is untrusted code from a model file, so it runs in Jinja2's immutable sandbox with
bounded work (template_sandbox.py), with the helpers transformers gives templates
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML). Models whose file carries no template get a built-in one:
Gemma's turn format for gemma architectures, ChatML otherwise.
"""

from __future__ import annotations

import json
from functools import lru_cache

from pyml.core.errors import ModelFormatError, TemplateError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma 3's turn format: no system role, so a system message opens the first user turn,
# followed by a blank line; the assistant is called "model"; contents are trimmed.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- set system = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if system else messages -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
    {{- (system if loop.first else '') + message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

_FALLBACK_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE,
                       "gemma3_text": GEMMA_TEMPLATE}


def fallback_chat_template(architecture: str) -> str | None:
    """The built-in template for a model family whose files may carry none (Gemma GGUFs)."""
    return _FALLBACK_TEMPLATES.get(architecture)


def apply_chat_template(template: str, messages: list, bos_token: str = "", eos_token: str = "",
                        add_generation_prompt: bool = True, source: str = "the chat template",
                        **variables) -> str:
    """The prompt text for `messages` (a list of {"role", "content"} dicts).

    `variables` reach the template too (transformers passes e.g. `tools`, other special tokens);
    `source` names the template in errors ("the chat template of model.gguf").
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TemplateError("messages must be a list of dicts, each with a 'role' and a 'content'")
    compiled = _compile(template, source)
    context = {"tools": None, "documents": None, **variables}  # a caller's tools= replaces the default
    sandbox = _sandbox()
    try:
        return sandbox.render(compiled, messages=messages, bos_token=bos_token, eos_token=eos_token,
                              add_generation_prompt=add_generation_prompt, **context)
    except sandbox.jinja2.TemplateError as e:  # raise_exception, an undefined key, a sandbox refusal, a limit
        raise TemplateError(f"{source}: {e}") from None
    except RecursionError:
        raise TemplateError(f"{source}: calls nest too deep (a macro that calls itself without end?)") from None
    except (ArithmeticError, LookupError, TypeError, ValueError) as e:  # the template's own mistakes
        raise TemplateError(f"{source}: {type(e).__name__}: {e}") from None


def _sandbox():
    # Deferred: importing jinja2 and its sandbox costs 45-55 ms, and a plain generation never
    # renders a template.
    from pyml.nlp import template_sandbox
    return template_sandbox


@lru_cache(maxsize=16)
def _compile(template: str, source: str):
    sandbox = _sandbox()
    env = sandbox.BoundedSandbox(filters={"tojson": _tojson}, globals={"raise_exception": _raise_exception},
                                 trim_blocks=True, lstrip_blocks=True)
    try:
        return env.compile_bounded(template)
    except sandbox.jinja2.TemplateSyntaxError as e:
        raise ModelFormatError(f"{source} does not parse: line {e.lineno}: {e.message}") from None


def _raise_exception(message):
    raise _sandbox().jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
