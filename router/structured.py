"""Structured outputs: the request's constraint as one llguidance grammar string.

Accepted forms (one per request; two at once is a 400):

- OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- vLLM's ``guided_json`` (a schema, object or string), ``guided_regex``, ``guided_choice`` (a
  list of strings), ``guided_grammar`` (Lark, or GBNF when it contains ``::=``), and the newer
  ``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}``.

Objects of a schema that lists ``properties`` and says nothing of ``additionalProperties`` get
``additionalProperties: false`` (xgrammar's strict mode, vLLM's default; what OpenAI's strict
schemas require): otherwise a small model invents keys until it runs out of tokens. Say
``"additionalProperties": true`` to allow them.

JSON is generated in ``json.dumps``' default layout (``", "`` between items, ``": "`` after
keys, no other whitespace): the layout most JSON in training text has, and no room for a
whitespace loop. The grammar is validated here (an invalid schema, regex or grammar is a 400
naming the field); the workers compile and enforce it (`engine.grammar`).
"""

from __future__ import annotations

import json
from typing import Any

from router.errors import InvalidRequest

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 1024


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "not", "if", "then", "else", "additionalProperties", "contains")


def strict_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema that lists ``properties`` and does not say
    ``additionalProperties`` gets ``additionalProperties: false``."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_objects(s) for k, s in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_objects(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(schema: Any, param: str) -> str:
    """The grammar of JSON matching ``schema`` (a dict, or its JSON text). Raises `InvalidRequest`."""
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object", param=param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(strict_objects(schema), defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"{param}: {exc}", param=param) from exc


def _regex(regex: Any, param: str) -> str:
    import llguidance

    if not isinstance(regex, str) or not regex:
        raise InvalidRequest(f"{param} must be a non-empty string", param=param)
    return llguidance.LLMatcher.grammar_from_regex(regex)


def _choice(choices: Any, param: str) -> str:
    import llguidance

    if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequest(f"{param} must be a list of 1 to {MAX_CHOICES} non-empty strings", param=param)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _grammar(text: Any, param: str) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"{param} must be a non-empty grammar", param=param)
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:   # the converter raises plain exceptions on bad GBNF
            raise InvalidRequest(f"{param}: not a valid GBNF grammar: {exc}", param=param) from exc
    return llguidance.LLMatcher.grammar_from_lark(text)


def _response_format(fmt: Any) -> tuple[str, str] | None:
    """(param, grammar) of an OpenAI ``response_format``; None for text."""
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise InvalidRequest("response_format must be an object with a 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", json_schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidRequest("response_format.json_schema must be an object with a 'schema'",
                                 param="response_format.json_schema")
        param = "response_format.json_schema.schema"
        return param, json_schema_grammar(spec["schema"], param)
    raise InvalidRequest(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                         param="response_format")


_STRUCTURED = {"json": json_schema_grammar, "regex": _regex, "choice": _choice, "grammar": _grammar,
               "json_object": lambda value, param: json_schema_grammar({"type": "object"}, param)}


FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "structured_outputs")


def constrained(req) -> bool:
    """Whether the request names any structured output field (cheap; no compiling)."""
    return any(getattr(req, name, None) is not None for name in FIELDS)


def grammar_of(req) -> str:
    """The llguidance grammar of an API request's constraint ("" for none).

    Raises:
        InvalidRequest: a malformed or invalid constraint, or more than one form at once.
    """
    import llguidance

    found: list[tuple[str, str]] = []
    if req.response_format is not None:
        g = _response_format(req.response_format)
        if g is not None:
            found.append(g)
    for name, build in (("guided_json", json_schema_grammar), ("guided_regex", _regex),
                        ("guided_choice", _choice), ("guided_grammar", _grammar)):
        value = getattr(req, name)
        if value is not None:
            found.append((name, build(value, name)))
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        for key, value in so.items():
            if key in _STRUCTURED and value is not None and value is not False:
                found.append((f"structured_outputs.{key}", _STRUCTURED[key](value, f"structured_outputs.{key}")))
    if not found:
        return ""
    if len(found) > 1:
        raise InvalidRequest(f"give one structured output constraint, not {', '.join(n for n, _ in found)}",
                             param=found[1][0])
    param, grammar = found[0]
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        raise InvalidRequest(f"{param}: {problem.strip()}", param=param)
    return grammar
