"""Chat templates: SmolLM2's own template against transformers' apply_chat_template, and the
built-in Gemma and ChatML templates against hand-written prompts."""

from __future__ import annotations

import time

import pytest

from pyml.core.errors import ModelFormatError, PymlError, TemplateError
from pyml.nlp.chat import (
    CHATML_TEMPLATE,
    GEMMA_TEMPLATE,
    apply_chat_template,
    fallback_chat_template,
)
from tests.nlp.test_tokenizer import read_metadata, transformers_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke about 日本 🤗."}],
    [{"role": "user", "content": "  padded  \n"}],
]


@pytest.fixture(scope="module")
def smollm2_oracle(smollm2_gguf):
    return transformers_tokenizer(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf):
    return read_metadata(smollm2_gguf)["tokenizer.chat_template"]  # gguf's reader's, kept between runs


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_oracle, smollm2_template, messages, add_generation_prompt):
    ours = apply_chat_template(smollm2_template, messages, bos_token=smollm2_oracle.bos_token,
                               eos_token=smollm2_oracle.eos_token, add_generation_prompt=add_generation_prompt)
    theirs = smollm2_oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


def test_tokenizer_applies_the_file_template(smollm2_gguf, smollm2_oracle):
    from pyml.nlp.tokenizer import Tokenizer
    from tests.nlp.test_tokenizer import read_metadata
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(smollm2_gguf))
    messages = CONVERSATIONS[0]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == smollm2_oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(prompt)[:1] == [1]  # <|im_start|> is one token


def test_gemma_template_by_hand():
    messages = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": " Hello \n"},
                {"role": "assistant", "content": "Hi there!"}, {"role": "user", "content": "Bye"}]
    prompt = apply_chat_template(GEMMA_TEMPLATE, messages, bos_token="<bos>", eos_token="<eos>")
    assert prompt == ("<bos><start_of_turn>user\nBe helpful.\n\nHello<end_of_turn>\n"
                      "<start_of_turn>model\nHi there!<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n"
                      "<start_of_turn>model\n")
    no_prompt = apply_chat_template(GEMMA_TEMPLATE, messages[1:2], bos_token="<bos>", eos_token="<eos>",
                                    add_generation_prompt=False)
    assert no_prompt == "<bos><start_of_turn>user\nHello<end_of_turn>\n"


def test_gemma_template_refuses_roles_that_do_not_alternate():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="alternate") as raised:
        apply_chat_template(GEMMA_TEMPLATE, messages, bos_token="<bos>")
    assert isinstance(raised.value, PymlError)


def test_fallbacks():
    assert fallback_chat_template("gemma3") == GEMMA_TEMPLATE
    assert fallback_chat_template("llama") is None
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    prompt = apply_chat_template(CHATML_TEMPLATE, messages)
    assert prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_gemma_gguf_without_template_gets_the_fallback():
    """gemma3 GGUFs may carry no tokenizer.chat_template: the tokenizer uses Gemma's format."""
    from pyml.nlp.tokenizer import Tokenizer
    from tests.nlp.test_tokenizer import spm_metadata
    metadata = spm_metadata({"▁": -1}, add_space_prefix=False, **{"general.architecture": "gemma3"})
    metadata["tokenizer.ggml.tokens"][1:3] = ["<bos>", "<eos>"]
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    assert tokenizer.chat_template == GEMMA_TEMPLATE
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode(prompt).count(tokenizer.bos_id) == 1  # the template's <bos> is not doubled


