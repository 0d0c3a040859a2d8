"""MoE under tensor + sequence parallelism trains like the single process, through the launcher's steps on CPU/gloo
(test_parallel.run_all: the 2-rank and the 4-rank layouts each on one set of ranks).

qwen3_moe_tiny with one dense MLP layer (mlp_only_layers) and one MoE layer runs 5 steps under `tp2` (2 ranks:
experts FSDP-sharded over the tp pair), `tp2_ep2` (4 ranks, dp2 x tp2: experts split over each tp pair,
FSDP across dp) and `tp2_pp2` (4 ranks: the MoE layer on the second stage, its statistics carried by the
pipeline). Losses must agree with the single process within 1e-5 (relative), parameters after step 5 within
1e-4; the tp2_ep2 checkpoint then resumes in one process with the single run's step-6 loss.

The optimizer is SGD, not AdamW: AdamW's update lr * m / (sqrt(v) + eps) turns a rounding-level difference in a
gradient element near zero (|g| ~ eps = 1e-8) into a change of up to lr/2 -- on this data one embedding element
of 524k ends 7e-4 apart under AdamW (dense TP shows the same effect, 3e-5 on random data), while every
gradient agrees to ~5e-7 relative. SGD moves each weight by lr * gradient, so a wrong gradient (e.g. a missing
sum over the tp ranks) shows directly, and rounding does not get amplified.
"""

import json

import pytest
from test_parallel import assert_matches, losses, run_all

pytestmark = pytest.mark.distributed

MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.moe_intermediate_size=32", "model.intermediate_size=96",
       "model.num_hidden_layers=2", "model.head_dim=16", "model.mlp_only_layers=[0]"]
# tp2 runs on to step 6 and prints the end-of-run samples (greedy decoding on the training model: sequence
# shards of one token, so one rank routes no tokens at a decode step); the single run prints them too.
SAMPLES = ["generate.num_samples=2", "generate.max_new_tokens=6"]
LAYOUTS = {"tp2": ["parallel=tp2", "checkpoint.every=5", *SAMPLES],
           "tp2_ep2": ["parallel=tp2_ep2", "train.stop_after=5"],
           "tp2_pp2": ["parallel=tp2_pp2", "train.stop_after=5"]}  # 1F1B; stage 0 the dense layer
SGD = ["optim=sgd"]  # test_parallel.RUN sets a constant schedule


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_here, launch_ranks):
    """The single process (6 steps), the layouts, then the tp2_ep2 checkpoint resumed in one process (step 6)."""
    root = tmp_path_factory.mktemp("moe_tp")
    jobs = {root / "single": [*MOE, *SGD, "parallel=single", "checkpoint.every=5", *SAMPLES]}
    jobs.update({root / name: [*MOE, *SGD, *parallel] for name, parallel in LAYOUTS.items()})
    run_all(jobs, launch_here, launch_ranks)
    checkpoint = root / "tp2_ep2" / "checkpoints" / "step_00000005"
    run_all({root / "resumed": [*MOE, *SGD, "parallel=single", f"checkpoint.load={checkpoint}"]}, launch_here,
            launch_ranks)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_process(layout, runs):
    assert_matches(runs / layout, runs / "single", 6 if layout == "tp2" else 5)


def test_tp2_ep2_checkpoint_resumes_in_a_single_process(runs):
    (resumed,) = losses(runs / "resumed")  # step 6 only
    expected = losses(runs / "single")[5]
    assert abs(resumed - expected) <= 1e-5 * expected


def test_generate_tp2_on_a_moe_model_matches_transformers(save_tiny_hf, tmp_path, launch):
    """Inference under tp2 (no sequence parallel): attention split over the ranks, the MoE blocks whole on each."""
    from test_generate import PROMPTS, expected_rows, read_rows

    from speedllm.data.tokenizer import load_tokenizer

    hf = save_tiny_hf(tmp_path / "hf", seed=5, vocab_size=8192, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, mlp_only_layers=[0])
    tok = load_tokenizer(str(tmp_path / "hf"))
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    code, out, err = launch(tmp_path / "run", "hardware=cpu", "task=generate", "model=hf", "parallel=tp2",
                            f"checkpoint.load_hf={tmp_path / 'hf'}", f"generate.prompts_file={tmp_path}/prompts.jsonl",
                            "generate.max_new_tokens=8", "generate.batch_size=2",
                            f"generate.output={tmp_path}/tp2.jsonl", cwd=tmp_path)
    assert code == 0, err
    rows = [{k: r[k] for k in ("prompt", "completion_ids")} for r in read_rows(tmp_path / "tp2.jsonl")]
    assert rows == expected_rows(hf, tok, 8)


def test_tp2_samples_at_the_end_of_training_match_the_single_process(runs):
    def samples(run_dir):
        log = (run_dir / "launch.log").read_text()
        return log[log.index("samples (greedy):"):].strip()  # the last lines of the run

    assert samples(runs / "tp2") == samples(runs / "single")
    assert samples(runs / "single").count("--- ") == 2
