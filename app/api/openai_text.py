"""Text pieces of the OpenAI-compatible routes, pure: the prompt a conversation renders to, and
the part of a job's growing text a client has not been sent yet, cut at the first stop sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

REPLACEMENT_CHAR = "\ufffd"
"""What decoding shows for a character whose bytes have not all been generated yet."""


class ChatTemplate(Protocol):
    """The part of a transformers tokenizer that renders a conversation."""

    chat_template: Any
    bos_token: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def render_chat(messages: Sequence[tuple[str, str]], tokenizer: ChatTemplate | None) -> str:
    """The prompt of a conversation of ``(role, text)``: the tokenizer's chat template when it
    has one, else one ``role: text`` line per message and a last ``assistant:`` line for the
    model to continue. ``developer`` reads as ``system``."""
    turns = [("system" if role == "developer" else role, text) for role, text in messages]
    if tokenizer is not None and tokenizer.chat_template:
        rendered = str(tokenizer.apply_chat_template(
            [{"role": role, "content": text} for role, text in turns],
            tokenize=False, add_generation_prompt=True))
        bos = tokenizer.bos_token
        if isinstance(bos, str) and bos and rendered.startswith(bos):
            rendered = rendered[len(bos):]  # the text runner puts the BOS token first itself
        return rendered
    return "\n".join(f"{role}: {text}" for role, text in turns) + "\nassistant:"


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the earliest stop sequence in ``text`` begins, if any does."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    return min(found) if found else None


def hold_back(text: str, stop: Sequence[str]) -> str:
    """``text`` less a tail that may still change: a character still missing bytes, or the
    start of a stop sequence the next tokens may complete."""
    text = text.rstrip(REPLACEMENT_CHAR)
    tail = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - tail]


class TextDeltas:
    """Turns successive snapshots of a job's generated text into the pieces a client has not
    seen, never sending what a stop sequence cuts or what the next chunk may still change."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.text = ""
        """The answer so far: the generated text up to the first stop sequence."""
        self.sent = ""
        self.stopped = False
        """Whether a stop sequence ended the text (nothing after it is ever sent)."""

    def feed(self, generated: str, *, final: bool = False) -> str:
        """Take the job's whole generated text so far; returns the piece to send now."""
        if self.stopped:
            return ""
        # A stop sequence counts only where no longer one still being generated starts before it.
        settled = len(generated) if final else len(hold_back(generated, self.stop))
        cut = first_stop(generated, self.stop)
        if cut is not None and cut <= settled:
            self.text, self.stopped = generated[:cut], True
        else:
            self.text = generated[:settled]
        if not self.text.startswith(self.sent):
            return ""  # decoding changed text already sent: the client keeps what it has
        piece, self.sent = self.text[len(self.sent):], self.text
        return piece

    def finish_reason(self, generated_tokens: int, max_tokens: int) -> Literal["stop", "length"]:
        """``stop`` for a stop sequence or the end-of-sequence token, ``length`` at the limit."""
        return "stop" if self.stopped or generated_tokens < max_tokens else "length"
