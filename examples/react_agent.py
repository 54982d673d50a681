"""A ReAct-style agent: `select` picks the action, `gen(regex=...)` writes its argument, and
real Python tools (a calculator and a small dictionary) produce the observations. The first
action must be a tool (a 135M model would otherwise answer from memory); then the model may
use more tools or finish.

    python examples/react_agent.py
"""

from __future__ import annotations

import ast
import operator

import plait
from plait import gen, program, select, system, user

DICTIONARY = {
    "plait": "a braid of hair or other material",
    "cache": "a store of things kept for later use",
}
ARGUMENT_REGEX = {"calculator": r" [0-9][0-9+\-*/. ()]{0,18}", "lookup": r" [a-z]{1,12}"}
SYSTEM = (
    "You answer questions with tools. Each turn pick one action: calculator (arithmetic), "
    "lookup (the meaning of a word) or finish (give the answer)."
)
EXAMPLE = [  # worked examples, as turns, so the model sees the format
    ("user", "Question: What is 6 times 7?"),
    ("assistant", "Action: calculator\nInput: 6 * 7"),
    ("user", "Observation: 42"),
    ("assistant", "Action: finish"),
    ("assistant", "Answer: 6 times 7 is 42."),
    ("user", "Question: What does the word radix mean?"),
    ("assistant", "Action: lookup\nInput: radix"),
    ("user", "Observation: the base of a number system"),
    ("assistant", "Action: finish"),
    ("assistant", "Answer: A radix is the base of a number system."),
]
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculator(expression: str) -> str:
    """Evaluate + - * / arithmetic on numbers (no names, no calls)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("unsupported expression")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result) if float(result).is_integer() else round(result, 6))


def lookup(word: str) -> str:
    """The meaning of a word, from a small dictionary."""
    return DICTIONARY.get(word.strip().lower(), "not in the dictionary")


TOOLS = {"calculator": calculator, "lookup": lookup}


@program
def agent(s, question, max_steps=3):
    s += system(SYSTEM)
    for role, content in EXAMPLE:
        s += plait.role(role, content)
    s += user(f"Question: {question}")
    for step in range(max_steps):
        actions = [" calculator", " lookup"] + ([" finish"] if step else [])  # a tool first
        with s.assistant():
            s += "Action:" + select("action", actions)
            action = s["action"].strip()
            if action == "finish":
                break
            s += "\nInput:" + gen(
                "input", regex=ARGUMENT_REGEX[action], stop="\n", max_tokens=12, temperature=0
            )
        observation = TOOLS[action](s["input"])
        s.set_var("observation", observation)
        s += user(f"Observation: {observation}")
    with s.assistant():
        s += "Answer:" + gen("answer", max_tokens=16, stop="\n", temperature=0)


def main(backend: plait.Backend | None = None) -> list[plait.ProgramState]:
    backend = backend or plait.Runtime()
    questions = ["What is 17 times 23?", "What does the word plait mean?"]
    states = agent.run_batch([{"question": q} for q in questions], backend=backend)
    for question, state in zip(questions, states):
        print(f"Q: {question}")
        turns = state.messages()[len(EXAMPLE) + 2 :]
        print("\n".join(f"  {m['role']}: {m['content']}" for m in turns))
    return states


if __name__ == "__main__":
    main()
