"""The text pieces of the OpenAI-compatible routes: chat prompts, stream deltas, stop sequences."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from app.api.openai_text import REPLACEMENT_CHAR, TextDeltas, render_chat


class _Templated:
    chat_template = "{% for m in messages %}<{{m.role}}>{{m.content}}{% endfor %}"
    bos_token = "<s>"

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        assert kwargs == {"tokenize": False, "add_generation_prompt": True}
        return "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<a>"


def test_a_conversation_without_a_template_reads_as_role_lines_ending_with_assistant() -> None:
    prompt = render_chat([("developer", "Be brief."), ("user", "Hi"), ("assistant", "Hello"),
                          ("user", "Why?")], None)
    assert prompt == "system: Be brief.\nuser: Hi\nassistant: Hello\nuser: Why?\nassistant:"


def test_a_tokenizers_chat_template_renders_the_conversation_without_its_bos() -> None:
    assert render_chat([("developer", "a"), ("user", "b")], _Templated()) == \
        "<system>a<user>b<a>"


def test_pieces_hold_back_an_unfinished_character_and_the_start_of_a_stop_sequence() -> None:
    deltas = TextDeltas(stop=["END"])
    assert deltas.feed("Hello" + REPLACEMENT_CHAR) == "Hello"
    assert deltas.feed("Hello wor") == " wor"
    assert deltas.feed("Hello world E") == "ld "
    assert deltas.feed("Hello world EN") == ""
    assert deltas.feed("Hello world ENough", final=True) == "ENough"
    assert not deltas.stopped and deltas.finish_reason(5, 5) == "length"


def test_a_stop_sequence_waits_for_a_longer_one_that_may_start_before_it() -> None:
    deltas = TextDeltas(stop=["bXa", "X"])
    assert deltas.feed("abX") == "a"
    assert not deltas.stopped
    assert deltas.feed("abXa") == ""
    assert deltas.stopped and deltas.text == "a"


def test_a_stop_sequence_cuts_the_text_and_nothing_after_it_is_sent() -> None:
    deltas = TextDeltas(stop=["\n\n", "User:"])
    assert deltas.feed("Sure. ") == "Sure. "
    assert deltas.feed("Sure. Done\n\nUser: more") == "Done"
    assert deltas.stopped and deltas.text == "Sure. Done"
    assert deltas.feed("Sure. Done\n\nUser: more and more", final=True) == ""
    assert deltas.finish_reason(9, 9) == "stop"


def test_the_end_of_sequence_token_before_the_limit_finishes_for_stop() -> None:
    assert TextDeltas().finish_reason(3, 16) == "stop"


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="abX\n" + REPLACEMENT_CHAR, max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
       stop=st.lists(st.sampled_from(["X", "ab", "\n\n", "bXa", "Xa"]), max_size=3))
def test_the_pieces_always_add_up_to_the_text_up_to_the_first_stop(
    text: str, cuts: list[int], stop: list[str],
) -> None:
    deltas = TextDeltas(stop)
    sent = "".join(deltas.feed(text[:cut]) for cut in sorted(cuts))
    sent += deltas.feed(text, final=True)
    ends = [at for at in (text.find(s) for s in stop) if at >= 0]
    assert sent == text[: min(ends)] if ends else sent == text
    assert sent == deltas.text
