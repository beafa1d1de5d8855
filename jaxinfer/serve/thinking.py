"""Reasoning in chat answers: which tags a chat template's model thinks in, and the split of an
answer into its reasoning (`reasoning_content`) and its content, whole or as it streams.

`--reasoning-format` takes llama-server's values (options.REASONING_FORMATS): "auto" (the
default: split wherever the template thinks, as "deepseek"), "deepseek" (the reasoning goes
to reasoning_content, the rest to content), "deepseek-legacy" (content keeps the whole text,
tags included, and reasoning_content has the reasoning too) and "none" (nothing is split).
The reasoning is the text inside the tags: from the start of the answer when the prompt opened
the tag (templates that write `<think>` into the generation prompt), else when the answer
starts with the tag.
"""

from __future__ import annotations

from dataclasses import dataclass

# (start, end) tags of the thinking models' templates, the first a template writes wins:
# Qwen3 / QwQ / DeepSeek-R1 / GLM-4.5 / Kimi, then Mistral's Magistral
TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def thinking_tags(template_source: str) -> tuple[str, str] | None:
    """The (start, end) tags a chat template's model thinks in; None if it does not think."""
    for start, end in TAGS:
        if start in template_source and end in template_source:
            return start, end
    return None


def opened(prompt_text: str, tags: tuple[str, str]) -> bool:
    """Whether a rendered prompt ends inside the start tag (the template opened it)."""
    return prompt_text.rstrip().endswith(tags[0])


@dataclass
class ReasoningSplit:
    """Splits an answer into (reasoning, content) as it streams: `feed(piece)` returns what is
    certain of each so far (a partial tag, and blanks that may precede one, wait), `finish()`
    the rest. With fmt "deepseek-legacy", content is the whole text as it comes."""

    tags: tuple[str, str]
    opened: bool = False
    fmt: str = "deepseek"

    def __post_init__(self):
        self.phase = "thinking" if self.opened else "undecided"
        self.thought = self.opened  # the answer has reasoning (maybe empty)
        self.held = ""  # text not yet given out

    def feed(self, piece: str) -> tuple[str, str]:
        start, end = self.tags
        self.held += piece
        reasoning, content = "", ""
        while True:
            if self.phase == "undecided":
                body = self.held.lstrip()
                if body.startswith(start):
                    self.phase, self.held = "thinking", body[len(start) :]
                    self.thought = True
                    continue
                if start.startswith(body):  # blank so far, or a partial start tag
                    break
                self.phase = "answer"
            if self.phase == "thinking":
                at = self.held.find(end)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.phase, self.held = "after", self.held[at + len(end) :]
                    continue
                keep = _partial(self.held, end)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            if self.phase == "after":  # the blanks between the end tag and the answer go
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.phase = "answer"
            content += self.held
            self.held = ""
            break
        if self.fmt == "deepseek-legacy":
            content = piece
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held: reasoning the answer never closed, or content."""
        held, self.held = self.held, ""
        if self.fmt == "deepseek-legacy" or self.phase == "after":
            return ("", "") if self.phase != "thinking" else (held, "")
        return (held, "") if self.phase == "thinking" else ("", held)


def split(text: str, tags: tuple[str, str], opened: bool, fmt: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning None where the answer did not think."""
    reader = ReasoningSplit(tags, opened, fmt)
    reasoning, content = reader.feed(text)
    more_reasoning, more_content = reader.finish()
    thought = reader.thought
    if fmt == "deepseek-legacy":
        content = text
    else:
        content += more_content
    return (reasoning + more_reasoning if thought else None), content


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is shorter than it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
