"""Multi-turn tool use in rollouts (speedllm.train.tools, speedllm.generation.rollout with tools): a tiny Qwen3
whose next tokens are steered by a forward hook on its logits (input, not our code: the rollout, the tool runner,
the KV cache are the real ones) calls a tool; the conversation's tokens equal transformers' chat-template rendering
of the same messages, tool tokens carry no loss, a hanging tool is cut at its timeout and counted, and
task=grpo with the calculator runs through launch.py."""

import json
import time

import pytest
import torch
from conftest import DEMO_TOKENIZER
from omegaconf import OmegaConf

from speedllm.data.tokenizer import load_tokenizer, pad_id_of, stop_ids_of
from speedllm.generation.rollout import completion_logprobs, rollout
from speedllm.generation.sampling import Sampling
from speedllm.train.policy_loss import policy_loss
from speedllm.train.tools import ToolRunner, calculator, conversation, run_calls

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "(2 + 3) * 4"}}}


def slow(expression: str) -> str:
    time.sleep(30)
    return "never"


def steer(model, script):
    """A forward hook that makes `script[k]` the argmax of each row's logits when it has k completion tokens."""
    fed = []

    def hook(module, args, kwargs, out):
        fed.append(args[0].shape[1])  # the prefill, then one token per decode step
        k = len(fed) - 1
        bias = torch.zeros(out.shape[-1])
        bias[script[min(k, len(script) - 1)]] = 1e4
        return out + bias

    return model.register_forward_hook(hook, with_kwargs=True)


def conversation_ids(tok, answer: str, tool_text: str):
    """(prompt ids, the template's ids of the whole conversation) for one calculator call."""
    user = [{"role": "user", "content": "What is (2 + 3) * 4?"}]
    messages = user + [{"role": "assistant", "content": "", "tool_calls": [CALL]},
                       {"role": "tool", "content": tool_text}, {"role": "assistant", "content": answer}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert whole[:len(prompt)] == prompt
    return prompt, whole


@pytest.fixture(scope="module")
def setup(hf_pair):
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    _, _, model = hf_pair(seed=5, vocab_size=len(tok))
    return tok, model


def run(tok, model, tools, tool_text, max_new=120):
    prompt, whole = conversation_ids(tok, "20", tool_text)
    # the template's text ends its last turn with "<|im_end|>\n": the completion stops at <|im_end|>
    expected = whole[len(prompt):-1]
    handle = steer(model, expected)
    runner = ToolRunner(tools, tok, max_turns=2, timeout_s=0.5, max_chars=200)
    try:
        ro = rollout(model, [prompt], 2, max_new, Sampling(), None, stop_ids_of(tok), pad_id_of(tok), torch.float32,
                     tools=runner)
    finally:
        handle.remove()
    return ro, runner, prompt, expected


def test_conversation_tokens_equal_the_chat_template_and_tool_tokens_carry_no_loss(setup):
    tok, model = setup
    ro, runner, prompt, expected = run(tok, model, {"calculator": calculator}, "20")
    assert runner.calls == 2 and runner.errors == 0  # one call per completion
    for row in range(2):
        assert ro.tokens[row].tolist() == prompt + expected  # no left padding: one prompt
    assert not ro.truncated.any()
    # the tool's tokens: exactly the template's tool turn and the next assistant turn's opening
    response = tok.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n20\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n", add_special_tokens=False)
    tool_cols = ro.tool_mask[0].nonzero().flatten().tolist()
    assert [expected[c] for c in tool_cols] == response
    assert tool_cols == list(range(tool_cols[0], tool_cols[0] + len(response)))
    assert (ro.completion_mask + ro.tool_mask == 1).all()
    assert (ro.logprobs[ro.tool_mask == 1] == 0).all()
    # the training forward and the loss: no log-probability, no gradient at a tool token
    logprobs, _ = completion_logprobs(model, ro, 1.0)
    assert (logprobs.detach()[ro.tool_mask == 1] == 0).all()
    assert (logprobs.detach()[ro.completion_mask == 1] < 0).all()  # unsteered here: every sampled token scored
    lp = logprobs.detach().clone().requires_grad_(True)
    rl = OmegaConf.create({"clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0, "loss_agg": "token_mean",
                           "importance": "token", "max_new_tokens": ro.completion_mask.shape[1]})
    loss, _ = policy_loss(lp, lp.detach(), None, torch.tensor([1.0, -0.5]), ro.completion_mask, rl, num_rows=2,
                          num_tokens=float(ro.completion_mask.sum()))
    loss.backward()
    assert (lp.grad[ro.tool_mask == 1] == 0).all() and (lp.grad[ro.completion_mask == 1] != 0).all()


def test_a_hanging_tool_is_cut_at_its_timeout_and_counted(setup):
    tok, model = setup
    error = "error: TimeoutError: no answer within 0.5 s"
    start = time.perf_counter()
    run(tok, model, {"calculator": calculator}, "20")
    instant = time.perf_counter() - start  # the same rollout with a tool that answers at once: this box's pace
    start = time.perf_counter()
    ro, runner, prompt, expected = run(tok, model, {"calculator": slow}, error)
    took = time.perf_counter() - start
    assert runner.errors == runner.calls == 2
    assert 0.5 <= took < instant + 15  # cut at 0.5 s, not after the tool's 30 s
    assert ro.tokens[0].tolist() == prompt + expected  # the model reads the error as the tool's response


@pytest.mark.parametrize("expression, value", [("(2 + 3) * 4", "20"), ("-2 ** 3 // 3", "-3"), ("7 / 2", "3.5"),
                                               ("10 % 4", "2")])
def test_calculator(expression, value):
    assert calculator(expression) == value == str(eval(expression)).removesuffix(".0")  # eval as the reference


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 10 ** 10", "9" * 300, "[1] * 3", "x + 1"])
def test_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_grpo_with_the_calculator_through_launch_py(tmp_path, launch):
    code, out, err = launch(tmp_path / "run", "task=grpo", "model=qwen3_tiny", "hardware=cpu", "train.steps=2",
                            "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8", "train.log_every=1",
                            "rl.tools=[{_target_: speedllm.train.tools.calculator}]", "logging.progress_bar=false")
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "rl/tool_errors" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["rl/tool_errors"] <= r["rl/tool_calls"] for r in steps)


