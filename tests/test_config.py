"""Config composition, the validation rules (exact one-line messages, exit code 2) and Hydra's own rejections."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from speedllm.config import compose_config
from speedllm.config.resolve import resolve_layout
from speedllm.config.validate import check_world, validate
from speedllm.errors import UserError
from speedllm.hardware import load_profile
from speedllm.paths import ASSETS, CONF, ROOT

pytestmark = pytest.mark.unit

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml") if p.stem != "hf")  # hf: tests/test_hf.py
PARALLELS = sorted(p.stem for p in (CONF / "parallel").glob("*.yaml") if p.stem != "auto")
HARDWARE = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml") if p.stem != "auto")
TASKS = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))




@pytest.mark.parametrize("model", MODELS)
def test_every_model_parallel_pair_validates_or_fails_as_expected(model):
    for parallel in PARALLELS:
        cfg = compose_config(f"model={model}", f"parallel={parallel}", "hardware=cpu", "task=plan")
        with open_dict(cfg):
            world, nproc = resolve_layout(cfg)
            cfg.train.global_batch_size = cfg.parallel.dp * cfg.train.micro_batch_size
            cfg.train.seq_len = 256
        want = LAYOUT_ERRORS.get((model, parallel))
        if want is None:
            validate(cfg, world, nproc)
            check_world(cfg, world)
            assert world == cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
        else:
            with pytest.raises(UserError) as err:
                validate(cfg, world, nproc)
            assert str(err.value) == want, (model, parallel)


@pytest.mark.parametrize("hardware", HARDWARE)
def test_every_hardware_profile_composes_and_has_its_fields(hardware):
    cfg = compose_config(f"hardware={hardware}", "task=plan")
    profile = load_profile(hardware)
    assert cfg.hardware == profile
    assert profile.device in ("cpu", "cuda", "npu")
    assert profile.backend == {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[profile.device]
    assert profile.peak_tflops[profile.dtype] > 0 and profile.memory_gb > 0


def test_every_task_and_data_option_composes():
    for task in TASKS:
        assert compose_config(f"task={task}").task.name == task
    for data in DATA:
        assert compose_config(f"data={data}").data.name == data
    assert compose_config("task=sft").data.name == "sft_demo"
    assert compose_config("task=sft", "data=custom").data.name == "custom"


def test_model_sizes_match_the_reference_table():
    rows = {"qwen3_0.6b": (1024, 28, 16, 8, 3072, True), "qwen3_8b": (4096, 36, 32, 8, 12288, False),
            "qwen3_32b": (5120, 64, 64, 8, 25600, False), "qwen3_235b_a22b": (4096, 94, 64, 4, 12288, False)}
    for name, row in rows.items():
        m = compose_config(f"model={name}").model
        assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
                m.intermediate_size, m.tie_word_embeddings) == row
        assert m.vocab_size == 151936 and m.head_dim == 128 and m.rms_norm_eps == 1e-6


RULES = [
    (["optim.schedule=step", "task=doctor"], "optim.schedule=step is not one of constant, linear, cosine, wsd; pick one of them"),
    (["hardware=cpu", "hardware.ops=triton", "task=doctor"],
     "hardware.ops=triton is not one of reference, cpu, cuda, npu; pick one of them"),
    (["model=qwen3_0.6b", "parallel=tp2", "parallel.tp=3", "parallel.dp=1", "task=doctor"],
     "parallel.tp=3 does not divide num_attention_heads=16 of model qwen3_0.6b; use tp in {1, 2, 4, 8}"),
    (["model=qwen3_0.6b", "parallel=pp2", "parallel.pp=3", "task=doctor"],
     "model.num_hidden_layers=28 of model qwen3_0.6b cannot be split evenly over parallel.pp=3 x parallel.vpp=1 = 3 "
     "stages; use pp*vpp in {1, 2, 4, 7, 14, 28} or list the layers per stage in parallel.pp_layers"),
    (["model=qwen3_0.6b", "parallel=pp2", "parallel.pp_layers=[10,10]", "task=doctor"],
     "parallel.pp_layers=[10, 10] must list 2 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=28 of "
     "model qwen3_0.6b"),
    (["parallel=pp2", "parallel.vpp=2", "task=doctor"],
     "parallel.vpp=2 needs an interleaved schedule; set parallel.pp_schedule to one of Interleaved1F1B, "
     "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (or vpp=1)"),
    (["parallel=pp2_vpp2", "parallel.pp_schedule=DualPipeV", "train.global_batch_size=4", "task=doctor"],
     "parallel.pp_schedule=DualPipeV over 4 stages needs at least 4 micro-batches per step, but "
     "train.global_batch_size=4 / (train.micro_batch_size=4 x parallel.dp=1) gives 1; raise train.global_batch_size "
     "to 16, lower train.micro_batch_size, or set parallel.pp_microbatches=4"),
    (["model=qwen3_0.6b", "parallel=pp2", "parallel.vpp=7", "parallel.pp_schedule=DualPipeV", "task=doctor"],
     "parallel.pp_schedule=DualPipeV places two stages per rank in a V; set parallel.vpp=2"),
    (["parallel=pp2_vpp2", "parallel.pp_schedule=ZBVZeroBubble", "train.compile=true", "task=doctor"],
     "train.compile=true with parallel.pp_schedule=ZBVZeroBubble: torch splits this schedule's backward into input "
     "and weight gradients, which compiled layers cannot do; set train.compile=false or use "
     "parallel.pp_schedule=Interleaved1F1B (or 1F1B, GPipe)"),
    (["parallel.offload=disk", "task=doctor"], "parallel.offload=disk is not one of none, optimizer, params; pick one "
     "of them"),
    (["parallel=dp2", "parallel.fsdp=false", "parallel.offload=params", "task=doctor"],
     "parallel.offload=params offloads FSDP2's sharded parameters and optimizer states, but parallel.fsdp=false "
     "replicates them (DDP-like); set parallel.fsdp=true or parallel.offload=none"),
    (["parallel.offload=optimizer", "optim=adafactor", "task=doctor"],
     "parallel.offload=optimizer with optim=adafactor: torch's Adafactor cannot update FSDP2's DTensor parameters; "
     "use optim=adamw or optim=sgd, or parallel.offload=none"),
    (["train.activation_offload=true", "task=generate", "generate.prompt=hi"],
     "task=generate runs a trained model: parallel.offload=none and train.activation_offload=True are training "
     "levers; leave them at none / false"),
    (["parallel=ep2", "task=doctor"], "parallel.ep=2 needs a MoE model but qwen3_tiny is dense; set parallel.ep=1"),
    (["model=qwen3_moe_tiny", "parallel=ep2", "parallel.ep=3", "parallel.dp=3", "task=doctor"],
     "parallel.ep=3 does not divide num_experts=8 of model qwen3_moe_tiny; use ep in {1, 2, 4, 8}"),
    (["model=qwen3_moe_tiny", "parallel=ep2", "parallel.dp=2", "parallel.ep=4", "task=doctor"],
     "parallel.ep=4 must divide parallel.dp x parallel.cp x parallel.tp = 2 (experts are spread over the "
     "data/context/tensor ranks); raise dp or lower ep"),
    (["model=qwen3_5_tiny", "parallel=tp2", "parallel.cp=2", "launcher.nproc_per_node=4", "task=doctor"],
     "parallel.cp=2 with parallel.tp=2 is not supported for the hybrid model qwen3_5_tiny (Gated DeltaNet's state "
     "passes between cp ranks on whole activations, not tp's shards); use parallel.tp=1 with cp, or cp=1 with tp"),
    (["model=qwen3_5_tiny", "parallel=tp2", "parallel.tp=4", "parallel.dp=1", "model.num_attention_heads=8",
      "model.num_key_value_heads=4", "task=doctor"],
     "parallel.tp=4 does not divide linear_num_key_heads=2 of model qwen3_5_tiny; use tp in {1, 2}"),
    (["model=qwen3_moe_tiny", "parallel=tp2", "parallel.sequence_parallel=false", "task=doctor"],
     "parallel.tp=2 with MoE model qwen3_moe_tiny needs sequence parallel (each tp rank routes its own tokens); "
     "set parallel.sequence_parallel=true"),
    (["parallel=tp2", "launcher.nproc_per_node=3", "task=doctor"],
     "parallel dp=1 x cp=1 x tp=2 x pp=1 = 2 does not match the world size 3 (launcher.nnodes=1 x "
     "launcher.nproc_per_node=3); set parallel.dp=-1 to infer it or fix the launcher counts"),
    (["parallel=tp2", "parallel.dp=-1", "launcher.nproc_per_node=3", "task=doctor"],
     "world size 3 is not divisible by tp x pp x cp = 2; fix launcher.nproc_per_node / launcher.nnodes or the "
     "parallel degrees"),
    (["parallel=dp2", "train.global_batch_size=6", "train.micro_batch_size=2", "task=doctor"],
     "train.global_batch_size=6 is not divisible by train.micro_batch_size=2 x parallel.dp=2; use a multiple of 4"),
    (["train.seq_len=8192", "task=doctor"],
     "train.seq_len=8192 exceeds max_position_embeddings=4096 of model qwen3_tiny; lower train.seq_len, or "
     "extend the model with model.rope_scaling (e.g. yarn) and a larger model.max_position_embeddings"),
    (["parallel=cp2", "train.seq_len=66", "task=doctor"],
     "train.seq_len=66 must be divisible by 2 x parallel.cp = 4 (load-balanced causal chunks); pick a multiple of 4"),
    (["parallel=tp2", "train.seq_len=33", "task=doctor"],
     "train.seq_len=33 must be divisible by parallel.tp=2 with sequence parallel; pick a multiple of 2 or set "
     "parallel.sequence_parallel=false"),
    (["hardware=h100", "task=doctor"],
     "hardware=h100 needs 1 cuda device(s) per node but 0 found here; use hardware=cpu (or hardware=auto), or lower "
     "launcher.nproc_per_node"),
    (["hardware=npu_a2", "task=doctor"],
     "hardware=npu_a2 needs 1 npu device(s) per node but 0 found here; use hardware=cpu (or hardware=auto), or lower "
     "launcher.nproc_per_node"),
    (["train.recompute=some", "task=doctor"], "train.recompute=some is not one of none, selective, full; pick one of them"),
    (["checkpoint.load=/nonexistent/ckpt", "task=doctor"],
     "checkpoint.load=/nonexistent/ckpt does not exist; point it at a checkpoint directory (or use checkpoint.load=auto)"),
    (["checkpoint.load_hf=/nonexistent/hf", "task=doctor"],
     "checkpoint.load_hf=/nonexistent/hf does not exist; point it at a Hugging Face model directory"),
    (["data.path=/nonexistent/corpus", "task=pretrain"],
     "data.path=/nonexistent/corpus.bin does not exist; give the prefix of a .bin/.idx pair (e.g. made by "
     "task=preprocess)"),
    (["data.tokenizer=/nonexistent/tok", "task=pretrain"],
     "data.tokenizer=/nonexistent/tok does not exist; point it at a Hugging Face tokenizer directory"),
    (["task=preprocess"], "task=preprocess needs data.input=<file or glob> and data.output_prefix=<prefix>"),
    (["task=preprocess", "data.input=/nonexistent/*.jsonl", "data.output_prefix=/tmp/x"],
     "data.input=/nonexistent/*.jsonl does not exist; give a file, a glob or a list of them"),
    (["task=doctor", "launcher.nnodes=2"],
     "launcher.nnodes=2 needs launcher.rdzv_endpoint=<host of node 0>:<free port> (now localhost:0), the same on "
     "every node"),
    (["task=generate"], "task=generate needs generate.prompt=<text> or generate.prompts_file=<path>"),
    (["task=convert", "convert.to=hf"], "task=convert needs convert.out=<output directory>"),
    (["task=convert", "convert.to=hf", "convert.out=/tmp/o"],
     "task=convert convert.to=hf needs checkpoint.load=<checkpoint dir>"),
]


@pytest.mark.parametrize("overrides,message", RULES, ids=[r[1][:40] for r in RULES])
def test_validation_rule_message_and_exit_code(overrides, message, tmp_path, launch):
    code, out, err = launch(tmp_path, *overrides)
    assert code == 2, (out, err)
    assert err.strip() == f"error: {message}"
    assert "Traceback" not in out + err
    assert not (tmp_path / "config.yaml").exists()  # nothing frozen, nothing launched


def test_tokenizer_larger_than_model_vocab_is_rejected(tmp_path, launch):
    tokenizer = ASSETS / "tokenizers" / "qwen3"
    if not tokenizer.exists():
        pytest.skip("bundled Qwen3 tokenizer not built")
    code, _, err = launch(tmp_path, f"data.tokenizer={tokenizer}")
    assert code == 2
    assert err.strip() == (f"error: data.tokenizer={tokenizer} has 151669 token ids but model qwen3_tiny has "
                           "vocab_size=8192; use the model's tokenizer (and data tokenized with it) or a model with "
                           "a larger vocabulary")


@pytest.mark.parametrize("overrides,hydra_says", [
    (["model.not_a_key=1"], "Key 'not_a_key' not in 'ModelConfig'"),
    (["train.steps=abc"], "Value 'abc' of type 'str' could not be converted to Integer"),
    (["model=qwen3_7b"], "model=qwen3_7b is not an option; choose model=<hf|"),
])
def test_hydra_rejects_unknown_keys_wrong_types_and_options(overrides, hydra_says, tmp_path, launch):
    code, out, err = launch(tmp_path, *overrides)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert hydra_says in err


def test_cfg_job_prints_the_composed_config(tmp_path, launch):
    code, out, _ = launch(tmp_path, "model=qwen3_0.6b", "parallel=tp2_pp2", "--cfg", "job")
    assert code == 0
    assert "name: qwen3_0.6b" in out and "name: tp2_pp2" in out and "hidden_size: 1024" in out


def test_doctor_spawns_eight_gloo_ranks_for_tp8(tmp_path, launch):
    code, out, err = launch(tmp_path, "model=qwen3_0.6b", "parallel=tp8", "task=doctor")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == 8
    assert all("backend gloo" in line for line in lines)
    assert {line.split("tp=")[1].split("]")[0] for line in lines} == {str(i) for i in range(8)}
    assert "doctor: 8/8 ranks on 1 host(s) reported; all-reduce ok (sum 36, expected 36)" in out
    assert not tmp_path.exists()  # a doctor run keeps nothing: its run directory is gone


def test_multirun_two_points_each_two_ranks_plus_a_failing_point(tmp_path, launch_py):
    sweep = tmp_path / "sweep"
    proc = launch_py(["-m", "task=doctor", "parallel=dp2,tp2,tp8", f"hydra.sweep.dir={sweep}"], tmp_path)
    # tp8 over qwen3_tiny's 4 heads fails validation; the sweep goes on and reports it at the end.
    assert proc.returncode == 1
    assert proc.stdout.count("all-reduce ok (sum 3, expected 3)") == 2
    assert "parallel.tp=8 does not divide num_attention_heads=4" in proc.stderr
    assert "1 sweep point(s) failed: #2 (task=doctor parallel=tp8)" in proc.stderr
    # task=doctor keeps nothing: no sweep point leaves a run directory behind, the failed one included
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


def test_torchrun_gets_the_same_run(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", str(ROOT / "launch.py"), "task=doctor",
                           "parallel=dp2", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "doctor: 2/2 ranks on 1 host(s) reported; all-reduce ok" in proc.stdout
    assert "dp: 2" in (tmp_path / "config.yaml").read_text()


def test_two_nodes_rendezvous_through_the_elastic_launcher(tmp_path, launch_argv):
    """Two launch.py processes, one per 'node', meet at node 0's endpoint: the multi-node path, on one machine."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(launch_argv(tmp_path / str(n), "task=doctor", "parallel=dp2", "launcher.nnodes=2",
                                          "launcher.nproc_per_node=1", f"launcher.node_rank={n}",
                                          f"launcher.rdzv_endpoint=127.0.0.1:{port}"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for n in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "doctor: 2/2 ranks on 1 host(s) reported; all-reduce ok (sum 3, expected 3)" in outs[0][0] + outs[1][0]



