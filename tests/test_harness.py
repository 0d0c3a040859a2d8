"""lm-eval backend: on local task files (multiple choice, generate-until, rolling loglikelihood) our model scores
every sample as lm-eval's own HF backend (HFLM) does on the same HF directory, and task=evaluate writes the
same accuracy to eval.json."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from speedllm.data.tokenizer import load_tokenizer  # noqa: E402
from speedllm.generation.harness import SpeedLM  # noqa: E402
from speedllm.paths import ASSETS, ROOT  # noqa: E402

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
QUESTIONS = [("The king of Denmark is", ["Hamlet", "Lear", "Romeo", "Macbeth"], 0),
             ("Romeo loves", ["Juliet", "Ophelia", "Desdemona"], 0),
             ("A rose by any other name would smell as", ["sweet", "sour", "bitter", "foul"], 0),
             ("To be, or not to", ["be", "see", "flee"], 0),
             ("The lady doth protest too", ["much", "little", "loud"], 0),
             ("Now is the winter of our", ["discontent", "content", "summer"], 0)]
TASKS = {
    "tiny_mc": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "tiny_ppl": """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: "{{{{question}}}} {{{{choices[answer]}}}}."
doc_to_target: "{{{{question}}}} {{{{choices[answer]}}}}."
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, hf_pair):
    """A tiny random Qwen3 saved by transformers, our model with its weights, and the task files."""
    path = tmp_path_factory.mktemp("hf")
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, hf, ours = hf_pair(seed=9, vocab_size=len(tok), tie_word_embeddings=True)
    hf.save_pretrained(path)
    for f in DEMO_TOKENIZER.iterdir():
        shutil.copy(f, path)
    tasks = tmp_path_factory.mktemp("tasks")
    with open(tasks / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    for name, text in TASKS.items():
        (tasks / f"{name}.yaml").write_text(text.format(dir=tasks))
    return path, tasks, ours, tok


def evaluate(lm, tasks):
    return simple_evaluate(model=lm, tasks=list(TASKS),
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                           num_fewshot=1, log_samples=True, bootstrap_iters=0)


def test_scores_equal_lm_eval_hf_backend(setup):
    path, tasks, ours, tok = setup
    theirs = evaluate(HFLM(pretrained=str(path), backend="causal", device="cpu", batch_size=4,
                           dtype=torch.float32), tasks)
    mine = evaluate(SpeedLM(ours, tok, max_length=ours.cfg.max_position_embeddings, batch_size=4,
                            dtype=torch.float32), tasks)
    for task in TASKS:
        a, b = theirs["samples"][task], mine["samples"][task]
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and len(a) == len(QUESTIONS)
        for x, y in zip(a, b):
            if task == "tiny_gen":
                assert x["filtered_resps"] == y["filtered_resps"]
                continue
            got = [r[0] if isinstance(r, (list, tuple)) else r for r in y["resps"]]
            want = [r[0] if isinstance(r, (list, tuple)) else r for r in x["resps"]]
            lls = lambda rs: [v[0] if isinstance(v, (list, tuple)) else v for v in rs]  # noqa: E731
            assert lls(got) == pytest.approx(lls(want), abs=1e-4)
            if task == "tiny_mc":  # is_greedy flags too
                assert [r[1] for r in got] == [r[1] for r in want]
        for metric, value in theirs["results"][task].items():  # accuracies identical, perplexities close
            assert mine["results"][task][metric] == (pytest.approx(value, rel=1e-5) if task == "tiny_ppl" and
                                                     isinstance(value, float) else value), (task, metric)


@pytest.mark.slow
def test_evaluate_task_writes_lm_eval_results(setup, tmp_path):
    path, tasks, ours, tok = setup
    theirs = simple_evaluate(model=HFLM(pretrained=str(path), backend="causal", device="cpu", batch_size=4,
                                        dtype=torch.float32),
                             tasks=["tiny_mc"], limit=4,
                             task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
                             num_fewshot=0, bootstrap_iters=0)
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "task=evaluate", "model=hf", "hardware=cpu",
                           f"checkpoint.load_hf={path}", "evaluate.tasks=[tiny_mc]", f"evaluate.include_path={tasks}",
                           "evaluate.num_fewshot=0", "evaluate.limit=4", f"hydra.run.dir={tmp_path}/run"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "run" / "eval.json").read_text())["results"]
    assert results["tiny_mc"]["acc,none"] == theirs["results"]["tiny_mc"]["acc,none"]
    assert results["tiny_mc"]["acc_norm,none"] == theirs["results"]["tiny_mc"]["acc_norm,none"]
    assert "tiny_mc" in proc.stdout and "acc" in proc.stdout  # lm-eval's table
