"""Build speedllm/assets/rl_demo/prompts.jsonl: task=grpo's demo prompts, each with its verifiable answer.

The questions of the SFT demo (tools/build_sft_demo.py: addition, subtraction, the larger of two numbers, the
successor), none of them in its training set, as one chat turn under its system prompt; `answer` reaches the
reward function speedllm.train.rewards.math_answer.

    python tools/build_rl_demo.py
"""

import json
import random

from speedllm.paths import ASSETS
from tools.build_sft_demo import SYSTEM, make_task

OUT = ASSETS / "rl_demo"
NUM_PROMPTS = 1000


def main() -> None:
    seen = set()
    with open(ASSETS / "sft_demo" / "messages.jsonl") as f:
        for line in f:
            seen.update(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
    rng = random.Random(1)
    records = []
    while len(records) < NUM_PROMPTS:
        question, answer = make_task(rng)
        if question not in seen:
            seen.add(question)
            records.append({"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                            "answer": answer})
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
