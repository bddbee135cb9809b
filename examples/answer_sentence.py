"""A format bonus: the completion ends with the sentence the prompt asks for, "The answer is N."
(configs/cpu_demo.yaml's instruction). Weighted in the config: reward.terms: {correct: 1.0, answer_sentence: 0.1}."""
import re

from grpo.rewards import Completion, register_term

_SENTENCE = re.compile(r"The answer is \$?-?[\d,]*\.?\d+\$?\.?\s*$")


@register_term("answer_sentence", range=(0.0, 1.0), equation="1 if the text ends with 'The answer is <number>.'")
def answer_sentence(c: Completion, cfg) -> float:
    return 1.0 if not c.truncated and _SENTENCE.search(c.text) else 0.0
