"""The chat templates of the Llama 3.x, Qwen2.5, Qwen3, Phi-3 and Mistral families through pyml's
sandboxed Jinja path, against transformers' apply_chat_template on the same template.

The templates (tests/nlp/templates) are in each family's style and use its constructs (Llama 3.2's
strftime_now date, Qwen3's namespace and reversed scan with <think> splitting, Qwen2.5's tools
with tojson, Mistral's raise_exception), abbreviated from the models' own files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models as bpe_models

from pyml.core.errors import TemplateError
from pyml.nlp.chat import apply_chat_template

TEMPLATES = Path(__file__).parent / "templates"
FAMILIES = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "qwen2.5": (None, "<|im_end|>"),
            "qwen3": (None, "<|im_end|>"), "phi3": ("<s>", "<|endoftext|>"), "mistral": ("<s>", "</s>")}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3+3?  "}],
    [{"role": "user", "content": "Think."}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."},
     {"role": "user", "content": "Again, 北京 👍"}],
]


def oracle(bos, eos, template):
    from transformers import PreTrainedTokenizerFast
    backend = Backend(bpe_models.BPE(vocab={"a": 0}, merges=[]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, chat_template=template)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_family_templates_render_as_transformers(family, add_generation_prompt):
    bos, eos = FAMILIES[family]
    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    reference = oracle(bos, eos, template)
    for messages in CONVERSATIONS:
        if family == "mistral" and messages[0]["role"] == "system":
            messages = messages[1:]
        want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = apply_chat_template(template, messages, bos_token=bos or "", eos_token=eos,
                                  add_generation_prompt=add_generation_prompt)
        assert got == want, (family, messages)


def test_qwen3_thinking_switch_and_tools_reach_the_template():
    template = (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8")
    messages = CONVERSATIONS[0]
    want = oracle(None, "<|im_end|>", template).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    got = apply_chat_template(template, messages, eos_token="<|im_end|>", enable_thinking=False)
    assert got == want and got.endswith("<think>\n\n</think>\n\n")
    qwen25 = (TEMPLATES / "qwen2.5.jinja").read_text(encoding="utf-8")
    tools = [{"type": "function", "function": {"name": "weather", "description": "Température <°C>"}}]
    want = oracle(None, "<|im_end|>", qwen25).apply_chat_template(messages, tools=tools, tokenize=False,
                                                                  add_generation_prompt=True)
    assert apply_chat_template(qwen25, messages, tools=tools) == want and "<°C>" in want


def test_mistral_template_refusal_is_one_line():
    template = (TEMPLATES / "mistral.jinja").read_text(encoding="utf-8")
    with pytest.raises(TemplateError, match="Conversation roles must alternate") as raised:
        apply_chat_template(template, [{"role": "assistant", "content": "hi"}])
    assert "\n" not in str(raised.value)
