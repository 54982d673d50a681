"""The programs of `plait bench programs` written directly on `transformers`: the same ChatML
text, `model.generate` for each `gen` and one forward per `select` choice, no prefix cache."""

from __future__ import annotations

import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from plait.runtime.thirdparty import import_transformers

ARGUMENT_FALLBACK = {"calculator": " 0", "lookup": " unknown"}


class Outcome(NamedTuple):
    text: str  # the whole text the program built
    value: Any  # the label (fewshot), the answer (tot), the number of tool calls (agent)


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def open_turn(role: str) -> str:
    return f"<|im_start|>{role}\n"


END = "<|im_end|>\n"


def fewshot_baseline(example: ModuleType) -> Callable[[Any, dict[str, Any]], Outcome]:
    def run(lm: Any, item: dict[str, Any]) -> Outcome:
        text = turn("system", "Label each movie review as positive or negative.")
        text += "".join(turn("user", t) + turn("assistant", label) for t, label in example.SHOTS)
        text += turn("user", item["review"]) + open_turn("assistant")
        label = lm.select(text, ["positive", "negative"])
        return Outcome(text + label + END, label)

    return run


def tot_baseline(lm: Any, item: dict[str, Any]) -> Outcome:
    width = item["width"]
    head = turn("system", "You solve problems step by step.") + turn("user", item["question"])
    head += open_turn("assistant") + "Let me try different approaches.\n"
    plans = []
    for i in range(width):
        branch = head + f"Approach {i + 1}:"
        plan = lm.gen(branch, 16, stop="\n", temperature=0.7, min_tokens=3)
        for _ in range(width):
            lm.gen(branch + plan + "\nCheck:", 10, stop="\n", temperature=0.7, min_tokens=3)
        plans.append(plan)
    text = head + "".join(f"Approach {i + 1}: {p.strip()}\n" for i, p in enumerate(plans))
    text += "The best approach is"
    text += lm.select(text, [f" {i + 1}" for i in range(width)]) + ". Answer:"
    answer = lm.gen(text, 12, stop="\n")
    return Outcome(text + answer + END, answer)


def constrain(text: str, regex: str, fallback: str) -> str:
    """The longest prefix of `text` matching `regex` (the stand-in for constrained decoding)."""
    for end in range(len(text), 0, -1):
        if re.fullmatch(regex, text[:end]):
            return text[:end]
    return fallback


def agent_baseline(example: ModuleType) -> Callable[[Any, dict[str, Any]], Outcome]:
    def run(lm: Any, item: dict[str, Any], max_steps: int = 3) -> Outcome:
        text = turn("system", example.SYSTEM) + "".join(turn(r, c) for r, c in example.EXAMPLE)
        text += turn("user", f"Question: {item['question']}")
        calls = 0
        for step in range(max_steps):
            text += open_turn("assistant") + "Action:"
            action = lm.select(text, [" calculator", " lookup"] + ([" finish"] if step else []))
            text += action
            name = action.strip()
            if name == "finish":
                text += END
                break
            text += "\nInput:"
            raw = lm.gen(text, 12, stop="\n")
            argument = constrain(raw, example.ARGUMENT_REGEX[name], ARGUMENT_FALLBACK[name])
            text += argument + END
            text += turn("user", f"Observation: {example.TOOLS[name](argument)}")
            calls += 1
        text += open_turn("assistant") + "Answer:"
        return Outcome(text + lm.gen(text, 16, stop="\n") + END, calls)

    return run


class TransformersLM:
    """`gen` and `select` on a transformers model, one request at a time, no prefix cache."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.prompt_tokens = 0
        self.computed_tokens = 0  # prefill + decode steps actually run, as the engine counts

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def gen(
        self,
        text: str,
        max_tokens: int,
        stop: str = "\n",
        temperature: float = 0.0,
        min_tokens: int = 0,
    ) -> str:
        import torch

        ids = self.encode(text)
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = self.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            stop_strings=[stop],
            tokenizer=self.tokenizer,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.eos_token_id,
            **(sampling if temperature > 0 else {"do_sample": False}),
        )
        new = out[0, len(ids) :].tolist()
        self.prompt_tokens += len(ids)
        self.computed_tokens += len(ids) + max(len(new) - 1, 0)
        return self.tokenizer.decode(new, skip_special_tokens=True).split(stop)[0]

    def select(self, text: str, choices: list[str]) -> str:
        import torch

        prompt = self.encode(text)
        scores = []
        for choice in choices:
            full = self.encode(text + choice)
            k = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), len(prompt))
            k = max(1, min(k, len(full) - 1))  # choice tokens: full[k:], merged ones included
            # [len(full) - k + 1, vocab]: logits for the last prompt token and the choice's
            logits = self.model(torch.tensor([full]), logits_to_keep=len(full) - k + 1).logits[0]
            logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
            picked = logprobs.gather(1, torch.tensor(full[k:]).unsqueeze(1))
            scores.append(picked.mean().item())
            self.prompt_tokens += len(full)
            self.computed_tokens += len(full)
        return choices[max(range(len(choices)), key=lambda i: (scores[i], -i))]


def load_transformers_lm(model_path: str | None, dtype: Any) -> TransformersLM:
    import os

    transformers = import_transformers()

    from plait.benchmarks.throughput import load_transformers
    from plait.runtime.model_loader.locate import locate_checkpoint

    transformers.logging.set_verbosity_error()
    loc = locate_checkpoint(model_path)
    if loc.kind == "gguf":
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(loc.path), gguf_file=os.path.basename(loc.path)
        )
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(loc.path)
    return TransformersLM(load_transformers(model_path, dtype), tokenizer)
