"""The embedded environments, examples of the environment contract (tools.py; README: Environments and tools):

    bash run.sh --env calculator    # the embedded arithmetic task, with a calculator tool
    bash run.sh --env guess         # a game with feedback: find a secret number, answered higher or lower

Each is a class: one instance per trajectory, reset(**row) starts it, its public methods are the tools the
model may call, get_reward() (Guess) scores the trajectory. config.EMBEDDED_ENVIRONMENTS gives each the
flags it runs with unless they are given.

The embedded SmolLM2-135M writes no tool call by itself (README says what was measured), so these start the
model's call turns with the opening of the call (turn_prefix(): given tokens, not sampled, no loss): the model
writes the arguments and closes the call, then reads the answer. What it learns is what to call with and what
to do with the answer, not when to call. For a model that calls tools by itself, set `prefill = False`.
"""
import ast
import json
import operator
import random


def call_opening(name: str, argument: str) -> str:
    """The text of a call of tool `name` up to the value of its one argument, as the tool template writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"{argument}": '


class Calculator:
    """The embedded arithmetic task ("What is 13 + 14? ...") with a calculator the model may call before it
    answers in \\boxed{}; scored by --reward_funcs (accuracy, format: an environment's conversation is its own, so the
    embedded task's system prompt and rewards do not apply). Its first turn starts with a call
    of calculate, up to the expression's opening quote."""
    prefill = True

    def reset(self, **row) -> str:
        self.turns = 0
        return " You can check a sum with the calculate tool."

    def turn_prefix(self) -> str:
        self.turns += 1
        return call_opening("calculate", "expression") + '"' if self.prefill and self.turns == 1 else ""

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
    """Find a secret number from 1 to 10 (drawn from the row's seed, or from the whole row if it has none: the G
    trajectories of a row play the same number). Each guess is answered "higher", "lower" or "found it"; the reward is 1 if found, less 0.1 for each
    guess after the first (at least 0.5), else 0. With no dataset (--dataset none), reset makes the prompt. Each
    turn until the number is found starts with a call of guess, up to the number."""
    high = 10
    prefill = True

    def reset(self, seed: int | None = None, **row) -> str:
        draw = random.Random(json.dumps(row, sort_keys=True, default=str) if seed is None else seed)  # a row, a number
        self.secret, self.guesses, self.found = draw.randint(1, self.high), 0, False
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

    def turn_prefix(self) -> str:
        return call_opening("guess", "number") if self.prefill and not self.found else ""

    def get_reward(self) -> float:
        return max(1.0 - 0.1 * (self.guesses - 1), 0.5) if self.found else 0.0
