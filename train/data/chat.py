"""Chat data: conversations -> the tokenizer's own chat template -> tokens and a loss mask.

A conversation is a JSONL record ``{"messages": [{"role": ..., "content": ...}, ...]}``
(as TRL and open-r1 store them). It is rendered with the tokenizer's chat template
(``tokenizer_config.json``'s ``chat_template`` or a ``chat_template.jinja`` beside it)
by jinja2 exactly as transformers renders it (``transformers/utils/chat_template_utils.py``:
a sandboxed environment with trim_blocks/lstrip_blocks, loopcontrols, its ``tojson``,
``raise_exception`` and ``strftime_now``, the special tokens as variables), without
importing transformers. The characters that carry loss:

- ``--loss-on all``: every token;
- ``--loss-on assistant`` with a template that marks assistant text with
  ``{% generation %}``: those blocks (transformers' ``return_assistant_tokens_mask``);
- ``--loss-on assistant`` without markers: each assistant turn's span found by rendering
  the conversation prefix by prefix: what ``messages[:i+1]`` adds to ``messages[:i]``
  with the generation prompt (the header stays masked, the turn and its end-of-turn
  token carry loss). A template whose prefixes are not prefixes of the whole rendering
  (one that rewrites earlier turns) is refused: add generation markers to it.

Characters become tokens through the tokenizer's offsets: a token carries loss when it
overlaps a span, as transformers decides it.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

Span = Tuple[int, int]
LOSS_ON = ("assistant", "all")
MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def template_source(tok_file: Path, config: Dict[str, Any]) -> str:
    """The chat template of the tokenizer at ``tok_file`` (its directory's chat_template.jinja
    first, as transformers reads it, else tokenizer_config.json's ``chat_template``)."""
    jinja = tok_file.parent / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers' default is "default"
        source = {t["name"]: t["template"] for t in source}.get("default")
    if not isinstance(source, str) or not source:
        raise SystemExit(f"error: --tokenizer {tok_file.parent}: the tokenizer has no chat template (neither "
                         "chat_template in tokenizer_config.json nor chat_template.jinja); use the chat model's "
                         "tokenizer directory, or add a chat_template.jinja there")
    return source


def special_tokens(config: Dict[str, Any]) -> Dict[str, str]:
    """The special tokens the template sees as variables (transformers' special_tokens_map)."""
    out = {}
    for key in SPECIALS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: records the block's character span."""
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            self.blocks: Optional[List[str]] = None  # what was rendered so far, while tracking
            self.spans: List[Span] = []

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

        def _track(self, caller: Any) -> str:
            text = caller()
            if self.blocks is not None:
                start = sum(map(len, self.blocks))
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template: ``render(messages) -> (text, spans carrying loss)``."""

    def __init__(self, source: str, specials: Dict[str, str], loss_on: str = "assistant") -> None:
        if loss_on not in LOSS_ON:
            raise SystemExit(f"error: --loss-on {loss_on} is unknown; use one of {', '.join(LOSS_ON)}")
        self.env = _environment()
        self.template = self.env.from_string(source)
        self.tracker = next(e for e in self.env.extensions.values() if hasattr(e, "spans"))
        self.specials = specials
        self.loss_on = loss_on
        self.markers = bool(MARKER.search(source))
        #: How the loss spans are found (the manifest's ``spans``).
        self.method = ("all tokens" if loss_on == "all" else
                       "generation markers" if self.markers else "prefix renders")

    def text(self, messages: Sequence[Dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.template.render(messages=list(messages), tools=None, documents=None,
                                    add_generation_prompt=generation_prompt, **self.specials)

    def render(self, messages: Sequence[Dict[str, Any]]) -> Tuple[str, List[Span]]:
        if self.loss_on == "all":
            text = self.text(messages)
            return text, [(0, len(text))]
        if self.markers:
            self.tracker.blocks, self.tracker.spans = [], []
            try:
                for block in self.template.generate(messages=list(messages), tools=None, documents=None,
                                                    add_generation_prompt=False, **self.specials):
                    self.tracker.blocks.append(block)
                return "".join(self.tracker.blocks), self.tracker.spans
            finally:
                self.tracker.blocks = None
        return self._prefix_spans(messages)

    def _prefix_spans(self, messages: Sequence[Dict[str, Any]]) -> Tuple[str, List[Span]]:
        text = self.text(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self.text(messages[:i], True), self.text(messages[:i + 1])
            if not (text.startswith(through) and through.startswith(before)):
                raise SystemExit("error: the chat template renders an assistant turn differently once later turns "
                                 "follow (it rewrites earlier turns), so its span cannot be found by prefixes; add "
                                 "{% generation %} markers to the template or use --loss-on all")
            spans.append((len(before), len(through)))
        return text, spans


def messages_of(record: Any, where: str) -> List[Dict[str, Any]]:
    """The record's messages, checked: a list of {role, content}."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise SystemExit(f"error: {where} has no 'messages' list; chat data is one JSON record per line with "
                         "messages: [{\"role\": ..., \"content\": ...}, ...]")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise SystemExit(f"error: {where}: messages[{n}] = {json.dumps(m)[:80]} lacks role or content; give "
                             "every message both")
    return messages


def token_mask(offsets: np.ndarray, spans: Sequence[Span]) -> np.ndarray:
    """1 where a token (its [start, end) characters) overlaps a span, as transformers'
    ``return_assistant_tokens_mask``: each token against the first span ending after its start."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not len(spans) or not len(offsets):
        return mask
    s = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    first = np.searchsorted(s[:, 1], offsets[:, 0], side="right")
    inside = first < len(s)
    mask[inside] = offsets[inside, 1] > s[first[inside], 0]
    return mask
