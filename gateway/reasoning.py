"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's
`<think> ... </think>` text goes to the chat message's `reasoning` (and to
`reasoning_content`, the name vLLM used before and DeepSeek's API uses), the rest
to `content`.

Where the reasoning starts: in the output when it opens with `<think>`
(whitespace before it allowed); at the output's first character when the prompt
left a `<think>` open (templates that put it in the generation prompt, as
DeepSeek-R1's and Qwen3.5's do); never when the prompt closed it (Qwen3's
`enable_thinking: false` ends the prompt with an empty `<think></think>`). The
two parsers differ only for an output that neither the prompt nor its own start
opens: `deepseek_r1` reads everything up to `</think>` as reasoning (R1 may
leave out the opening tag), `qwen3` reads such an output as content. An output
whose reasoning never ends (cut by max_tokens) is all reasoning. Whitespace
right after `</think>` is dropped. Streaming gives the same split as the whole
text: a partial tag at a delta's end is held back until the next delta tells.

A string scanner, not the tokenizer's special ids: the tags are special tokens in
Qwen3's and R1's vocabularies but plain text elsewhere, and the text is what the
client sees (skip_special_tokens keeps these tags: they are added tokens, not
special ones, in both). No library parses this (vLLM's parsers live inside vLLM).
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _prompt_state(prompt: str) -> str | None:
    """"reasoning" when the prompt leaves a <think> open, "content" when it ends with a
    closed one, None when the output decides."""
    opened, closed = prompt.rfind(START), prompt.rfind(END)
    if opened > closed:
        return "reasoning"
    if closed >= 0 and prompt.rstrip().endswith(END):
        return "content"
    return None


def thinks_first(prompt: str) -> bool:
    """Whether a constrained output may think before its constraint: not when the
    prompt closed the thinking (enable_thinking false)."""
    return _prompt_state(prompt) != "content"


def _partial(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One completion's text in deltas -> (reasoning delta, content delta) per feed."""

    def __init__(self, parser: str, prompt: str = "") -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser: one of {', '.join(PARSERS)}, got {parser!r}")
        self.parser = parser
        self._state = _prompt_state(prompt) or "lead"   # lead | reasoning | gap | content
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self._state == "lead":
                body = text.lstrip()
                if body.startswith(START):
                    text, self._state = body[len(START):], "reasoning"
                elif body == "" or START.startswith(body):
                    self._held = text                     # "<thi": wait for more
                    break
                else:
                    self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self._state == "reasoning":
                at = text.find(END)
                if at >= 0:
                    reasoning.append(text[:at])
                    text, self._state = text[at + len(END):], "gap"
                else:
                    keep = _partial(text, END)
                    reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    break
            elif self._state == "gap":
                text = text.lstrip()
                if text:
                    self._state = "content"
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)

    def step(self, delta: str, last: bool) -> tuple[str, str]:
        """`feed(delta)`, and at the output's last delta what `finish` releases too."""
        reasoning, content = self.feed(delta)
        if last:
            more, tail = self.finish()
            reasoning, content = reasoning + more, content + tail
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the output."""
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "lead" and self.parser == "deepseek_r1"):
            return held, ""
        if self._state == "lead":                      # "<thi" and nothing after: content
            return "", held
        return "", ""


def split_reasoning(parser: str, prompt: str, text: str) -> tuple[str | None, str | None]:
    """The whole output -> (reasoning, content), None for an empty part."""
    s = ReasoningSplitter(parser, prompt)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, (c1 + c2) or None
