"""lm-evaluation-harness against the router (its ``local-completions`` model, remote tokenizer
through /tokenizer_info, /tokenize, /detokenize) and against Hugging Face transformers on the
same GGUF weights (``--model hf``), in the same run, on two local tasks (no hub access): a
loglikelihood multiple-choice task (echo + logprobs: the prompt logprobs come from the prefill
worker) and a generate_until task (greedy, stop at a newline). Transformers reads its own
conversion of the GGUF file, kept per machine (`tests.hf_reference`). Scores must be equal, every
per-choice loglikelihood within 1e-3 of transformers', and every generation the same text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import assert_pools_full

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = "SmolLM2-135M-Instruct"
DATA = Path(__file__).resolve().parent.parent / "data" / "lm_eval"

TASKS = {
    "pdserve_choices": f"""task: pdserve_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / 'choices.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""",
    "pdserve_questions": f"""task: pdserve_questions
dataset_path: json
dataset_kwargs:
  data_files:
    test: {DATA / 'questions.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module", params=["1p1d-auto"])
def cluster(request, shared_clusters):
    """1P1D over shm, shared with the other modules (tests/e2e/conftest.py SHARED)."""
    return shared_clusters.get(request.param)


def _start_lm_eval(tmp: Path, name: str, model: str, model_args: str) -> tuple[subprocess.Popen, Path]:
    """Start one ``lm_eval`` run (its output under ``tmp / name``); :func:`_lm_eval_results` reads it."""
    tasks = tmp / "tasks"
    tasks.mkdir(exist_ok=True)
    for task, yaml in TASKS.items():
        (tasks / f"{task}.yaml").write_text(yaml)
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp / f"datasets-cache-{name}"), "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    with open(out / "lm_eval.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args,
             "--tasks", ",".join(TASKS), "--include_path", str(tasks), "--batch_size", "1",
             "--output_path", str(out), "--log_samples", "--seed", "1234", "--device", "cpu"],
            env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, out


def _lm_eval_results(proc: subprocess.Popen, out: Path) -> tuple[dict, dict, dict]:
    """(results by task, loglikelihoods by (doc, choice), generations by doc) of one ``lm_eval``
    run, once it exits (killed after 1500 s)."""
    try:
        proc.wait(1500)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (out / "lm_eval.log").read_text()[-9000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    lls, texts = {}, {}
    for f in out.rglob("samples_pdserve_choices_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            for i, resp in enumerate(s["resps"]):
                lls[(s["doc_id"], i)] = float(resp[0][0])
    for f in out.rglob("samples_pdserve_questions_*.jsonl"):
        for line in f.read_text().splitlines():
            s = json.loads(line)
            texts[s["doc_id"]] = s["resps"][0][0]
    return results, lls, texts


def test_scores_equal_transformers(cluster, tmp_path):
    from tests.hf_reference import reference_dir

    hf_dir = reference_dir()   # transformers' own conversion of the GGUF file, kept per machine
    # both runs at once: the router's client mostly waits on the cluster, transformers computes
    runs = [_start_lm_eval(tmp_path, "pdserve", "local-completions",
                           f"base_url={cluster.url}/v1/completions,model={MODEL},num_concurrent=1,"
                           "max_retries=1,tokenized_requests=True,tokenizer_backend=remote"),
            _start_lm_eval(tmp_path, "hf", "hf", f"pretrained={hf_dir},dtype=float32")]
    try:
        ours, our_lls, our_texts = _lm_eval_results(*runs[0])
        theirs, their_lls, their_texts = _lm_eval_results(*runs[1])
    finally:
        for proc, _ in runs:
            proc.kill()
            proc.wait()
    print("\nlm-eval pdserve:", {t: r for t, r in ours.items()})
    print("lm-eval transformers:", {t: r for t, r in theirs.items()})
    assert ours["pdserve_choices"]["acc,none"] == theirs["pdserve_choices"]["acc,none"]
    assert ours["pdserve_questions"]["exact_match,none"] == theirs["pdserve_questions"]["exact_match,none"]
    assert ours["pdserve_choices"]["acc,none"] > 0.5   # the task measures something
    assert set(our_lls) == set(their_lls) and len(our_lls) == 60
    worst = max(abs(our_lls[k] - their_lls[k]) for k in our_lls)
    print(f"largest loglikelihood difference: {worst:.2e}")
    assert worst < 1e-3
    assert len(our_texts) == 16 and our_texts == their_texts   # greedy generations, token for token
    assert_pools_full(cluster)
