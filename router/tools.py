"""Tool calls (OpenAI ``tools`` / ``tool_choice``): prompt rendering, the constraint, parsing.

Format on the model side: each call is a JSON object ``{"name": ..., "arguments": {...}}``
between ``<tool_call>`` and ``</tool_call>`` lines (the Hermes / Qwen convention many
instruction-tuned models were trained on).

- Rendering: when the model's chat template handles tools (it mentions ``tools``), the tools go
  to the template as ``tools``; otherwise (SmolLM2's template has no tool section) they are
  described in the system message, with the call format above; a ``system`` message the client
  sent is kept, the description appended to it. Earlier assistant ``tool_calls`` are rendered in
  the same format and ``tool`` messages keep their role.
- ``tool_choice``: ``none`` (tools not offered), ``auto`` (the default: the model decides, the
  output is parsed), ``required`` (one or more calls, enforced by a grammar whose JSON follows
  the called function's ``parameters`` schema), or ``{"type": "function", "function": {"name"}}``
  (exactly one call of that function, enforced the same way).
- Response: ``message.tool_calls`` (``id``, ``type: function``, ``function: {name,
  arguments}`` with arguments as a JSON string), ``content`` the text outside the calls (None
  when there is none), ``finish_reason: tool_calls``. Output that does not parse as calls is
  returned as content (``auto`` only: the forced modes always parse).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from router.errors import InvalidRequest
from router.structured import JSON_LAYOUT, strict_objects

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools do: ``offered`` (described to the model), ``grammar`` (the forced
    modes' constraint, "" for auto), ``names`` (the callable functions)."""

    offered: tuple[dict, ...]
    grammar: str
    names: tuple[str, ...]


def plan_tools(tools: Any, tool_choice: Any) -> ToolPlan | None:
    """Check ``tools`` / ``tool_choice`` and build the plan; None when no tool is in play.

    Raises:
        InvalidRequest: malformed tools, a duplicate or invalid name, an unknown choice.
    """
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("tools must be a non-empty list", param="tools")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': "
                                 "[a-zA-Z0-9_-]{1,64}, 'parameters': a JSON schema}}}", param=f"tools.{i}")
        params = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object",
                                 param=f"tools.{i}.function.parameters")
        functions.append({"name": fn["name"], "description": fn.get("description", ""), "parameters": params})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tool names must be distinct", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan(tuple(functions), "", tuple(names))
    if choice == "required":
        return ToolPlan(tuple(functions), _calls_grammar(functions, one=False), tuple(names))
    named = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or named not in names:
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                             "'function': {'name': <one of the tools>}}", param="tool_choice")
    chosen = [f for f in functions if f["name"] == named]
    return ToolPlan(tuple(functions), _calls_grammar(chosen, one=True), (named,))


def _calls_grammar(functions: list[dict], one: bool) -> str:
    """Lark (llguidance) grammar of one call, or of one or more, of ``functions``."""
    import llguidance

    variants = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": strict_objects(f["parameters"])},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    call = '"<tool_call>\\n" call "\\n</tool_call>"'
    start = f"start: {call}" if one else f'start: {call} ("\\n" {call})*'
    grammar = llguidance.LLMatcher.grammar_from_lark(f"{start}\ncall: %json {json.dumps(schema)}")
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise InvalidRequest(f"a tool's parameters schema is not usable: {problem.strip()}", param="tools")
    return grammar


def render_messages(messages: list[dict], raw_messages, plan: ToolPlan | None, template_has_tools: bool) -> list[dict]:
    """Messages for the chat template: earlier calls in the call format, and (templates without a
    tool section) the tools described in the system message."""
    out = []
    for m, raw in zip(messages, raw_messages):
        calls = raw.tool_calls
        if m["role"] == "assistant" and calls:
            rendered = []
            for c in calls:
                fn = c.get("function", {}) if isinstance(c, dict) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                rendered.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args})
                                + "\n</tool_call>")
            m = {**m, "content": "\n".join(filter(None, [m["content"], *rendered]))}
        out.append(m)
    if plan is None or template_has_tools:
        return out
    described = "\n".join(json.dumps({"type": "function", "function": f}) for f in plan.offered)
    text = ("You can call functions to help with the user's request. The available functions, one JSON "
            f"description per line, are between <tools> and </tools>:\n<tools>\n{described}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments between "
            "<tool_call> and </tool_call> lines, one block per call:\n<tool_call>\n"
            '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + text}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def parse_calls(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output; no calls when any block does not parse as a
    call of a known function (then the whole text is content)."""
    calls = []
    for block in _CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments", {}), dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}})
    if not calls:
        return text, []
    rest = _CALL.sub("", text).strip()
    return (rest or None), calls