# The first rule each (model, parallel) pair of conf/ breaks, word for word; every other pair validates.
LAYOUT_ERRORS = {
    ("qwen3_0.6b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_0.6b is dense; set parallel.ep=1",
    ("qwen3_0.6b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_0.6b is dense; set parallel.ep=1",
    ("qwen3_0.6b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_0.6b is dense; set parallel.ep=1",
    ("qwen3_0.6b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=28 of model qwen3_0.6b",
    ("qwen3_0.6b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_0.6b is dense; set parallel.ep=1",
    ("qwen3_0.6b", "tp8_pp2_vpp8"):
        "model.num_hidden_layers=28 of model qwen3_0.6b cannot be split evenly over parallel.pp=2 x parallel.vpp=8 = 16 stages; use pp*vpp in {1, 2, 4, 7, 14, 28} or list the layers per stage in parallel.pp_layers",
    ("qwen3_1.7b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_1.7b is dense; set parallel.ep=1",
    ("qwen3_1.7b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_1.7b is dense; set parallel.ep=1",
    ("qwen3_1.7b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_1.7b is dense; set parallel.ep=1",
    ("qwen3_1.7b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=28 of model qwen3_1.7b",
    ("qwen3_1.7b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_1.7b is dense; set parallel.ep=1",
    ("qwen3_1.7b", "tp8_pp2_vpp8"):
        "model.num_hidden_layers=28 of model qwen3_1.7b cannot be split evenly over parallel.pp=2 x parallel.vpp=8 = 16 stages; use pp*vpp in {1, 2, 4, 7, 14, 28} or list the layers per stage in parallel.pp_layers",
    ("qwen3_14b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_14b is dense; set parallel.ep=1",
    ("qwen3_14b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_14b is dense; set parallel.ep=1",
    ("qwen3_14b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_14b is dense; set parallel.ep=1",
    ("qwen3_14b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=40 of model qwen3_14b",
    ("qwen3_14b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_14b is dense; set parallel.ep=1",
    ("qwen3_14b", "tp8_pp2_vpp8"):
        "model.num_hidden_layers=40 of model qwen3_14b cannot be split evenly over parallel.pp=2 x parallel.vpp=8 = 16 stages; use pp*vpp in {1, 2, 4, 5, 8, 10, 20, 40} or list the layers per stage in parallel.pp_layers",
    ("qwen3_235b_a22b", "pp2_vpp2"):
        "model.num_hidden_layers=94 of model qwen3_235b_a22b cannot be split evenly over parallel.pp=2 x parallel.vpp=2 = 4 stages; use pp*vpp in {1, 2, 47, 94} or list the layers per stage in parallel.pp_layers",
    ("qwen3_235b_a22b", "pp2_vpp2_ep8"):
        "model.num_hidden_layers=94 of model qwen3_235b_a22b cannot be split evenly over parallel.pp=2 x parallel.vpp=2 = 4 stages; use pp*vpp in {1, 2, 47, 94} or list the layers per stage in parallel.pp_layers",
    ("qwen3_235b_a22b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_235b_a22b; use tp in {1, 2, 4}",
    ("qwen3_235b_a22b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_235b_a22b; use tp in {1, 2, 4}",
    ("qwen3_30b_a3b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=48 of model qwen3_30b_a3b",
    ("qwen3_30b_a3b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_30b_a3b; use tp in {1, 2, 4}",
    ("qwen3_30b_a3b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_30b_a3b; use tp in {1, 2, 4}",
    ("qwen3_32b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_32b is dense; set parallel.ep=1",
    ("qwen3_32b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_32b is dense; set parallel.ep=1",
    ("qwen3_32b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_32b is dense; set parallel.ep=1",
    ("qwen3_32b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=64 of model qwen3_32b",
    ("qwen3_32b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_32b is dense; set parallel.ep=1",
    ("qwen3_4b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_4b is dense; set parallel.ep=1",
    ("qwen3_4b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_4b is dense; set parallel.ep=1",
    ("qwen3_4b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_4b is dense; set parallel.ep=1",
    ("qwen3_4b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=36 of model qwen3_4b",
    ("qwen3_4b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_4b is dense; set parallel.ep=1",
    ("qwen3_4b", "tp8_pp2_vpp8"):
        "model.num_hidden_layers=36 of model qwen3_4b cannot be split evenly over parallel.pp=2 x parallel.vpp=8 = 16 stages; use pp*vpp in {1, 2, 3, 4, 6, 9, 12, 18, 36} or list the layers per stage in parallel.pp_layers",
    ("qwen3_8b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_8b is dense; set parallel.ep=1",
    ("qwen3_8b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_8b is dense; set parallel.ep=1",
    ("qwen3_8b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_8b is dense; set parallel.ep=1",
    ("qwen3_8b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=36 of model qwen3_8b",
    ("qwen3_8b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_8b is dense; set parallel.ep=1",
    ("qwen3_8b", "tp8_pp2_vpp8"):
        "model.num_hidden_layers=36 of model qwen3_8b cannot be split evenly over parallel.pp=2 x parallel.vpp=8 = 16 stages; use pp*vpp in {1, 2, 3, 4, 6, 9, 12, 18, 36} or list the layers per stage in parallel.pp_layers",
    ("qwen3_moe_tiny", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=4 of model qwen3_moe_tiny",
    ("qwen3_moe_tiny", "tp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_moe_tiny; use tp in {1, 2}",
    ("qwen3_moe_tiny", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_moe_tiny; use tp in {1, 2}",
    ("qwen3_tiny", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_tiny is dense; set parallel.ep=1",
    ("qwen3_tiny", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_tiny is dense; set parallel.ep=1",
    ("qwen3_tiny", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_tiny is dense; set parallel.ep=1",
    ("qwen3_tiny", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=4 of model qwen3_tiny",
    ("qwen3_tiny", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_tiny is dense; set parallel.ep=1",
    ("qwen3_tiny", "tp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_tiny; use tp in {1, 2}",
    ("qwen3_tiny", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_tiny; use tp in {1, 2}",
    ("qwen3_5_0.8b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_0.8b is dense; set parallel.ep=1",
    ("qwen3_5_0.8b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_0.8b is dense; set parallel.ep=1",
    ("qwen3_5_0.8b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_0.8b is dense; set parallel.ep=1",
    ("qwen3_5_0.8b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=24 of model qwen3_5_0.8b",
    ("qwen3_5_0.8b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_0.8b is dense; set parallel.ep=1",
    ("qwen3_5_0.8b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_0.8b; use tp in {1, 2}",
    ("qwen3_5_0.8b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_0.8b; use tp in {1, 2}",
    ("qwen3_5_122b_a10b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=48 of model qwen3_5_122b_a10b",
    ("qwen3_5_122b_a10b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_122b_a10b; use tp in {1, 2}",
    ("qwen3_5_122b_a10b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_122b_a10b; use tp in {1, 2}",
    ("qwen3_5_27b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_27b is dense; set parallel.ep=1",
    ("qwen3_5_27b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_27b is dense; set parallel.ep=1",
    ("qwen3_5_27b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_27b is dense; set parallel.ep=1",
    ("qwen3_5_27b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=64 of model qwen3_5_27b",
    ("qwen3_5_27b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_27b is dense; set parallel.ep=1",
    ("qwen3_5_27b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_27b; use tp in {1, 2, 4}",
    ("qwen3_5_27b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_27b; use tp in {1, 2, 4}",
    ("qwen3_5_2b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_2b is dense; set parallel.ep=1",
    ("qwen3_5_2b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_2b is dense; set parallel.ep=1",
    ("qwen3_5_2b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_2b is dense; set parallel.ep=1",
    ("qwen3_5_2b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=24 of model qwen3_5_2b",
    ("qwen3_5_2b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_2b is dense; set parallel.ep=1",
    ("qwen3_5_2b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_2b; use tp in {1, 2}",
    ("qwen3_5_2b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_2b; use tp in {1, 2}",
    ("qwen3_5_35b_a3b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=40 of model qwen3_5_35b_a3b",
    ("qwen3_5_35b_a3b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_35b_a3b; use tp in {1, 2}",
    ("qwen3_5_35b_a3b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_35b_a3b; use tp in {1, 2}",
    ("qwen3_5_397b_a17b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=60 of model qwen3_5_397b_a17b",
    ("qwen3_5_397b_a17b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_397b_a17b; use tp in {1, 2}",
    ("qwen3_5_397b_a17b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_5_397b_a17b; use tp in {1, 2}",
    ("qwen3_5_4b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_4b is dense; set parallel.ep=1",
    ("qwen3_5_4b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_4b is dense; set parallel.ep=1",
    ("qwen3_5_4b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_4b is dense; set parallel.ep=1",
    ("qwen3_5_4b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=32 of model qwen3_5_4b",
    ("qwen3_5_4b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_4b is dense; set parallel.ep=1",
    ("qwen3_5_4b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_4b; use tp in {1, 2, 4}",
    ("qwen3_5_4b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_4b; use tp in {1, 2, 4}",
    ("qwen3_5_9b", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_9b is dense; set parallel.ep=1",
    ("qwen3_5_9b", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_9b is dense; set parallel.ep=1",
    ("qwen3_5_9b", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_9b is dense; set parallel.ep=1",
    ("qwen3_5_9b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=32 of model qwen3_5_9b",
    ("qwen3_5_9b", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_9b is dense; set parallel.ep=1",
    ("qwen3_5_9b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_9b; use tp in {1, 2, 4}",
    ("qwen3_5_9b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=4 of model qwen3_5_9b; use tp in {1, 2, 4}",
    ("qwen3_5_moe_tiny", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=4 of model qwen3_5_moe_tiny",
    ("qwen3_5_moe_tiny", "tp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_5_moe_tiny; use tp in {1, 2}",
    ("qwen3_5_moe_tiny", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_5_moe_tiny; use tp in {1, 2}",
    ("qwen3_5_tiny", "ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_tiny is dense; set parallel.ep=1",
    ("qwen3_5_tiny", "pp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_tiny is dense; set parallel.ep=1",
    ("qwen3_5_tiny", "pp2_vpp2_ep8"):
        "parallel.ep=8 needs a MoE model but qwen3_5_tiny is dense; set parallel.ep=1",
    ("qwen3_5_tiny", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=4 of model qwen3_5_tiny",
    ("qwen3_5_tiny", "tp2_ep2"):
        "parallel.ep=2 needs a MoE model but qwen3_5_tiny is dense; set parallel.ep=1",
    ("qwen3_5_tiny", "tp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_5_tiny; use tp in {1, 2}",
    ("qwen3_5_tiny", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_attention_heads=4 of model qwen3_5_tiny; use tp in {1, 2}",
    ("qwen3_next_80b_a3b", "pp4_ep32"):
        "parallel.pp_layers=[23, 24, 24, 23] must list 4 stage sizes (pp*vpp) of at least 1 that sum to num_hidden_layers=48 of model qwen3_next_80b_a3b",
    ("qwen3_next_80b_a3b", "tp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_next_80b_a3b; use tp in {1, 2}",
    ("qwen3_next_80b_a3b", "tp8_pp2_vpp8"):
        "parallel.tp=8 does not divide num_key_value_heads=2 of model qwen3_next_80b_a3b; use tp in {1, 2}",
}


def test_help_lists_only_options_a_user_can_pick(launch, tmp_path):
    """`--help` names each group's yaml files; the schemas registered for typing are no choices."""
    code, out, err = launch(tmp_path, "--help")
    assert code == 0, err
    groups = dict(line.split(": ", 1) for line in out.split("== Config ==")[0].splitlines() if ": " in line)
    assert set(groups) == {p.name for p in CONF.iterdir() if p.is_dir()}
    for group, listed in groups.items():
        assert listed.split(", ") == sorted(p.stem for p in (CONF / group).glob("*.yaml")), group
