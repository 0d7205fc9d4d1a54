"""Agents that call tools the OpenAI way, passed as --env tests.agents_with_tools:NAME (tests/test_agent_tools.py):
`tools=[...]` in client.chat.completions.create, the calls read from `message.tool_calls`, their results sent back
as `role: "tool"` messages, as verifiers' ToolEnv and the OpenAI Agents SDK do."""
import json
import re

from transformers.utils import get_json_schema

from embedded import Calculator

CALCULATE = get_json_schema(Calculator.calculate)
ANSWERS = []  # what each answer with tool calls said, in this process: (finish_reason, the calls' names)


async def calculator_agent(client, row, as_dicts: bool = False):
    """verifiers' ToolEnv loop on the calculator's sums: the answer is appended to the conversation as the SDK's
    message (or, `as_dicts`, as the Agents SDK writes it: a dict whose tool calls are dicts), each call's result
    as a tool message, until an answer calls no tool (at most 3 answers). Its reward: 1 for the right sum in
    \\boxed{}."""
    calculator = Calculator()
    messages = [{"role": "user", "content": row["prompt"] + calculator.reset()}]
    for _ in range(3):
        response = await client.chat.completions.create(model=client.model, messages=messages, tools=[CALCULATE],
                                                        max_tokens=48)
        choice = response.choices[0]
        message = choice.message
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            call.model_dump() for call in message.tool_calls or []]} if as_dicts else message)
        if not message.tool_calls:
            break
        ANSWERS.append((choice.finish_reason, [call.function.name for call in message.tool_calls]))
        for call in message.tool_calls:
            try:
                result = calculator.calculate(**json.loads(call.function.arguments))
            except Exception as e:  # the model's arguments: an error it reads
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    boxed = re.findall(r"\\boxed\{(-?\d+)\}", message.content or "")
    return float(bool(boxed) and boxed[-1] == str(row["answer"]))


async def calculator_agent_with_dicts(client, row):
    return await calculator_agent(client, row, as_dicts=True)


async def biased_to_the_end_of_turn(client, row):
    """Two calls, each with a logit bias that makes the row's `end_of_turn` token the answer's every token: the
    answer is that token alone where the server stops there, else max_tokens of it."""
    bias = {str(row["end_of_turn"]): 100}
    messages = [{"role": "user", "content": "Hi"}]
    first = await client.chat.completions.create(model=client.model, messages=messages, max_tokens=6, logit_bias=bias)
    messages += [first.choices[0].message, {"role": "user", "content": "And?"}]
    await client.chat.completions.create(model=client.model, messages=messages, max_tokens=6, logit_bias=bias)
    return 0.0
