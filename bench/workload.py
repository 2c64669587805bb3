"""What the benchmarks share: the fixed prompt list and the percentile they all report."""

from __future__ import annotations

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What does a compiler do?",
    "Suggest a name for a grey cat.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "List four primary school subjects.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Describe a rainy afternoon in a small town.",
    "What is the difference between a list and a tuple in Python?",
    "Recommend a book for someone who likes science fiction.",
    "How do I boil an egg?",
]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
