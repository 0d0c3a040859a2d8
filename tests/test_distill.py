"""task=distill: the chunked divergences against TRL's GKD loss and torch's kl_div (values and gradients), the task
end to end on a transformers-saved teacher, and its one-line errors."""

import os

import pytest
import torch
import torch.nn.functional as F

from speedllm.ops import IGNORE_INDEX
from speedllm.train.distill_loss import STATS, Objective, distill_loss

pytestmark = pytest.mark.numerics

N, DS, DT, V = 24, 16, 32, 300


def operands(seed=0):
    """Student and teacher hidden states and output weights, and labels with a few unlabelled positions."""
    g = torch.Generator().manual_seed(seed)
    h_s, w_s = torch.randn(N, DS, generator=g), torch.randn(V, DS, generator=g) * 0.5
    h_t, w_t = torch.randn(N, DT, generator=g), torch.randn(V, DT, generator=g) * 0.5
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[0, 5, 6]] = IGNORE_INDEX
    return h_s, w_s, h_t, w_t, labels


def ours(objective, chunk_size=0, seed=0):
    """(mean loss over labelled positions, grad of the student's hidden states, of its weight, stats)."""
    h_s, w_s, h_t, w_t, labels = operands(seed)
    h_s.requires_grad_(True)
    w_s.requires_grad_(True)
    stats = torch.zeros(len(STATS))
    total = distill_loss(h_s, w_s, labels, chunk_size, teacher_hidden=h_t, teacher_weight=w_t, objective=objective,
                         stats=stats)
    count = (labels != IGNORE_INDEX).sum()
    (total / count).backward()
    return total.item() / count.item(), h_s.grad, w_s.grad, stats


def reference(loss_fn, seed=0):
    """(loss, grad of the student's hidden states, of its weight) of loss_fn(student logits, teacher logits,
    labels) through autograd on the full logits."""
    h_s, w_s, h_t, w_t, labels = operands(seed)
    h_s.requires_grad_(True)
    w_s.requires_grad_(True)
    loss = loss_fn(h_s @ w_s.t(), h_t @ w_t.t(), labels)
    loss.backward()
    return loss.item(), h_s.grad, w_s.grad


def assert_same(a, b):
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_equals_trl_generalized_jsd_loss(trl_jsd, beta, temperature):
    expected = reference(lambda s, t, labels: trl_jsd(s, t, labels=labels, beta=beta, temperature=temperature))
    for chunk_size in (0, 5):  # one chunk, and chunks of 5 positions (the last one short)
        assert_same(ours(Objective("jsd", beta=beta, temperature=temperature), chunk_size), expected)


def kl_div(forward: bool, temperature: float):
    def loss(s, t, labels):
        log_ps, log_pt = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
        keep = labels != IGNORE_INDEX
        inputs, target = (log_ps, log_pt) if forward else (log_pt, log_ps)
        return F.kl_div(inputs[keep], target[keep], reduction="batchmean", log_target=True)
    return loss


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl"])
def test_kl_equals_torch_kl_div_on_the_full_logits(loss):
    for temperature, chunk_size in ((1.0, 0), (2.0, 7)):
        expected = reference(kl_div(loss == "forward_kl", temperature))
        assert_same(ours(Objective(loss, temperature=temperature), chunk_size), expected)


def test_ce_weight_mixes_the_labels_cross_entropy_and_stats_are_the_batch_sums():
    def mixed(s, t, labels):
        return 0.7 * kl_div(True, 2.0)(s, t, labels) + 0.3 * F.cross_entropy(s, labels, ignore_index=IGNORE_INDEX)

    result = ours(Objective("forward_kl", temperature=2.0, ce_weight=0.3), chunk_size=4)
    assert_same(result, reference(mixed))
    h_s, w_s, h_t, w_t, labels = operands()
    s, t = h_s @ w_s.t(), h_t @ w_t.t()
    keep = labels != IGNORE_INDEX
    kl, ce, agree, count = result[3].tolist()
    assert count == keep.sum().item()
    assert kl / count == pytest.approx(kl_div(True, 2.0)(s, t, labels).item(), abs=1e-6)
    assert ce / count == pytest.approx(F.cross_entropy(s, labels, ignore_index=IGNORE_INDEX).item(), abs=1e-6)
    assert agree == (s.argmax(-1) == t.argmax(-1))[keep].sum().item()


