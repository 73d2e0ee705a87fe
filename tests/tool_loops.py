"""Real tool-calling loops against a running farm, shared by the end-to-end tests of both engines
(tests/test_e2e_openai.py: built-in workers, prefill and decode; tests/vllm: vLLM workers): the openai SDK, OpenAI's
Agents SDK running its own loop, and the anthropic SDK, each streamed and not where the client streams."""

from __future__ import annotations

import json

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_REPORT = "18 degrees Celsius and sunny"


def openai_sdk_loop(base_url: str, model: str) -> None:
    """A forced call (tool_choice required: structured output; on a disaggregated farm its first token is sampled on
    the prefill worker under the grammar, the rest on the decode worker), streamed and not, a named call, the tool's
    result sent back, and the model's text answer."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "London", "Tokyo")

    stream = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL],
                                            tool_choice="required", max_tokens=60, temperature=0, stream=True)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for d in delta.tool_calls or []:
            got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            got["id"] += d.id or ""
            got["name"] += (d.function.name or "") if d.function else ""
            got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reasons[-1] == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # greedy: the same call

    history = ask + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": WEATHER_REPORT}]
    answer = client.chat.completions.create(model=model, messages=history, tools=[WEATHER_TOOL],
                                            tool_choice="none", max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=model, messages=ask, tools=[WEATHER_TOOL],
                                           tool_choice="none", max_tokens=1, temperature=0)
    assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20  # the call and its result are in the prompt
    named = client.chat.completions.create(
        model=model, messages=ask, tools=[WEATHER_TOOL], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments)["city"] in ("Paris", "London", "Tokyo")


def agent_loop(base_url: str, model: str) -> None:
    """OpenAI's Agents SDK with its own loop: the model must call the tool (required), the SDK runs it and sends the
    result back (with tool_choice reset to auto, read by the model's hermes parser), and the run ends in text."""
    import asyncio

    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        seen.append(city)
        return f"{city}: {WEATHER_REPORT}"

    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer with the weather tool's help.", tools=[get_weather],
                  model=OpenAIChatCompletionsModel(model=model, openai_client=api),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(seen) >= 1  # the SDK parsed the farm's call and ran the tool
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds.index("tool_call_item") < kinds.index("tool_call_output_item") < kinds.index("message_output_item")


def anthropic_sdk_loop(base_url: str, model: str) -> None:
    """/v1/messages with tools: tool_choice any (forced) gives a tool_use block, streamed as Anthropic streams it; the
    tool_result sent back is answered with text."""
    import anthropic

    ac = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    fn = WEATHER_TOOL["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    first = ac.messages.create(model=model, max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "London", "Tokyo")
    with ac.messages.stream(model=model, max_tokens=60, messages=ask, tools=tools,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True},
                            extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and streamed.input == use.input  # greedy: the same call, streamed
    history = ask + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": WEATHER_REPORT}]}]
    answer = ac.messages.create(model=model, max_tokens=30, messages=history, tools=tools,
                                tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
