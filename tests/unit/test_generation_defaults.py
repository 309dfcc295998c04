"""``generation_config.json``: its eos ids stop generation, and its sampling values are the
defaults of a request that leaves them unset (vLLM's ``--generation-config auto``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.generation_config import GenerationDefaults, load_generation_config
from engine.tokenizer import Tokenizer
from router.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatRequest, CompletionRequest, default_max_tokens,
                             effective_temperature, with_model_defaults)

pytestmark = pytest.mark.unit
QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def _hf_dir(directory: Path, generation_config: dict | None) -> Path:
    from tokenizers import Tokenizer as HFTokenizer, models

    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "<|im_end|>", "<|endoftext|>", "<|eot|>"])}
    HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


def test_qwen3s_file_gives_its_stop_ids_and_sampling(tmp_path):
    defaults = load_generation_config(_hf_dir(tmp_path, QWEN3))
    assert defaults == GenerationDefaults(eos_token_ids=(151645, 151643), temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.sampling() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.mark.parametrize("eos, stops", [(4, {2, 4}), ([3, 4], {2, 3, 4}), (None, {2})])
def test_every_eos_token_id_is_a_stop_id(tmp_path, eos, stops):
    tk = Tokenizer.from_file(_hf_dir(tmp_path, {"eos_token_id": eos}))
    assert tk.eos_token_id == 2 and tk.stop_token_ids == frozenset(stops)


def test_an_eos_id_outside_the_vocabulary_fails_the_load(tmp_path):
    from engine.errors import TokenizerError

    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        Tokenizer.from_file(_hf_dir(tmp_path, {"eos_token_id": [2, 99]}))


def test_every_sampling_field_and_max_new_tokens_load(tmp_path):
    config = {"temperature": 0.7, "top_p": 0.8, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1,
              "max_new_tokens": 512, "do_sample": True}
    tk = Tokenizer.from_file(_hf_dir(tmp_path, config))
    assert tk.generation_defaults == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=40, min_p=0.05,
                                                        repetition_penalty=1.1, max_tokens=512)


def test_no_file_means_no_defaults(tmp_path):
    assert Tokenizer.from_file(_hf_dir(tmp_path, None)).generation_defaults == GenerationDefaults()


@pytest.mark.parametrize("config", [{"temperature": -1}, {"top_p": 0}, {"top_k": 2.5}, {"max_new_tokens": 0},
                                    {"repetition_penalty": "high"}, {"eos_token_id": "x"}, {"temperature": True}])
def test_invalid_values_fail_the_load(tmp_path, config):
    with pytest.raises(ModelLoadError):
        load_generation_config(_hf_dir(tmp_path, config))


def test_a_file_that_is_not_json_fails_the_load(tmp_path):
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_generation_config(tmp_path)


def test_the_models_defaults_fill_only_the_fields_a_request_leaves_unset():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.1, repetition_penalty=1.05)
    req = with_model_defaults(ChatRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5), defaults)
    assert (req.temperature, req.top_p, req.top_k, req.min_p, req.repetition_penalty) == (0.6, 0.5, 20, 0.1, 1.05)
    assert with_model_defaults(CompletionRequest(prompt="hi", min_p=0.0), defaults).min_p == 0.0   # set: wins
    assert effective_temperature(req) == 0.6
    greedy = with_model_defaults(CompletionRequest(prompt="hi", temperature=0, top_k=-1), defaults)
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0, -1, 0.95)
    plain = CompletionRequest(prompt="hi")
    assert with_model_defaults(plain, GenerationDefaults()) is plain
    assert effective_temperature(with_model_defaults(plain, GenerationDefaults())) == 1.0


def test_max_new_tokens_is_the_chat_default_within_the_room_left():
    defaults = GenerationDefaults(max_tokens=512)
    assert default_max_tokens(True, defaults, room=4000) == 512
    assert default_max_tokens(True, defaults, room=100) is None          # the rest of the context
    assert default_max_tokens(True, GenerationDefaults(), room=4000) is None
    assert default_max_tokens(False, defaults, room=4000) == DEFAULT_COMPLETION_MAX_TOKENS


def test_the_router_applies_the_defaults_and_a_template_refusal_is_a_400(tmp_path):
    from fastapi.testclient import TestClient

    from router.api import build_state, create_app
    from router.config import RouterConfig
    from router.errors import NoWorkers
    from router.membership import Membership

    directory = _hf_dir(tmp_path, {**QWEN3, "eos_token_id": 3, "max_new_tokens": 20, "min_p": 0.05})
    config = {"eos_token": "<|im_end|>", "chat_template": "{% if messages[0].role != 'user' %}"
              "{{ raise_exception('user first') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    state = build_state(RouterConfig(wait_for_workers_s=0.0), Tokenizer.from_file(directory), 64, Membership(), "m")
    seen = []

    def generate(req):
        seen.append(req)
        raise NoWorkers("none")
    state.orchestrator.generate = generate
    with TestClient(create_app(state)) as client:
        for body in ({}, {"temperature": 1.0, "top_k": 0, "max_tokens": 5, "min_p": 0.3}, {"min_p": 0}):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a a"}], **body})
            assert r.status_code == 503, r.text
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "a"}]})
        assert r.status_code == 400 and "user first" in r.json()["error"]["message"], r.text
    default, explicit, no_min_p = seen
    assert (default.temperature, default.top_p, default.top_k, default.min_p, default.max_tokens) == (0.6, 0.95, 20, 0.05, 20)
    assert (explicit.temperature, explicit.top_p, explicit.top_k, explicit.min_p, explicit.max_tokens) == (1.0, 0.95, 0, 0.3, 5)
    assert no_min_p.min_p == 0.0
    from router.request import Choice

    wire = state.orchestrator._sampling([Choice(default, None, frozenset())], 20)
    assert abs(wire.min_p - 0.05) < 1e-6   # the SamplingParams message the workers receive
    assert state.tokenizer.stop_token_ids == frozenset({2, 3})