def test_top_k_teacher_is_renormalized_over_its_top_k():
    k = 10

    def truncated(s, t, labels):
        top = t.topk(k, dim=-1).indices
        log_pt = torch.full_like(t, -torch.inf).scatter(-1, top, F.log_softmax(t.gather(-1, top), -1))
        log_ps = F.log_softmax(s, -1)
        keep = labels != IGNORE_INDEX
        per_position = torch.where(log_pt > -torch.inf, log_pt.exp() * (log_pt - log_ps), 0.0).sum(-1)
        return per_position[keep].mean()

    assert_same(ours(Objective("forward_kl", top_k=k), chunk_size=6), reference(truncated))
    full = ours(Objective("forward_kl", top_k=V))
    assert_same(full, ours(Objective("forward_kl")))  # k = V is the whole distribution


# ------------------------------------------------------------------------------------------- the task

# lr 1e-9: the held-out metrics, taken after step 1, are those of the starting weights
DISTILL = ["task=distill", "data=sft_demo", "data.packing=false", "train.seq_len=64", "train.steps=1",
           "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=1e-9", "optim.min_lr=0", "train.eval_every=1",
           "train.eval_steps=1", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(teacher, student): transformers-saved Qwen3s over the demo tokenizer, the student narrower."""
    from test_hf import save_hf

    root = tmp_path_factory.mktemp("models")
    teacher = save_hf("dense_tied", root / "teacher", max_shard_size="1MB", vocab_size=8192)
    student = save_hf("dense_tied", root / "student", max_shard_size="1MB", vocab_size=8192, hidden_size=32,
                      intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return teacher, student


def test_step_one_equals_trl_on_transformers_logits(models, tmp_path, launch, trl_jsd):
    """python launch.py task=distill with a transformers-saved teacher and student: the first step's loss and
    metrics (training and held-out) equal TRL's GKD loss and torch on the two transformers models' logits."""
    import json

    from test_train_loop import TINY
    from transformers import AutoModelForCausalLM

    from speedllm.config import compose_config
    from speedllm.data.loader import build_loader

    teacher_dir, student_dir = models
    run = [o for o in TINY if not o.startswith("model")]
    overrides = [*run, *DISTILL, "model=hf", f"checkpoint.load_hf={student_dir}", f"distill.teacher={teacher_dir}",
                 "distill.loss=jsd", "distill.beta=0.5", "distill.temperature=2.0", "distill.ce_weight=0.2"]
    code, out, err = launch(tmp_path / "run", *overrides)
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train, valid = records

    cfg = compose_config(*overrides, f"run_dir={tmp_path / 'run'}")
    teacher, student = (AutoModelForCausalLM.from_pretrained(d).eval() for d in models)
    for record, split, count in ((train, "train", 2), (valid, "valid", 1)):  # 2 micro-batches, 1 eval batch
        loader = build_loader(cfg, split, 0, 1, cfg.train.micro_batch_size, cfg.train.seq_len, cfg.seed)
        batches = [next(loader) for _ in range(count)] if split == "train" else [next(iter(loader))]
        tokens = torch.cat([b["tokens"] for b in batches])
        labels = torch.cat([b["labels"] for b in batches])
        with torch.no_grad():
            s, t = student(tokens).logits, teacher(tokens).logits
        keep = labels != IGNORE_INDEX
        ce = F.cross_entropy(s[keep], labels[keep]).item()
        expected = 0.8 * trl_jsd(s, t, labels=labels, beta=0.5, temperature=2.0).item() + 0.2 * ce
        assert record["distill/loss"] == pytest.approx(expected, rel=1e-5), split
        assert record["distill/ce"] == pytest.approx(ce, rel=1e-5)
        kl = F.kl_div(F.log_softmax(s[keep] / 2, -1), F.log_softmax(t[keep] / 2, -1), reduction="batchmean",
                      log_target=True).item()
        assert record["distill/kl"] == pytest.approx(kl, rel=1e-5)
        assert record["distill/top1_agree"] == pytest.approx((s.argmax(-1) == t.argmax(-1))[keep].float().mean())
    assert train["loss"] == train["distill/loss"] and (tmp_path / "run" / "tensorboard").is_dir()


def bad_teachers(teacher_dir, root):
    """Directories that are not a teacher for the demo-tokenizer student: keyed by what is wrong."""
    import json
    import shutil

    config = json.loads((teacher_dir / "config.json").read_text())
    wider = root / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "vocab_size": 8320}))
    other = root / "other_tokenizer"
    shutil.copytree(teacher_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: same size, another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    empty = root / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a model")
    return {"wider": wider, "other": other, "empty": empty}


def test_bad_input_is_one_line_before_launch(models, tmp_path, launch):
    from omegaconf import open_dict

    from speedllm.config import compose_config
    from speedllm.config.resolve import resolve_layout
    from speedllm.config.validate import validate
    from speedllm.errors import UserError

    bad = bad_teachers(models[0], tmp_path)
    cases = [
        ([], "task=distill needs distill.teacher=<Hugging Face model dir or checkpoint dir"),
        ([f"distill.teacher={bad['wider']}"], "has vocab_size=8320 but the student (model=qwen3_tiny) has "
                                              "vocab_size=8192; distill between models of one vocabulary"),
        ([f"distill.teacher={bad['other']}"], "its tokenizer"),
        ([f"distill.teacher={models[0]}", "distill.top_k=0"], "distill.top_k=0 must be >= 1"),
        ([f"distill.teacher={models[0]}", "distill.top_k=8193"], "distill.top_k=8193 exceeds the vocabulary (8192)"),
        ([f"distill.teacher={models[0]}", "distill.top_k=5", "distill.loss=reverse_kl"], "is infinite where the "
         "student puts mass outside the teacher's top k"),
        ([f"distill.teacher={tmp_path / 'nowhere'}"], "does not exist"),
        ([f"distill.teacher={models[0]}", "distill.teacher_quant=int8_wo", "parallel=tp2",
          "launcher.nproc_per_node=2"], "distill.teacher_quant=int8_wo quantizes a whole teacher, but parallel=tp2"),
    ]
    for overrides, message in cases:
        cfg = compose_config("hardware=cpu", "task=distill", *overrides)
        with open_dict(cfg):
            world, nproc = resolve_layout(cfg)
            with pytest.raises(UserError) as err:
                validate(cfg, world, nproc)
        assert message in str(err.value) and "\n" not in str(err.value), (overrides, str(err.value))
    code, out, err = launch(tmp_path / "run", "task=distill", "hardware=cpu", f"distill.teacher={bad['empty']}")
    assert code == 2 and not (tmp_path / "run").exists()
    assert f"distill.teacher={bad['empty']} is not a model: no config.json" in err
    assert len(err.strip().splitlines()) == 1


def test_planner_counts_the_teacher(models):
    """The planner's rank memory of a task=distill run holds the teacher's weights beside the student's: in one
    process all of them (as transformers stores them), under FSDP2 on 2 ranks half plus its gathered root unit."""
    from transformers import AutoModelForCausalLM

    from speedllm.config import compose_config
    from speedllm.planner.layout import Layout
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.tasks import task_spec

    teacher = AutoModelForCausalLM.from_pretrained(models[0])
    weights = sum(p.numel() for p in teacher.parameters())  # the tied embedding once
    embedding = teacher.get_input_embeddings().weight.numel()
    norm = teacher.model.norm.weight.numel()
    run = ["hardware=cpu", "hardware.dtype=float32", "model=qwen3_tiny"]  # fp32: the gathered root's bytes below
    plain = Planner(problem_from_config(compose_config(*run), 2))
    distill = Planner(problem_from_config(compose_config(*run, "task=distill", f"distill.teacher={models[0]}"), 2,
                                          task_spec("distill")))
    for layout, expected in ((Layout(dp=1), 4 * weights), (Layout(dp=2), 4 * weights / 2 + 4 * (embedding + norm))):
        (with_teacher,), (without,) = distill.rank_memories(layout), plain.rank_memories(layout)
        assert with_teacher.teacher == expected
        assert with_teacher.total == without.total + expected


def test_int8_teacher_equals_torchao_int8_weight_only(models, tmp_path, launch):
    """distill.teacher_quant=int8_wo through launch.py: the step's KL to the teacher equals the KL to the
    transformers teacher whose decoder projections torchao's Int8WeightOnlyConfig quantized; the planner and
    task=dryrun count its projections at one byte a weight (plus a scale a row), and shard-free layouts only."""
    import json
    from dataclasses import replace
    from types import SimpleNamespace

    from test_train_loop import TINY
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from transformers import AutoModelForCausalLM

    from speedllm.config import compose_config
    from speedllm.data.loader import build_loader
    from speedllm.models.config import PROJECTIONS
    from speedllm.planner.layout import Layout
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.tasks import task_spec

    teacher_dir, student_dir = models
    run = [o for o in TINY if not o.startswith("model")]
    overrides = [*run, *DISTILL, "model=hf", f"checkpoint.load_hf={student_dir}", f"distill.teacher={teacher_dir}",
                 "distill.teacher_quant=int8_wo"]
    code, out, err = launch(tmp_path / "run", *overrides)
    assert code == 0, err[-2000:]
    train = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    teacher, student = (AutoModelForCausalLM.from_pretrained(d).eval() for d in models)
    full = [p.numel() for p in teacher.parameters()]  # the tied embedding once
    projections = [m.weight.shape for n, m in teacher.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    quantize_(teacher, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in PROJECTIONS)
    cfg = compose_config(*overrides, f"run_dir={tmp_path / 'run'}")
    loader = build_loader(cfg, "train", 0, 1, cfg.train.micro_batch_size, cfg.train.seq_len, cfg.seed)
    batches = [next(loader) for _ in range(2)]  # the step's 2 micro-batches
    tokens, labels = (torch.cat([b[k] for b in batches]) for k in ("tokens", "labels"))
    with torch.no_grad():
        s, t = student(tokens).logits, teacher(tokens).logits
    keep = labels != IGNORE_INDEX
    kl = F.kl_div(F.log_softmax(s[keep], -1), F.log_softmax(t[keep], -1), reduction="batchmean", log_target=True)
    assert train["distill/kl"] == pytest.approx(kl.item(), rel=1e-5)

    expected = 4 * sum(full) - sum(3 * o * i - 4 * o for o, i in projections)
    problem = problem_from_config(compose_config("hardware=cpu", "hardware.dtype=float32", "task=distill",
                                                 f"distill.teacher={teacher_dir}", "distill.teacher_quant=int8_wo"), 2,
                                  task_spec("distill"))
    planner = Planner(problem)
    (memory,) = planner.rank_memories(Layout(dp=1))
    assert memory.teacher == expected
    assert "quantizes a whole teacher" in planner.invalid_reason(Layout(tp=2))
    assert "quantizes a whole teacher" in planner.invalid_reason(Layout(dp=2))
    assert planner.invalid_reason(Layout(dp=2, fsdp=False)) is None
    # the student under FSDP2, the teacher whole
    run = SimpleNamespace(**{**vars(problem.run), "distill": replace(problem.run.distill, teacher_parallel="replicate")})
    replicated = Planner(replace(problem, run=run))
    assert replicated.invalid_reason(Layout(dp=2)) is None
    assert "distill.teacher_parallel=replicate keeps the teacher whole" in replicated.invalid_reason(Layout(tp=2))
    (memory,) = replicated.rank_memories(Layout(dp=2))
    assert memory.teacher == expected
    code, out, err = launch(tmp_path / "dry", "task=dryrun", "hardware=cpu", "hardware.dtype=float32",
                            f"distill.teacher={teacher_dir}", "distill.teacher_quant=int8_wo")
    assert code == 0, err[-2000:]
    assert f"teacher weights {expected / 2**20:.1f} MiB (= task=plan's)" in out


def test_on_policy_steps_train_the_configured_loss(models, tmp_path, launch):
    """distill.on_policy=1: the step trains on the student's samples with distill.loss and ce_weight (GKD), not a
    fixed reverse KL: its loss is (1 - w) KL(teacher || student) + w cross-entropy on the sampled tokens, both of
    which the step reports from the same positions."""
    import json

    from test_train_loop import TINY

    teacher_dir, student_dir = models
    run = [o for o in TINY if not o.startswith("model")]
    code, _, err = launch(tmp_path / "run", *run, *DISTILL, "model=hf", f"checkpoint.load_hf={student_dir}",
                          f"distill.teacher={teacher_dir}", "distill.on_policy=1.0", "distill.loss=forward_kl",
                          "distill.temperature=2.0", "distill.ce_weight=0.3", "train.eval_every=0")
    assert code == 0, err[-2000:]
    (train,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert train["on_policy"] == 1.0
    expected = 0.7 * train["distill/kl"] + 0.3 * train["distill/ce"]
    assert train["distill/loss"] == pytest.approx(expected, rel=1e-5)
    assert train["distill/kl"] > 0 and train["distill/ce"] > 0


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_on_policy_steps_are_drawn_with_probability_lambda(fraction):
    from speedllm.tasks.distill import is_on_policy

    draws = [is_on_policy(step, fraction, seed=7) for step in range(1, 4001)]
    assert sum(draws) / len(draws) == pytest.approx(fraction, abs=0.03)  # binomial sd <= 0.008
    # drawn per step, not a fixed schedule: runs of three alike occur (an even spacing at 0.5 alternates) and
    # another seed draws other steps; the draw is the same whenever it is asked again (every rank, a resume)
    assert any(draws[i] == draws[i + 1] == draws[i + 2] for i in range(len(draws) - 2))
    assert draws != [is_on_policy(step, fraction, seed=8) for step in range(1, 4001)]
    assert draws == [is_on_policy(step, fraction, seed=7) for step in range(1, 4001)]
    assert not any(is_on_policy(s, 0.0, 7) for s in range(1, 200)) and all(is_on_policy(s, 1.0, 7) for s in range(1, 200))
