"""pdserve renders a Hugging Face directory's chat templates exactly as transformers 5 does.

Each family's template (tests/data/chat_templates/: modelled on the public Llama 3.1, Qwen2.5,
Qwen3, Mistral, Phi-3 and Gemma 3 templates) is saved with a tiny word-level tokenizer by
transformers' own ``save_pretrained``, once inside ``tokenizer_config.json`` and once as
``chat_template.jinja``; pdserve's `Tokenizer.from_file` and transformers' ``AutoTokenizer`` load the
same directory and must render the same text (``apply_chat_template(..., tokenize=False)``).
Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.chat_template import ChatTemplate, load_hf_templates, special_token_variables
from engine.errors import ChatTemplateError, InvalidRequestError, TokenizerError
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.unit
transformers = pytest.importorskip("transformers")

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
SPECIALS = {  # family -> (bos, eos, the template's other special tokens)
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>"]),
    "qwen2_5": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>"]),
    "mistral": ("<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]),
    "phi3": ("<s>", "<|endoftext|>", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
    "gemma3": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]),
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now in a city (°C, «quoted»)",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CALL = {"id": "call12345", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}
SYSTEM = {"role": "system", "content": "You are terse.\n"}


def _chat(family: str) -> list[dict]:
    """System, several turns, an assistant tool call, its result, and a last user turn (Qwen3: an
    assistant turn with reasoning), shaped to what each family's template accepts; None values
    as OpenAI clients send them."""
    turns = [{"role": "user", "content": "  Hi there!  "}, {"role": "assistant", "content": "Hello. How can I help?", "tool_calls": None},
             {"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 21}'},
             {"role": "assistant", "content": "It is 21 °C."}, {"role": "user", "content": "Thanks; and tomorrow?"}]
    if family == "qwen3":
        turns[5] = {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nIt is 21 °C."}
        turns.append({"role": "assistant", "content": "Checking.", "reasoning": "call again"})  # aliased
    if family in ("gemma3", "phi3"):   # no tool roles in these templates
        turns = turns[:3] + [{"role": "assistant", "content": [{"type": "text", "text": "Sunny. "}]}
                             if family == "gemma3" else {"role": "assistant", "content": "Sunny."},
                             turns[-1]]
    return [SYSTEM, *turns]


def _backend(bos: str | None, eos: str, specials: list[str]):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    words = ["[UNK]", "hello", "world", *[t for t in (bos, eos) if t], *specials]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([t for t in (bos, eos, *specials) if t])
    return backend


def save_model(directory: Path, template, family: str = "qwen2_5", jinja_files: bool = True) -> Path:
    """A tokenizer directory written by transformers' ``save_pretrained``; ``template`` a string or a
    dict of named templates, kept in tokenizer_config.json unless ``jinja_files``."""
    bos, eos, specials = SPECIALS[family]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=_backend(bos, eos, specials),
                                              bos_token=bos, eos_token=eos, unk_token="[UNK]")
    hf.chat_template = template
    hf.save_pretrained(str(directory), save_jinja_files=jinja_files)
    return directory


def _both(directory: Path):
    return Tokenizer.from_file(directory), transformers.AutoTokenizer.from_pretrained(str(directory))


def _assert_same(ours: Tokenizer, theirs, messages, tools=None, **kwargs):
    for prompt in (True, False):
        want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=prompt, tokenize=False, **kwargs)
        got = ours.apply_chat_template(messages, prompt, tools, **kwargs)
        assert got == want, f"add_generation_prompt={prompt}"


@pytest.fixture(scope="module", params=[True, False], ids=["chat_template.jinja", "tokenizer_config.json"])
def saved(request, tmp_path_factory):
    """family -> (pdserve Tokenizer, transformers tokenizer), both loaded from one directory."""
    out = {}
    for family in SPECIALS:
        source = (TEMPLATES / f"{family}.jinja").read_text()
        directory = save_model(tmp_path_factory.mktemp(family), source, family, jinja_files=request.param)
        assert (directory / "chat_template.jinja").exists() == request.param
        out[family] = _both(directory)
    return out


@pytest.mark.parametrize("family", sorted(SPECIALS))
def test_each_family_renders_as_transformers_with_tools(saved, family):
    ours, theirs = saved[family]
    _assert_same(ours, theirs, _chat(family), TOOLS)


@pytest.mark.parametrize("family", sorted(SPECIALS))
def test_each_family_renders_as_transformers_without_tools(saved, family):
    ours, theirs = saved[family]
    _assert_same(ours, theirs, _chat(family))
    _assert_same(ours, theirs, [{"role": "user", "content": "hello world"}])


def test_extra_variables_reach_the_template_as_in_transformers(saved):
    ours, theirs = saved["qwen3"]
    _assert_same(ours, theirs, _chat("qwen3"), enable_thinking=False)
    assert "<think>\n\n</think>" in ours.apply_chat_template(_chat("qwen3"), True, enable_thinking=False)
    llama, hf_llama = saved["llama3_1"]
    _assert_same(llama, hf_llama, _chat("llama3_1"), TOOLS, date_string="01 Jan 2025", tools_in_user_message=False)
    mistral, hf_mistral = saved["mistral"]
    _assert_same(mistral, hf_mistral, _chat("mistral"), bos_token="<BOS>")   # a variable wins over a special token
    assert mistral.apply_chat_template(_chat("mistral"), bos_token="<BOS>").startswith("<BOS>[INST]")


def test_llama_reads_today_from_strftime_now(saved):
    from datetime import datetime

    ours, _ = saved["llama3_1"]
    before = datetime.now().strftime("%d %b %Y")
    text = ours.apply_chat_template(_chat("llama3_1"))
    assert f"Today Date: {before}\n" in text or f"Today Date: {datetime.now():%d %b %Y}\n" in text


def test_special_tokens_of_the_config_are_template_variables(saved):
    ours, theirs = saved["mistral"]
    assert ours.template_variables == theirs.special_tokens_map
    assert ours.apply_chat_template([{"role": "user", "content": "hello"}]).startswith("<s>[INST] hello")


def test_a_template_refusing_the_messages_is_a_typed_error(saved):
    ours, theirs = saved["mistral"]
    wrong = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        theirs.apply_chat_template(wrong, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate") as caught:
        ours.apply_chat_template(wrong)
    assert isinstance(caught.value, InvalidRequestError)   # the router's 400


def test_a_template_failing_on_the_messages_is_a_typed_error(tmp_path):
    ours = Tokenizer.from_file(save_model(tmp_path, "{{ messages[0].content + 3 }}"))
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_template_that_does_not_parse_fails_the_load(tmp_path):
    with pytest.raises(TokenizerError, match="does not parse"):
        Tokenizer.from_file(save_model(tmp_path, "{% for m in messages %}{{ m.content }}"))


def test_the_sandbox_refuses_unsafe_access(tmp_path):
    ours = Tokenizer.from_file(save_model(tmp_path, "{{ messages.__class__.__mro__ }}{% set ns = namespace() %}"))
    with pytest.raises(ChatTemplateError):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    bad_namespace = ChatTemplate({"default": "{% set ns = namespace(_x=1) %}"})
    with pytest.raises(ChatTemplateError, match="may not start with '_'"):
        bad_namespace.render([{"role": "user", "content": "hi"}])


def test_a_model_without_a_template_refuses_chat(tmp_path):
    ours = Tokenizer.from_file(save_model(tmp_path, None))
    assert ours.chat_template is None and not ours.template_has_tools
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


NAMED = {"default": "{% for m in messages %}D:{{ m.content }}{% endfor %}",
         "tool_use": "{% for m in messages %}T:{{ m.content }}{% endfor %}{{ tools | tojson }}",
         "rag": "R"}


@pytest.mark.parametrize("jinja_files", [True, False], ids=["additional_chat_templates", "tokenizer_config.json"])
def test_named_templates_select_as_transformers_selects(tmp_path, jinja_files):
    directory = save_model(tmp_path, NAMED, jinja_files=jinja_files)
    assert (directory / "additional_chat_templates" / "tool_use.jinja").exists() == jinja_files
    ours, theirs = _both(directory)
    assert ours.chat_template == theirs.chat_template == NAMED
    hi = [{"role": "user", "content": "hi"}]
    for tools in (None, [], TOOLS):
        _assert_same(ours, theirs, hi, tools)
    assert ours.apply_chat_template(hi) == "D:hi" and ours.apply_chat_template(hi, tools=[]).startswith("T:hi")
    assert ours.template_has_tools


def test_named_templates_without_a_default_need_tools(tmp_path):
    ours, theirs = _both(save_model(tmp_path, {"tool_use": NAMED["tool_use"], "rag": "R"}))
    hi = [{"role": "user", "content": "hi"}]
    _assert_same(ours, theirs, hi, TOOLS)
    with pytest.raises(ValueError, match="no default"):
        theirs.apply_chat_template(hi, tokenize=False)
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        ours.apply_chat_template(hi)


def test_template_files_win_over_the_config_entry(tmp_path):
    directory = save_model(tmp_path, "FILE{{ messages[0].content }}")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "CONFIG"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = _both(directory)
    _assert_same(ours, theirs, [{"role": "user", "content": "hi"}])
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "FILEhi"


def test_a_malformed_config_entry_is_a_load_error(tmp_path):
    with pytest.raises(TokenizerError, match="chat_template must be"):
        load_hf_templates(tmp_path, {"chat_template": [{"name": "default"}]})
    assert load_hf_templates(tmp_path, {}) == {}


def test_special_token_variables_read_strings_and_added_token_objects():
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": "</s>", "pad_token": None,
              "image_token": "<img>", "model_max_length": 8, "extra_special_tokens": {"audio_token": "<aud>"}}
    assert special_token_variables(config) == {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<img>",
                                               "audio_token": "<aud>"}


@pytest.mark.parametrize("family", sorted(SPECIALS))
def test_continue_final_message_renders_as_transformers(saved, family):
    """The prompt ends inside the last message (its trailing space trimmed or kept as the
    template does), as transformers' ``continue_final_message`` renders it."""
    ours, theirs = saved[family]
    chat = _chat(family)
    if chat[-1]["role"] != "assistant":
        chat.append({"role": "assistant", "content": "The answer is "})
    chats = [chat]
    if family == "gemma3":   # list content: the last text part is continued
        chats.append([{"role": "user", "content": "hello"}, {"role": "assistant", "content": [
            {"type": "text", "text": "Sure. "}, {"type": "text", "text": "It is"}]}])
    for messages in chats:
        want = theirs.apply_chat_template(messages, continue_final_message=True, tokenize=False)
        assert ours.apply_chat_template(messages, False, continue_final_message=True) == want
    with pytest.raises(ChatTemplateError, match="cannot both"):
        ours.apply_chat_template(chat, True, continue_final_message=True)


