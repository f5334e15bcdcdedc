"""Chapters 1 and 2: text in, text out. Prompts become token ids once; ids become text as they come.

`tokenize` checks a prompt (text or ids) against the model's context window and vocabulary;
`render_chat` writes a conversation in the model's chat template; `IncrementalDetokenizer`
turns each new id into the text it completes, holding back what could still become a stop
string. Every engine, from the baseline of Chapter 1 on, uses these three.
"""

from __future__ import annotations

import copy
import threading
import uuid
from collections.abc import Callable, Sequence

from minivllm.contracts import TextPiece, check_max_new_tokens, is_integer

# --8<-- [start:stop-text]
class IncrementalDetokenizer:
    """Turn generated ids into text pieces as they arrive, and honour stop strings.

    A piece is only released once it is final: not the first bytes of a character
    still being spelled out, and not text that might be the start of a stop string.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_tokens: int = 0):
        self.tokenizer, self.stop, self.min_tokens = tokenizer, tuple(stop), min_tokens
        self.floor = 0          # min_tokens: a stop string must end after this character (vLLM's rule)
        self.stop_found: str | None = None
        self.ids: list[int] = []
        self.text = ""          # all text so far (cut at the stop string once one is seen)
        self.released = 0       # how many characters of self.text were handed out
        self.stopped = False    # a stop string was found
        self.tokens_in_text = 0  # once stopped: the tokens that spell the text kept (the rest spell the stop)

    def add(self, token_id: int) -> str:
        """Append one token; return the text that became safe to show."""
        self.ids.append(token_id)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.text.endswith("\ufffd"):  # half a multi-byte character: wait for the rest
            return ""
        if len(self.ids) < self.min_tokens:    # vLLM's min_tokens: no stop string ends the answer yet
            self.floor = len(self.text)
        found = [(at, s) for s in self.stop if (at := self.text.find(s, max(0, self.floor - len(s) + 1))) >= 0] \
            if len(self.ids) >= self.min_tokens else []
        if found:
            at, self.stop_found = min(found)
            self.text, self.stopped = self.text[:at], True
            self.tokens_in_text = next((m for m in range(len(self.ids) + 1) if len(self.tokenizer.decode(
                self.ids[:m], skip_special_tokens=True)) >= len(self.text)), len(self.ids))
            return self._release(len(self.text))
        # Hold back a tail that could still grow into a stop string.
        hold = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._release(len(self.text) - hold)

    def flush(self) -> str:
        """The request ended: release whatever was held back."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.released: upto] if upto > self.released else ""
        self.released = max(self.released, upto)
        return piece
# --8<-- [end:stop-text]


def attach_logprobs(piece: str, logprobs: list | None, sent: int, upto: int | None = None) -> tuple[str, int]:
    """Hand the log-probabilities not yet sent out (of the first `upto` tokens) with the next
    non-empty text piece. Returns the piece (a TextPiece when it carries some) and how many are now sent.
    """
    end = len(logprobs or ()) if upto is None else min(upto, len(logprobs or ()))
    if logprobs is None or not piece or sent >= end:
        return piece, sent
    return TextPiece(piece, logprobs[sent:end]), end


# --8<-- [start:tokenize]
def tokenize(tokenizer, prompt: str | list[int], max_new_tokens: int, context_length: int,
             vocab_size: int | None = None) -> list[int]:
    """A prompt's token ids, refusing requests the model cannot serve. Every engine checks here.

    A list of ids is taken as tokenised already (the server tokenises a prompt once and
    hands the ids on); they must name tokens of the vocabulary.
    """
    if isinstance(prompt, list):
        if not prompt or vocab_size is None or not all(
                is_integer(t) and 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be a non-empty list of integers in [0, {vocab_size})")
        ids = prompt
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    else:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:   # "\ud800": half of a UTF-16 pair, which no tokenizer reads
            raise ValueError(f"prompt is not valid Unicode text: a lone surrogate at character {exc.start}") from None
        ids = tokenizer(prompt).input_ids
    check_max_new_tokens(max_new_tokens)
    if len(ids) + max_new_tokens > context_length:
        raise ValueError(
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {len(ids) + max_new_tokens} tokens ({len(ids)} in the prompt, "
            f"{max_new_tokens} for the completion). Please shorten the prompt or max_new_tokens.")
    return ids
# --8<-- [end:tokenize]


# --8<-- [start:chat]
def render_chat(tokenizer, messages: list[dict]) -> str:
    """A conversation as the model was trained to read it (its chat template)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # A base model without a template: a plain transcript is the honest fallback.
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
# --8<-- [end:chat]


# --8<-- [start:chat-ids]
_TEXT_ONLY: dict[int, tuple[object, object]] = {}
_TEXT_ONLY_LOCK = threading.Lock()


def text_only(tokenizer):
    """A copy of the tokenizer that reads special-token strings as plain text, for good.

    A copy, because transformers switches that mode (split_special_tokens) by setting state on
    the tokenizer it is called on and leaving it set: on the one tokenizer that every request's
    thread shares, a prompt tokenised at that moment would have its own control tokens split
    into text (measured: concurrent chats answered differently from the same chats alone)."""
    with _TEXT_ONLY_LOCK:
        original, copied = _TEXT_ONLY.get(id(tokenizer), (None, None))
        if original is not tokenizer:
            copied = copy.deepcopy(tokenizer)
            copied("", split_special_tokens=True)    # switched once, never back
            _TEXT_ONLY[id(tokenizer)] = (tokenizer, copied)
    return copied


def chat_ids(tokenizer, messages: list[dict], render: Callable[[object, list[dict]], str] = render_chat) -> list[int]:
    """The conversation's token ids, with each message's text tokenised as text.

    Tokenising the rendered template whole would read "<|im_start|>" typed in a message as
    the control token itself, so a user could forge turns (a system message, an assistant's
    reply). Here the template is rendered with a marker in place of each message's text; the
    template's parts are tokenised as written (its control tokens), and each text with
    split_special_tokens=True. The parts meet where the template puts control tokens or line
    breaks, so ordinary text gets the same ids as before."""
    nonce = uuid.uuid4().hex
    marks = [f"\u2063{nonce}{i}\u2063" for i in range(len(messages))]
    rendered = render(tokenizer, [{**m, "content": mark} for m, mark in zip(messages, marks)])
    if [rendered.count(mark) for mark in marks] != [1] * len(marks):   # a template that changes the text
        raise ValueError("this model's chat template rewrites message text; send the prompt to /v1/completions")
    ids, rest = [], rendered
    for i, (m, mark) in enumerate(zip(messages, marks)):
        template, rest = rest.split(mark)
        ids += tokenizer(template, add_special_tokens=i == 0).input_ids   # a BOS, where the tokenizer adds one
        ids += text_only(tokenizer)(m["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    return ids + tokenizer(rest, add_special_tokens=False).input_ids
# --8<-- [end:chat-ids]
