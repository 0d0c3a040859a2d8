"""Built-in reward functions for task=grpo, with TRL's signature: `fn(prompts, completions, **columns) -> list[float]`.

`completions` are texts (or, for chat prompts, [{"role": "assistant", "content": text}] as TRL passes them);
`columns` are the dataset's other fields as lists, plus `completion_ids`. Use them in `rl.rewards` by
`_target_`; keys of an entry other than `_target_` and `weight` are bound as keyword arguments:

    rl.rewards='[{_target_: speedllm.train.rewards.math_answer, weight: 1.0},
                 {_target_: speedllm.train.rewards.think_format, weight: 0.2}]'

A leaf module: plain Python, nothing from speedllm.
"""

import re
from typing import List, Optional

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*(\S.*)$", re.DOTALL)


def completion_text(completion) -> str:
    """The text of a completion as TRL passes it: a string, or a list of messages (the last assistant message's
    content: a multi-turn conversation cut inside a tool's response is not answered by the tool's text)."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def _boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} (braces nested), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> Optional[str]:
    """What a completion answers: the last \\boxed{} if any, else the text after </think>'s last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text.split("</think>")[-1])
    return numbers[-1] if numbers else None


def _same(answer: str, truth: str) -> bool:
    try:
        from math_verify import parse, verify  # symbolic equality when installed

        return bool(verify(parse(f"${truth}$"), parse(f"${answer}$")))
    except ImportError:
        pass
    try:
        return float(eval_fraction(answer)) == float(eval_fraction(truth))
    except ValueError:
        return answer.strip() == truth.strip()


def eval_fraction(text: str) -> float:
    """A number written as an integer, decimal or a/b."""
    num, _, den = text.replace(",", "").strip().partition("/")
    return float(num) / float(den) if den else float(num)


def math_answer(prompts, completions, answer, **columns) -> List[float]:
    """1.0 where the completion's final answer (its last \\boxed{}, else its last number) equals the record's
    `answer` (numerically; symbolically with math-verify installed), else 0.0. An accuracy reward."""
    rewards = []
    for completion, truth in zip(completions, answer):
        found = final_answer(completion_text(completion))
        rewards.append(float(found is not None and _same(found, str(truth))))
    return rewards


def math_closeness(prompts, completions, answer, **columns) -> List[float]:
    """1 / (1 + |final answer − the record's `answer`|) where both are numbers, else 0.0: 1 for the right number,
    1/2 one off, 1/11 ten off. Partial credit for a model that seldom answers exactly but often nearly (the
    demo's starting checkpoint), so that most groups carry an advantage."""
    rewards = []
    for completion, truth in zip(completions, answer):
        found = final_answer(completion_text(completion))
        try:
            rewards.append(1.0 / (1.0 + abs(eval_fraction(found) - eval_fraction(str(truth)))))
        except (TypeError, ValueError, ZeroDivisionError, AttributeError):  # no number, or not a number
            rewards.append(0.0)
    return rewards


def think_format(prompts, completions, **columns) -> List[float]:
    """1.0 where the completion is `<think>...</think>` followed by a non-empty answer, else 0.0."""
    return [float(_THINK.match(completion_text(c)) is not None) for c in completions]


def length_penalty(prompts, completions, completion_ids, max_tokens: int, buffer: int, penalty: float = 1.0,
                   **columns) -> List[float]:
    """DAPO's soft overlong punishment: 0 up to max_tokens − buffer tokens, then falling linearly to −penalty at
    max_tokens and beyond."""
    start = max_tokens - buffer
    return [-penalty * min(max(len(ids) - start, 0) / buffer, 1.0) for ids in completion_ids]