def test_continue_final_message_needs_a_template_that_renders_it():
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="does not read"):
        ChatTemplate({"default": "{% for m in messages %}{{ m.role }}{% endfor %}"}).render(
            hi, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="drops the final message"):
        ChatTemplate({"default": "{% for m in messages[:-1] %}{{ m.content }}{% endfor %}"}).render(
            hi, continue_final_message=True)


def test_the_router_renders_chat_with_the_requests_template_fields(saved, monkeypatch):
    """Chat completions and /tokenize over HTTP: chat_template_kwargs reach the template (Qwen3's
    enable_thinking false gives the empty think block), continue_final_message ends the prompt
    inside the last message; each prompt equals transformers' rendering."""
    from fastapi.testclient import TestClient

    from router.api import build_state, create_app
    from router.config import RouterConfig
    from router.errors import NoWorkers
    from router.membership import Membership

    ours, theirs = saved["qwen3"]
    rendered, real = [], ours.apply_chat_template
    monkeypatch.setattr(ours, "apply_chat_template", lambda *a, **k: rendered.append(real(*a, **k)) or rendered[-1])
    state = build_state(RouterConfig(wait_for_workers_s=0.0), ours, 4096, Membership(), "m")
    prompts = []

    def generate(req):
        prompts.append(list(req.prompt_token_ids))
        raise NoWorkers("none")
    state.orchestrator.generate = generate
    hi = [{"role": "user", "content": "hello"}]
    partial = [*hi, {"role": "assistant", "content": "Sure: "}]
    no_thinking = {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}}
    with TestClient(create_app(state)) as client:
        assert client.post("/v1/chat/completions", json=no_thinking).status_code == 503
        r = client.post("/v1/chat/completions", json={"messages": partial, "add_generation_prompt": False,
                                                       "continue_final_message": True})
        assert r.status_code == 503, r.text
        r = client.post("/tokenize", json=no_thinking)
        assert r.status_code == 200 and r.json()["tokens"] == prompts[0], r.text
    want = theirs.apply_chat_template(hi, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert rendered[0] == rendered[2] == want and want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompts[0] == ours.encode(want)
    want = theirs.apply_chat_template(partial, continue_final_message=True, tokenize=False)
    assert rendered[1] == want and want.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nSure: ")
