"""Chat templates: where a model's come from, which one renders, and rendering them as
transformers 5 does (sources: transformers ``tokenization_utils_base.py`` -- ``from_pretrained``,
``get_chat_template``, ``apply_chat_template`` -- and ``utils/chat_template_utils.py`` --
``render_jinja_template`` and its compiled environment).

Where the templates of a Hugging Face directory come from (`load_hf_templates`):
  1. ``chat_template.jinja`` is the template named "default" and every
     ``additional_chat_templates/<name>.jinja`` the template named ``<name>`` (transformers has saved
     templates this way since 4.43). When any of these files exists, the ``chat_template`` entry of
     ``tokenizer_config.json`` is not read.
  2. Else ``tokenizer_config.json``'s ``chat_template``: a string (the "default" template) or a list
     of ``{"name": ..., "template": ...}`` (named templates).
A GGUF file's ``tokenizer.chat_template`` is one "default" template (`engine.tokenizer`).

Which one renders (`ChatTemplate.select`): "tool_use" when tools are given (an empty list counts)
and the model has one, else "default"; a model with neither raises `ChatTemplateError`.

How it renders (`ChatTemplate.render`): a sandboxed Jinja environment
(``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, the
``{% generation %}`` block rendered as its body), with the globals ``raise_exception``,
``strftime_now`` (local time), ``namespace`` (refusing ``_``-prefixed attributes) and the filter
``tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`` (``json.dumps``,
no HTML escaping). The template sees ``messages`` (each without its None-valued keys, reasoning
copied under ``reasoning_content`` and ``thinking``), ``tools`` (JSON schemas as given, or None),
``documents`` (or None), ``add_generation_prompt``, the model's special tokens (``bos_token``,
``eos_token``, ...) and any extra variables, which override the special tokens.

Continuing the final message (``continue_final_message``, transformers' tag method): a tag is
appended to the last message's content (its last text part when the content is a list), the
chat renders without a generation prompt, and the text is cut where the tag starts (and its
trailing whitespace stripped when the template did not keep the tag's own trailing space), so the
prompt ends inside that message and the model continues it.

Errors: `TokenizerError` when a template cannot be loaded or does not parse (the model's files
are at fault); `ChatTemplateError` (an `InvalidRequestError`: HTTP 400 at the router) when a
template rejects the messages (``raise_exception``) or fails on them.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Mapping, Sequence

from engine.errors import ChatTemplateError, TokenizerError

TEMPLATE_FILE = "chat_template.jinja"          # transformers' CHAT_TEMPLATE_FILE
TEMPLATE_DIR = "additional_chat_templates"     # transformers' CHAT_TEMPLATE_DIR
DEFAULT, TOOL_USE = "default", "tool_use"
# The named special tokens transformers 5 passes to a template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # transformers' continue_final_message_tag


def load_hf_templates(directory: Path, config: Mapping) -> dict[str, str]:
    """The named templates of a Hugging Face directory (``{}``: none); ``config`` is its parsed
    ``tokenizer_config.json``. Raises `TokenizerError` for a malformed ``chat_template`` entry or
    an unreadable template file."""
    files = {}
    if (directory / TEMPLATE_FILE).is_file():
        files[DEFAULT] = directory / TEMPLATE_FILE
    if (directory / TEMPLATE_DIR).is_dir():
        files.update({f.name.removesuffix(".jinja"): f for f in sorted((directory / TEMPLATE_DIR).glob("*.jinja"))})
    if files:
        try:
            return {name: f.read_text(encoding="utf-8") for name, f in files.items()}
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{directory}: cannot read a chat template: {exc}") from exc
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {DEFAULT: entry}
    if isinstance(entry, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in entry):
        return {t["name"]: t["template"] for t in entry}
    raise TokenizerError(f"{directory}: tokenizer_config.json chat_template must be a string or a list of "
                         f"{{'name', 'template'}} objects, got {type(entry).__name__}")


def special_token_variables(config: Mapping) -> dict[str, str]:
    """The special tokens a template sees, from a parsed ``tokenizer_config.json``: the named ones
    (`SPECIAL_TOKEN_NAMES`; a string or an AddedToken object's ``content``) and any other
    ``*_token`` key with a string value (transformers 5's model-specific tokens, e.g.
    ``image_token``), as its ``special_tokens_map`` gives them."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and key in SPECIAL_TOKEN_NAMES:
            value = value.get("content")
        if isinstance(value, str) and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
            out[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        out.update({k: v for k, v in extra.items() if isinstance(v, str)})
    return out


class ChatTemplate:
    """A model's chat templates by name, compiled once.

    Raises `TokenizerError` when built if a template does not parse."""

    def __init__(self, templates: Mapping[str, str], variables: Mapping[str, str] | None = None):
        if not templates:
            raise ValueError("ChatTemplate needs at least one template")
        self.templates = dict(templates)
        self.variables = dict(variables or {})
        for name, source in self.templates.items():
            try:
                _compile(source)
            except Exception as exc:
                raise TokenizerError(f"chat template {name!r} does not parse: {exc}") from exc

    def select(self, tools: Sequence | None = None) -> str:
        """The source of the template that renders: "tool_use" when ``tools`` is not None and
        the model has one, else "default". Raises `ChatTemplateError` when neither exists."""
        if tools is not None and TOOL_USE in self.templates:
            return self.templates[TOOL_USE]
        if DEFAULT in self.templates:
            return self.templates[DEFAULT]
        raise ChatTemplateError(f"this model has several chat templates and none named 'default' "
                                f"({sorted(self.templates)})")

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False,
               tools: Sequence[Mapping] | None = None, documents: Sequence[Mapping] | None = None,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text; see the module docstring for what the template sees. ``kwargs`` are
        extra template variables (e.g. ``enable_thinking``). ``continue_final_message``: the text
        ends inside the last message (not with ``add_generation_prompt``). Raises
        `ChatTemplateError` (also for both flags set, or a last message the template drops)."""
        source = self.select(tools)
        messages = [_normalized(m) for m in messages]
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be set")
            messages = _tagged_final(messages, source)
        try:
            text = _compile(source).render(messages=messages, tools=None if tools is None else list(tools),
                                           documents=None if documents is None else list(documents),
                                           add_generation_prompt=add_generation_prompt, **{**self.variables, **kwargs})
        except ChatTemplateError:
            raise
        except Exception as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc
        return _cut_at_tag(text) if continue_final_message else text


def _normalized(message: Mapping) -> dict:
    """transformers' ``_normalize_chat_messages`` + ``_alias_reasoning_fields``: no None values;
    a message's reasoning also under ``thinking`` and ``reasoning_content``."""
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _tagged_final(messages: list[dict], source: str) -> list[dict]:
    """transformers' ``render_jinja_template`` for ``continue_final_message``: the last message's
    content (its last text part) with `_CONTINUE_TAG` appended; a new list."""
    if not messages:
        raise ChatTemplateError("continue_final_message is set but there are no messages")
    last = dict(messages[-1])
    content = last.get("content")
    if content is None:
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue')
    if "content" not in source:
        raise ChatTemplateError('continue_final_message is set but the chat template does not read "content"')
    if isinstance(content, (list, tuple)):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in content]
        texts = [i for i, p in enumerate(parts) if isinstance(p, dict) and "text" in p]
        if not texts:
            raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
        parts[texts[-1]]["text"] = parts[texts[-1]]["text"] + _CONTINUE_TAG
        last["content"] = parts
    else:
        last["content"] = content + _CONTINUE_TAG
    return [*messages[:-1], last]


def _cut_at_tag(text: str) -> str:
    """The rendered text up to the continue tag (stripped on the right when the template
    trimmed the tag's trailing space, as transformers does)."""
    tag = _CONTINUE_TAG.strip()
    if tag not in text:
        raise ChatTemplateError("continue_final_message is set but the chat template drops the final message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):   # Jinja's signature: namespace(self=...) stays valid
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=Namespace)
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    return _environment().from_string(source)
