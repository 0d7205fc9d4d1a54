"""The embedded environments, examples of the environment contract (tools.py; README: Environments and tools).
The embedded SmolLM2-135M writes no tool call, so on it they learn nothing about tools (README says what was
measured); they are where a model that calls tools starts:

    bash run.sh --env calculator    # the embedded arithmetic task, with a calculator tool
    bash run.sh --env guess         # a game with feedback: find a secret number, answered higher or lower

Each is a class: one instance per trajectory, reset(**row) starts it, its public methods are the tools the
model may call, get_reward() (Guess) scores the trajectory. config.EMBEDDED_ENVIRONMENTS gives each the
flags it runs with unless they are given.
"""
import ast
import operator
import random


class Calculator:
    """The embedded arithmetic task ("What is 13 + 14? ...") with a calculator the model may call before it
    answers in \\boxed{}; scored by the task's own rewards (accuracy, format)."""

    def reset(self, **row) -> str:
        return " You can check a sum with the calculate tool."

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression, such as 13 + 14.

        Args:
            expression: numbers with + - * / and parentheses
        """
        return format(_evaluate(ast.parse(expression, mode="eval").body), "g")


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node) -> float:
    """An arithmetic expression's value; ValueError for anything else (names, calls, powers)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


class Guess:
    """Find a secret number from 1 to 10 (drawn from the row's seed: the G trajectories of a row play the same
    number). Each guess is answered "higher", "lower" or "found it"; the reward is 1 if found, less 0.1 for each
    guess after the first (at least 0.5), else 0. With no dataset (--dataset none), reset makes the prompt."""
    high = 10

    def reset(self, seed: int = 0, **row) -> str:
        self.secret, self.guesses, self.found = random.Random(seed).randint(1, self.high), 0, False
        return (f"I am thinking of a whole number from 1 to {self.high}. Find it: call the guess tool with a number, "
                "and I will answer higher, lower or found it.")

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: a whole number from 1 to 10
        """
        if self.found:
            return "you found it already"
        self.guesses += 1
        self.found = number == self.secret
        return "found it" if self.found else "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return max(1.0 - 0.1 * (self.guesses - 1), 0.5) if self.found else 0.0