def test_rewards_get_the_conversation_as_messages(setup):
    tok, model = setup
    ro, _, _, _ = run(tok, model, {"calculator": calculator}, "20")
    ids = ro.completion_ids()[0]
    messages = conversation(tok, ids, ro.tool_mask[0, :len(ids)].tolist())
    call = json.dumps({"name": "calculator", "arguments": CALL["function"]["arguments"]})
    assert messages == [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                        {"role": "tool", "content": "20"},
                        {"role": "assistant", "content": "<think>\n\n</think>\n\n20"}]


def test_the_last_call_of_a_conversation_is_run_and_bad_calls_answer_errors():
    first = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    second = '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"6 * 7\\"}"}\n</tool_call>'
    texts = [first + "<tool_response>\n2\n</tool_response> then " + second, "<tool_call>{name: 1}</tool_call>",
             '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calculator", "arguments": {"expression": "1 / 0"}}</tool_call>',
             '<tool_call>{"name": "number", "arguments": {}}</tool_call>']
    out = run_calls({"calculator": calculator, "number": lambda: 42}, texts, 1.0, 80)
    assert out[0] == ("42", False)
    assert [error for _, error in out[1:]] == [True] * 4
    assert out[1][0].startswith("error: the tool call is not valid JSON")
    assert out[2][0] == "error: no tool named 'search' (tools: calculator, number)"
    assert out[3][0] == "error: ZeroDivisionError: division by zero"
    assert out[4][0] == "error: the tool returned int, not text"
    assert run_calls({"calculator": calculator}, texts[3:4], 1.0, 12) == [("error: ZeroD", True)]  # tool_max_chars


def rank_name(expression: str) -> str:
    """A tool that answers differently on each rank (and late on rank 1)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(2)
    return f"rank {dist.get_rank()}"


def _tp_ranks(rank, path, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    runner = ToolRunner({"calculator": rank_name}, tok, max_turns=1, timeout_s=1.0, max_chars=50,
                        group=dist.group.WORLD)
    call = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>',
                      add_special_tokens=False)
    out[rank] = (tok.decode(runner.respond([call])[0]), runner.errors)
    dist.destroy_process_group()


def test_tensor_parallel_ranks_get_the_first_ranks_answers(tmp_path):
    import torch.multiprocessing as mp

    out = mp.Manager().dict()
    mp.spawn(_tp_ranks, args=(str(tmp_path / "store"), out), nprocs=2)
    assert out[0] == out[1] and "\nrank 0\n</tool_response>" in out[0][0] and out[0][1] == 0


def test_prompts_show_the_tools_as_the_chat_template_renders_them(tmp_path):
    from speedllm.data.prompts import load_prompts
    from speedllm.errors import UserError
    from speedllm.train.tools import tool_schemas

    tok = load_tokenizer(str(DEMO_TOKENIZER))
    prompt = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 2 + 3?"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": prompt, "answer": "5"}) + "\n")
    data = load_prompts(str(tmp_path / "p.jsonl"), tok, 1000, 8, tool_schemas({"calculator": calculator}))
    # transformers builds the schema from the function itself
    assert data.ids[0] == tok.apply_chat_template(prompt, tools=[calculator], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert "calculator" in tok.decode(data.ids[0])
    with pytest.raises(UserError, match="rl.tools: slow cannot be shown to the model"):
        tool_schemas({"slow": slow})
