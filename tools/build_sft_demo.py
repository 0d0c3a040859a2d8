"""Build speedllm/assets/sft_demo/: a synthetic SFT set with checkable answers, in alpaca, sharegpt and messages form.

Tasks small enough for the tiny model to learn on CPU in minutes: two-number addition and subtraction,
the larger of two numbers, the successor of a number. The same samples are written in all three formats;
heldout.jsonl holds questions that are not in the training set, each with its expected answer. After every
tenth sample comes its (last) question again with the calculator tool shown (the record's `tools`, NUM_TOOL
samples): sums, differences and successors call it (`<tool_call>` in Qwen3's format, then the tool's answer, then
the number), the larger of two numbers is answered directly; alpaca, which has no tool turns, holds their question
and answer. The tool samples are ~330-390 tokens (the template's tool section), so they need train.seq_len=512.

    python tools/build_sft_demo.py
"""

import json
import random

from speedllm.paths import ASSETS
from speedllm.train.tools import calculator, tool_schemas

OUT = ASSETS / "sft_demo"
SYSTEM = "You are a careful calculator. Answer with the number only."
NUM_TRAIN, NUM_HELDOUT, NUM_TOOL = 2000, 200, 200


def make_task(rng: random.Random) -> tuple:
    """One (question, answer) pair."""
    a, b = rng.randrange(100), rng.randrange(100)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What is {a} + {b}?", str(a + b)
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", str(a - b)
    if kind == 2:
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    return f"What number comes after {a}?", str(a + 1)


def tool_turns(question: str, answer: str) -> list:
    """(role, text) turns answering `question` with the calculator: its call, its answer, the number."""
    words = question.rstrip("?").split()
    if "larger" in question:
        return [("assistant", answer)]
    expression = f"{words[-1]} + 1" if "after" in question else " ".join(words[-3:])
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [("assistant", f"<tool_call>\n{call}\n</tool_call>"), ("tool", calculator(expression)),
            ("assistant", answer)]


def main() -> None:
    rng = random.Random(0)
    pairs, seen = [], set()
    while len(pairs) < NUM_TRAIN + NUM_HELDOUT:
        q, a = make_task(rng)
        if q not in seen:
            seen.add(q)
            pairs.append((q, a))
    train, heldout = pairs[:NUM_TRAIN], pairs[NUM_TRAIN:]
    OUT.mkdir(parents=True, exist_ok=True)

    # Every fifth sample is a two-turn conversation, so multi-turn masking is exercised too.
    convs = []
    for i in range(NUM_TRAIN):
        q, a = train[i]
        turns = [(q, a)]
        if i % 5 == 4:
            turns.insert(0, train[i - 1])
        convs.append(turns)

    tools = tool_schemas({"calculator": calculator})
    with_tool = set(range(NUM_TRAIN // NUM_TOOL - 1, NUM_TRAIN, NUM_TRAIN // NUM_TOOL))  # spread through the file
    with open(OUT / "messages.jsonl", "w") as f:
        for i, turns in enumerate(convs):
            msgs = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
            for q, a in turns:
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
            if i in with_tool:
                msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": train[i][0]}]
                msgs += [{"role": role, "content": text} for role, text in tool_turns(*train[i])]
                f.write(json.dumps({"messages": msgs, "tools": tools}) + "\n")
    roles = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    with open(OUT / "sharegpt.json", "w") as f:
        rows = []
        for i, turns in enumerate(convs):
            conv = [{"from": "system", "value": SYSTEM}] if i % 2 == 0 else []
            for q, a in turns:
                conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            rows.append({"conversations": conv})
            if i in with_tool:
                turns = [("system", SYSTEM), ("user", train[i][0])] + tool_turns(*train[i])
                rows.append({"conversations": [{"from": roles[r], "value": text} for r, text in turns],
                             "tools": tools})
        json.dump(rows, f, indent=1)
    with open(OUT / "alpaca.json", "w") as f:
        json.dump([{"instruction": SYSTEM, "input": train[j][0], "output": train[j][1]}
                   for i in range(NUM_TRAIN) for j in ([i, i] if i in with_tool else [i])], f, indent=1)
    with open(OUT / "heldout.jsonl", "w") as f:
        for q, a in heldout:
            f.write(json.dumps({"system": SYSTEM, "question": q, "answer": a}) + "\n")
    print(f"{NUM_TRAIN} + {NUM_TOOL} with the tool train / {NUM_HELDOUT} held-out samples -> {OUT}")


if __name__ == "__main__":
    main()
