"""Reasoning parsers (`formwork serve --reasoning-parser`): exact splits of thinking
and content for both parsers and every kind of prompt, and streaming that gives the
same split whatever the deltas (a tag cut between two deltas included)."""
from __future__ import annotations

import random

import pytest

from formwork.gateway.reasoning import PARSERS, ReasoningSplitter, split_reasoning

QWEN_OPEN = "<|im_start|>assistant\n<think>\n"              # the template opened the thinking
QWEN_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking: false
PLAIN = "<|im_start|>assistant\n"

CASES = [  # (parser, prompt, output, reasoning, content)
    ("qwen3", PLAIN, "<think>\nLet me add.\n</think>\n\n4", "\nLet me add.\n", "4"),
    ("qwen3", PLAIN, "  <think>x</think>y", "x", "y"),
    ("qwen3", PLAIN, "4", None, "4"),                             # no thinking: all content
    ("qwen3", PLAIN, "a</think>b", None, "a</think>b"),           # nothing opened it
    ("qwen3", PLAIN, "<think>cut by max_tokens", "cut by max_tokens", None),
    ("qwen3", PLAIN, "<think>x</think>", "x", None),
    ("qwen3", PLAIN, "<thi", None, "<thi"),
    ("qwen3", PLAIN, "", None, None),
    ("qwen3", QWEN_OPEN, "sum</think>\n\n4", "sum", "4"),
    ("qwen3", QWEN_OPEN, "still thinking", "still thinking", None),
    ("qwen3", QWEN_OFF, "<think>x</think>4", None, "<think>x</think>4"),
    ("qwen3", QWEN_OFF, "4", None, "4"),
    ("deepseek_r1", PLAIN, "<think>\nhm\n</think>\n\nok", "\nhm\n", "ok"),
    ("deepseek_r1", PLAIN, "hm</think>ok", "hm", "ok"),          # R1 may leave <think> out
    ("deepseek_r1", PLAIN, "no end at all", "no end at all", None),
    ("deepseek_r1", PLAIN, "<th", "<th", None),
    ("deepseek_r1", QWEN_OPEN, "a</think> b </think> c", "a", "b </think> c"),
    ("deepseek_r1", QWEN_OFF, "plain answer", None, "plain answer"),
    ("deepseek_r1", "<think>old</think> history <think>", "new</think>ans", "new", "ans"),
]


@pytest.mark.parametrize("parser,prompt,output,reasoning,content", CASES)
def test_split(parser, prompt, output, reasoning, content):
    assert split_reasoning(parser, prompt, output) == (reasoning, content)


def _stream(parser: str, prompt: str, pieces: list[str]) -> tuple[str | None, str | None]:
    s = ReasoningSplitter(parser, prompt)
    rs, cs = [], []
    for p in pieces:
        r, c = s.feed(p)
        rs.append(r)
        cs.append(c)
    r, c = s.finish()
    return "".join(rs + [r]) or None, "".join(cs + [c]) or None


@pytest.mark.parametrize("parser,prompt,output,reasoning,content", CASES)
def test_streaming_gives_the_same_split_for_any_deltas(parser, prompt, output, reasoning,
                                                       content):
    expected = (reasoning, content)
    assert _stream(parser, prompt, list(output)) == expected             # char by char
    for i in range(len(output) + 1):                                   # every cut in two
        for j in range(i, len(output) + 1, 3):
            assert _stream(parser, prompt, [output[:i], output[i:j], output[j:]]) == expected
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(output) + 1), min(len(output) + 1, 4)))
        pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
        assert _stream(parser, prompt, pieces) == expected


def test_a_partial_end_tag_is_held_back_not_sent():
    s = ReasoningSplitter("qwen3", QWEN_OPEN)
    assert s.feed("abc</th") == ("abc", "")
    assert s.feed("ink>\n\nok") == ("", "ok")
    s = ReasoningSplitter("qwen3", QWEN_OPEN)
    assert s.feed("a <") == ("a ", "")
    assert s.feed("b") == ("<b", "")             # not a tag after all: sent as reasoning
    assert s.finish() == ("", "")


def test_unknown_parser_is_refused():
    assert PARSERS == ("deepseek_r1", "qwen3")
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("granite")


@pytest.mark.parametrize("parser,prompt,output,reasoning,content", CASES)
def test_step_releases_what_is_held_at_the_last_delta(parser, prompt, output, reasoning, content):
    s = ReasoningSplitter(parser, prompt)
    half = len(output) // 2
    r1, c1 = s.step(output[:half], last=False)
    r2, c2 = s.step(output[half:], last=True)
    assert ((r1 + r2) or None, (c1 + c2) or None) == (reasoning, content)