def test_template_helpers_match_transformers():
    template = ("{{ strftime_now('%Y') | length }}|{{ {'a': '<b>'} | tojson }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}")
    out = apply_chat_template(template, [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    assert out == '4|{"a": "<b>"}|x'


def test_sandbox_refuses_escape():
    with pytest.raises(TemplateError):
        apply_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                            [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        apply_chat_template("{% set x = messages.append(1) %}", [{"role": "user", "content": "x"}])


def test_bad_template_and_bad_messages():
    with pytest.raises(ModelFormatError, match="does not parse"):
        apply_chat_template("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="role"):
        apply_chat_template(CHATML_TEMPLATE, [{"content": "no role"}])
    with pytest.raises(TemplateError):
        apply_chat_template(CHATML_TEMPLATE, "not a list")


USER = [{"role": "user", "content": "x"}]

HOSTILE_TEMPLATES = {
    "string times a billion": ("{{ 'a' * 1000000000 }}", "repeated string or list would be 1,000,000,000"),
    "list times a billion": ("{{ ([1] * 1000000000) | length }}", "repeated string or list"),
    "strftime of a huge format": ("{{ strftime_now('%Y' * 100000000) }}", "repeated string"),
    "strftime of a long format": ("{{ strftime_now('%Y' * 1000) }}", "strftime_now's format is longer"),
    "a huge power": ("{{ 10 ** 100000000 }}", "a power of more than"),
    "doubling by ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                      "{% endfor %}{{ ns.s | length }}", "characters made in all"),
    "doubling by +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                      "{% endfor %}", "a concatenation would be"),
    "shared references printed": ("{% set ns = namespace(d=['x']) %}{% for i in range(60) %}"
                                  "{% set ns.d = [ns.d, ns.d] %}{% endfor %}{{ ns.d }}", "a value printed"),
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                           "more than 300,000 loop iterations"),
    "nested loops over a list": ("{% set xs = range(100000) | list %}{% for i in xs %}{% for j in xs %}"
                                 "{% endfor %}{% endfor %}", "loop iterations"),
    "recursive macro": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "nest too deep"),
    "macro calling itself twice": ("{% macro f(n) %}{% if n < 60 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
                                   "{% endmacro %}{{ f(0) }}", "loop iterations and calls|longer than 5 s"),
    "percent width": ("{{ '%1000000000d' % 1 }}", "formatted string would be"),
    "format width": ("{{ '{:>1000000000}'.format('a') }}", "formatted string would be"),
    "center method": ("{{ 'a'.center(1000000000) }}", "str.center"),
    "center filter": ("{{ 'a' | center(1000000000) }}", "a centred string"),
    "indent filter": ("{{ 'a\nb' | indent(1000000000) }}", "an indent"),
    "replace doubling": ("{{ ('a' * 1000000) | replace('a', 'aaaaaaaaaa') }}", "a replace"),
    "list of shared strings": ("{{ (['a' * 1000000] * 1000) | join }}", "repeated string or list"),
    "join filter with a long separator": ("{{ (['a'] * 1000) | join('x' * 100000) }}", "a join would be"),
    "join method with a long separator": ("{{ ('x' * 100000).join(['a'] * 1000) }}", "str.join would be"),
    "long rendered text": ("{% for i in range(100000) %}{{ 'a' * 100 }}{% endfor %}", "rendered text is longer"),
    "a division by zero": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "nested format width": ("{{ '{0:{1}}'.format('a', 1000000000) }}", "a format width"),
    "squaring in a loop": ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}"
                           "{% endfor %}", "a product of more than"),
    "lipsum": ("{{ lipsum(1000000000) }}", "lipsum"),
    "map through a filter": ("{{ ['a'] | map('center', 1000000000) | list }}", "a centred string"),
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_fails_fast_naming_its_source(name):
    template, message = HOSTILE_TEMPLATES[name]
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=message) as raised:
        apply_chat_template(template, USER, source="the chat template of evil.gguf")
    assert time.perf_counter() - t0 < 10, name  # the bound; most fail in milliseconds
    message = str(raised.value)
    assert message.startswith("the chat template of evil.gguf: ") and "\n" not in message


def test_the_limits_leave_an_ordinary_long_conversation_alone(smollm2_template):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 200}
                for i in range(400)]
    prompt = apply_chat_template(smollm2_template, messages)
    assert prompt.count("<|im_start|>user") == 200 and "turn 399" in prompt and len(prompt) > 400_000


@pytest.mark.parametrize("source, named", [("/models/secret/dir/model.gguf", "model.gguf"),
                                           ("/models/secret/gpt2-tiny/tokenizer.json", "gpt2-tiny")])
def test_a_model_template_error_names_the_model_not_its_path(source, named):
    from pyml.nlp.tokenizer import Tokenizer
    from tests.nlp.test_tokenizer import spm_metadata
    metadata = spm_metadata({"▁": -1}, add_space_prefix=False,
                            **{"tokenizer.chat_template": "{{ raise_exception('no system messages') }}"})
    tokenizer = Tokenizer.from_gguf_metadata(metadata, source=source)
    with pytest.raises(TemplateError) as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert str(raised.value) == f"the chat template of {named}: no system messages"
