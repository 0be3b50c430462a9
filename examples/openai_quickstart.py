"""An ordinary OpenAI SDK script: nothing in it knows about InferenceBackend except the
model's name. Point it at the fleet's gateway with the SDK's own environment variables:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<your key> python examples/openai_quickstart.py

It asks one chat question, streams another, asks for an answer shaped by a pydantic model
(structured output) and for a tool call, then runs a small offline batch through
/v1/files and /v1/batches and prints the results file.
"""

import io
import json
import os
import time

from openai import OpenAI
from pydantic import BaseModel, Field

client = OpenAI()
model = os.environ.get("MODEL", "smollm2-135m")

reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32, temperature=0
)
print("chat:", reply.choices[0].message.content.strip())

print("stream: ", end="", flush=True)
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=40, stream=True
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


parsed = client.chat.completions.parse(
    model=model, messages=[{"role": "user", "content": "Tell me about Paris."}], response_format=City, temperature=0
)
print("structured:", parsed.choices[0].message.parsed)

weather = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
called = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
    tools=[weather],
    tool_choice={"type": "function", "function": {"name": "get_weather"}},
    temperature=0,
)
call = called.choices[0].message.tool_calls[0]
print(f"tool call: {call.function.name}({call.function.arguments})")

questions = ["Name a primary colour.", "What is 7 times 6?", "Say hello in German."]
requests = "".join(
    json.dumps(
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0},
        }
    )
    + "\n"
    for i, q in enumerate(questions)
)
uploaded = client.files.create(file=("questions.jsonl", io.BytesIO(requests.encode())), purpose="batch")
batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(1)
    batch = client.batches.retrieve(batch.id)
print(f"batch {batch.id}: {batch.status}, {batch.request_counts.completed}/{batch.request_counts.total} completed")
if batch.output_file_id:
    for line in client.files.content(batch.output_file_id).text.splitlines():
        record = json.loads(line)
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        print(f"  {record['custom_id']}: {' '.join(answer.split())}")
