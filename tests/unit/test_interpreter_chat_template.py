"""Role markers derived from a model's Jinja chat template."""

from __future__ import annotations

import pytest

from plait.interpreter import CHATML, MockBackend, RenderedChatTemplate, jinja_chat_template
from plait.interpreter.chat_template import resolve_chat_template
from plait.lang import assistant, gen, program, system, user

# SmolLM2-135M-Instruct's template (from its GGUF): a default system prompt when none is given
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
)


def test_default_system_prompt_appears_only_without_a_system_message():
    template = jinja_chat_template(SMOLLM2)
    first_user = template.markers("user", ())
    assert first_user.prefix.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )
    assert first_user.prefix.endswith("<|im_start|>user\n") and first_user.suffix == "<|im_end|>\n"
    assert template.markers("system", ()).prefix == "<|im_start|>system\n"
    assert template.markers("user", ("system",)).prefix == "<|im_start|>user\n"


@pytest.mark.parametrize("source", [SMOLLM2, LLAMA3])
def test_program_text_equals_the_templates_rendering(source):
    template = jinja_chat_template(source, bos_token="<|begin_of_text|>")

    @program
    def chat(s, with_system):
        if with_system:
            s += system("Be brief.")
        s += user("Hi")
        s += assistant(gen("a"))
        s += user("Again")
        s += assistant(gen("b"))

    for with_system in (True, False):
        state = chat.run(
            with_system=with_system, backend=MockBackend("Hello", chat_template=template)
        )
        assert state.text() == template.render(state.messages())


def test_bos_added_by_the_tokenizer_is_not_repeated():
    render = jinja_chat_template(LLAMA3, bos_token="<|begin_of_text|>").render
    template = RenderedChatTemplate(render, strip_leading="<|begin_of_text|>")
    assert template.markers("user", ()).prefix == "<|start_header_id|>user<|end_header_id|>\n\n"


def test_templates_that_cannot_work_incrementally_are_refused():
    last_only = "{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}"
    with pytest.raises(ValueError, match="does not render as an addition"):
        jinja_chat_template(last_only).markers("assistant", ("user",))
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(ValueError, match="cannot render a 'assistant' message.*user first"):
        jinja_chat_template(strict).markers("assistant", ())


def test_resolve_chat_template():
    assert resolve_chat_template(None, CHATML) is CHATML
    assert resolve_chat_template("chatml", CHATML) is CHATML
    assert isinstance(resolve_chat_template(SMOLLM2, CHATML), RenderedChatTemplate)
    with pytest.raises(TypeError, match="chat_template"):
        resolve_chat_template(3, CHATML)  # type: ignore[arg-type]
