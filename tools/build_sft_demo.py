"""Build speedllm/assets/sft_demo/: a synthetic SFT set with checkable answers, in alpaca, sharegpt and messages form.

Tasks small enough for the tiny model to learn on CPU in minutes: two-number addition and subtraction,
the larger of two numbers, the successor of a number. The same samples are written in all three formats;
heldout.jsonl holds questions that are not in the training set, each with its expected answer.

    python tools/build_sft_demo.py
"""

import json
import random

from speedllm.paths import ASSETS

OUT = ASSETS / "sft_demo"
SYSTEM = "You are a careful calculator. Answer with the number only."
NUM_TRAIN, NUM_HELDOUT = 2000, 200


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

    with open(OUT / "messages.jsonl", "w") as f:
        for i, turns in enumerate(convs):
            msgs = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
            for q, a in turns:
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(OUT / "sharegpt.json", "w") as f:
        rows = []
        for i, turns in enumerate(convs):
            conv = [{"from": "system", "value": SYSTEM}] if i % 2 == 0 else []
            for q, a in turns:
                conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            rows.append({"conversations": conv})
        json.dump(rows, f, indent=1)
    with open(OUT / "alpaca.json", "w") as f:
        json.dump([{"instruction": SYSTEM, "input": q, "output": a} for q, a in train], f, indent=1)
    with open(OUT / "heldout.jsonl", "w") as f:
        for q, a in heldout:
            f.write(json.dumps({"system": SYSTEM, "question": q, "answer": a}) + "\n")
    print(f"{NUM_TRAIN} train / {NUM_HELDOUT} held-out samples -> {OUT}")


if __name__ == "__main__":
    main()
