"""Structured outputs end to end, disaggregated (the first token constrained on the prefill worker,
the rest on the decode worker) and colocated: 50 prompts with a JSON schema give 50 outputs that
validate (jsonschema), greedy and sampled in one batch; regex, choice, grammar and json_object
forms through the official openai client, streamed and not; requests without a constraint in the
same batch are untouched (greedy output equals the engine's)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.e2e.conftest import assert_pools_full, openai_client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

MODEL = "SmolLM2-135M-Instruct"
# Shared clusters (tests/e2e/conftest.py SHARED), under this module's test ids.
TOPOLOGIES = [pytest.param("1p1d-auto", id="disaggregated-1p1d"), pytest.param("0p1d-colocated", id="colocated-0p1d")]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 24},
        "role": {"enum": ["student", "engineer", "artist", "doctor", "other"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "role", "hobbies"],
    "additionalProperties": False,
}
SUBJECTS = ["a baker", "a pilot", "a chemistry student", "a retired teacher", "a painter", "a nurse",
            "a software engineer", "a farmer", "a violinist", "a marathon runner"]
STYLES = ["from Paris", "who loves chess", "in their twenties", "from a small village", "who travels a lot"]
PROMPTS = [f"Describe {s} {t} as a JSON object." for s in SUBJECTS for t in STYLES]   # 50


@pytest.fixture(scope="module", params=TOPOLOGIES)
def cluster(request, shared_clusters):
    return shared_clusters.get(request.param)


def _person(client, prompt: str, sampled: bool, i: int) -> str:
    extra = dict(temperature=0.8, top_p=0.95, seed=i) if sampled else dict(temperature=0)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        **extra)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    return r.choices[0].message.content


def test_fifty_prompts_with_a_json_schema_all_validate(cluster):
    """Every other prompt sampled (its own seed), the rest greedy, in one batch: both kinds of
    constrained step, and both beside each other, on each topology."""
    client = openai_client(cluster)
    with ThreadPoolExecutor(16, thread_name_prefix="structured-client") as pool:
        outputs = list(pool.map(lambda a: _person(client, a[1], a[0] % 2 == 1, a[0]), enumerate(PROMPTS)))
    for text in outputs:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(outputs)) > 10   # the prompts shaped the content, not just the format
    assert_pools_full(cluster)


def test_forms_streamed_and_not(cluster, reference, tokenizer):
    client = openai_client(cluster)
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    stream = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
    date = client.completions.create(model=MODEL, prompt="The first moon landing happened on", max_tokens=20,
                                     temperature=0, extra_body={"guided_regex": r" \d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", date.choices[0].text)
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/'
    r = client.completions.create(model=MODEL, prompt="What is 12 + 30?", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": lark})
    assert re.fullmatch(r"The answer is [0-9]+\.", r.choices[0].text)
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    r = client.completions.create(model=MODEL, prompt="Pick a color.", max_tokens=10, temperature=0,
                                  extra_body={"guided_grammar": gbnf})
    assert r.choices[0].text in ("color: red", "color: green", "color: blue")
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        max_tokens=80, temperature=0, stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    # Batch-mates without a constraint are untouched.
    prompt = "The capital of France is"
    with ThreadPoolExecutor(4, thread_name_prefix="structured-mix") as pool:
        plain = pool.submit(client.completions.create, model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        pool.submit(_person, client, PROMPTS[0], False, 0).result()
        assert plain.result().choices[0].text == reference(tokenizer.encode(prompt), 24).text
    assert_pools_full(cluster)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls, names) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_calls_named_required_none_and_a_second_turn(cluster):
    client = openai_client(cluster)
    ask = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
    named = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather"})
    # required, streamed: the calls arrive as tool_calls deltas
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=120,
                                                temperature=0, tool_choice="required", stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                calls[tc.index] = tc
    assert finish == "tool_calls"
    _check_calls(list(calls.values()), set(SCHEMAS))
    # none: tools are not offered, a plain answer
    plain = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="none",
                                           max_tokens=20, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    # auto: whatever the model picks is consistent
    auto = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=80, temperature=0)
    if auto.choices[0].message.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        _check_calls(auto.choices[0].message.tool_calls, set(SCHEMAS))
    else:
        assert auto.choices[0].message.content
    # the second turn: the call and its result go back, the model answers
    call = choice.message.tool_calls[0]
    turn2 = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=turn2, tools=TOOLS, tool_choice="none",
                                            max_tokens=30, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert_pools_full(cluster)


def test_bad_tools_and_constraints_get_400(cluster):
    import httpx

    ask = [{"role": "user", "content": "hi"}]
    bad = [
        ("/v1/chat/completions", {"messages": ask, "tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools.0"),
        ("/v1/chat/completions", {"messages": ask, "tools": TOOLS,
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ("/v1/chat/completions", {"messages": ask, "tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"messages": ask, "tools": TOOLS, "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "tool_choice"),
        ("/v1/completions", {"prompt": "hi", "tools": TOOLS}, "tools"),
        ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "bogus"}}, "guided_json"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ]
    with httpx.Client(timeout=30) as http:
        for path, body, param in bad:
            r = http.post(cluster.url + path, json={"model": MODEL, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())
