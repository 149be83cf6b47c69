"""Drives a running `mlxcel serve` with the official `openai` Python client (PyPI `openai`).

Run by tests/tests/server.rs (`openai_python_client`): argv[1] is the server's base URL, argv[2] a
JSON file of what to expect (the API key, the model ids, greedy texts from `Model::generate`,
embedding vectors from `Embedder::embed`). Exits non-zero with the failed check's message.
"""

import json
import sys

import openai
from pydantic import BaseModel


def check(cond, what):
    if not cond:
        raise SystemExit(f"FAILED: {what}")


def main():
    base, expect_path = sys.argv[1], sys.argv[2]
    expect = json.load(open(expect_path))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=expect["api_key"], max_retries=0)
    model = expect["model"]
    user = [{"role": "user", "content": expect["chat_prompt"]}]

    ids = [m.id for m in client.models.list().data]
    check(model in ids and expect["embedding_model"] in ids, f"models.list: {ids}")

    # Chat, greedy, not streamed: the text `mlxcel generate` gives, with usage.
    r = client.chat.completions.create(model=model, messages=user, max_tokens=8, temperature=0)
    check(r.choices[0].message.content == expect["chat_greedy"], f"chat: {r.choices[0].message.content!r}")
    check(r.choices[0].message.role == "assistant", "role")
    check(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    u = r.usage
    check(u.prompt_tokens > 0 and u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage {u}")

    # Streamed, with usage in a last chunk.
    text, usage = "", None
    for chunk in client.chat.completions.create(
        model=model, messages=user, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    check(text == expect["chat_greedy"], f"streamed chat: {text!r}")
    check(usage is not None and usage.completion_tokens == u.completion_tokens, f"streamed usage {usage}")

    # Text completions.
    r = client.completions.create(model=model, prompt=expect["completion_prompt"], max_tokens=6, temperature=0)
    check(r.choices[0].text == expect["completion_greedy"], f"completion: {r.choices[0].text!r}")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model, prompt=expect["completion_prompt"], max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    check(streamed == expect["completion_greedy"], f"streamed completion: {streamed!r}")

    # Embeddings.
    r = client.embeddings.create(model=expect["embedding_model"], input=expect["embedding_inputs"])
    check(len(r.data) == len(expect["embeddings"]), "embedding count")
    for got, want in zip(r.data, expect["embeddings"]):
        diff = max(abs(a - b) for a, b in zip(got.embedding, want))
        check(len(got.embedding) == len(want) and diff <= 1e-6, f"embedding max |d| {diff}")

    # Logprobs: one entry per generated token, the top ones sorted, the picked one among them
    # (greedy).
    r = client.chat.completions.create(
        model=model, messages=user, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens, f"{len(content)} logprobs for {r.usage.completion_tokens} tokens")
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        check(len(tops) == 3 and tops == sorted(tops, reverse=True), f"top_logprobs {tops}")
        check(abs(e.logprob - tops[0]) < 1e-6 and e.logprob <= 0, f"greedy token's logprob {e.logprob} vs {tops}")
    spelled = "".join(e.token for e in content)
    check("\ufffd" in spelled or spelled == r.choices[0].message.content, "logprob tokens spell the reply")

    # Tool calls, forced: parsed into tool_calls, streamed as deltas.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
                    "required": ["city", "days"],
                },
            },
        }
    ]
    r = client.chat.completions.create(
        model=model, messages=user, tools=tools, tool_choice="required", max_tokens=160, temperature=1.0, seed=3
    )
    msg = r.choices[0].message
    check(r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, f"tool call: {r.choices[0]}")
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    check(call.function.name == "get_weather" and isinstance(args["city"], str) and isinstance(args["days"], int), f"args {args}")
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(
        model=model, messages=user, tools=tools, tool_choice="required", max_tokens=160, temperature=1.0, seed=3, stream=True
    ):
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            name += d.function.name or ""
            arguments += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    check((name, json.loads(arguments), finish) == ("get_weather", args, "tool_calls"), f"streamed call {name} {arguments} {finish}")
    # The call and its result go back into the conversation.
    history = user + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "{\"temp\": 21}"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=tools, max_tokens=4)
    check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), "tool history")

    # Structured output: a pydantic model through the client's parse helper, and a raw schema.
    class Person(BaseModel):
        name: str
        age: int
        likes_tea: bool

    r = client.chat.completions.parse(
        model=model, messages=user, response_format=Person, max_tokens=60, temperature=1.0, seed=1
    )
    person = r.choices[0].message.parsed
    check(isinstance(person, Person), f"parsed {r.choices[0].message.content!r}")
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["tags"]}
    r = client.chat.completions.create(
        model=model,
        messages=user,
        max_tokens=40,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema, "strict": True}},
    )
    tags = json.loads(r.choices[0].message.content)["tags"]
    check(isinstance(tags, list) and len(tags) <= 3 and all(t in ("a", "b") for t in tags), f"tags {tags}")

    # Errors arrive as the client's exception types, naming the field.
    try:
        client.chat.completions.create(model=model, messages=user, n=2)
        check(False, "n=2 accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.body["param"] == "n", f"n=2: {e.body}")
    try:
        client.chat.completions.create(
            model=model, messages=user, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a"}}}
        )
        check(False, "pattern accepted")
    except openai.BadRequestError as e:
        check("pattern" in e.body["param"], f"pattern: {e.body}")
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        check(False, "wrong key accepted")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "401")
    print(f"ok: openai {openai.__version__}: chat, completions, embeddings, logprobs, tool calls, json_schema, errors")


if __name__ == "__main__":
    main()
