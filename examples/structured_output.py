"""Structured output: extract a typed record from free text with the default model.

    python examples/structured_output.py                    # the sample messages below
    python examples/structured_output.py "Hi, I'm Ana Ruiz from Acme, ana@acme.io, call 555-0142."

Each message becomes a ``Contact`` (a dataclass) through one JSON-schema-constrained request: the
engine masks every token that would break the schema, so the reply always parses (unless
``max_tokens`` cuts it: then ``finish_reason`` is ``"length"`` and the example says so). All messages
are extracted concurrently, in the same batches. Needs ``pip install 'asyncinfer[structured]'``.

The schema fixes the record's shape, not its truth: the default 135M model fills every field it must,
and may invent what the message lacks (an e-mail, a phone number, a company) or garble what it has.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import dataclass

from asyncinfer import AsyncEngine, SamplingParams, StructuredOutput


@dataclass(frozen=True)
class Contact:
    name: str
    company: str | None
    email: str | None
    phone: str | None


#: The JSON schema of a Contact. The bounds (string lengths, the patterns) keep a small model's answer short.
CONTACT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "company": {"type": ["string", "null"], "maxLength": 40},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z0-9._-]+@[a-z0-9-]+\\.[a-z.]+$", "maxLength": 60},
                            {"type": "null"}]},
        "phone": {"anyOf": [{"type": "string", "pattern": "^[0-9+() -]{3,20}$"}, {"type": "null"}]},
    },
    "required": ["name", "company", "email", "phone"],
    "additionalProperties": False,
}

MESSAGES = [
    "Hello! This is Grace Hopper from the Navy Lab. Reach me at grace@navy.mil or 555-0100.",
    "hey it's tom (tom.b@example.org), no company, no phone, just wanted to say the demo was great",
    "Please call Ada Lovelace at Analytical Engines Ltd on +44 20 7946 0018.",
]

PARAMS = SamplingParams(max_tokens=120, structured=StructuredOutput.json_schema(CONTACT_SCHEMA))


def prompt(message: str) -> list[dict[str, str]]:
    return [
        {"role": "system",
         "content": "You extract contact details from messages as JSON. Use null for what is missing."},
        {"role": "user", "content": message},
    ]


async def extract(engine: AsyncEngine, messages: list[str]) -> list[Contact | str]:
    """One Contact per message, or why there is none (a reply cut by max_tokens)."""
    outputs = await asyncio.gather(*(engine.generate(prompt(m), PARAMS) for m in messages))
    records: list[Contact | str] = []
    for out in outputs:
        if out.finish_reason != "stop":
            records.append(f"no record: the reply was cut ({out.finish_reason}) after {out.num_output_tokens} tokens")
            continue
        records.append(Contact(**json.loads(out.text)))  # the schema's fields, always: the decoding was constrained
    return records


async def main(messages: list[str]) -> None:
    async with await AsyncEngine.load(max_model_len=1024) as engine:
        for message, record in zip(messages, await extract(engine, messages)):
            print(f"{message}\n  -> {record}\n")


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):  # the usage, not a message
        print(__doc__)
        sys.exit(0)
    flags = [arg for arg in sys.argv[1:] if re.match(r"--?[A-Za-z]", arg)]
    if flags:  # a flag was sent as a message once the model had loaded (`--threads 1`: two messages)
        print(f"structured_output.py: error: unrecognized argument {flags[0]!r}: this example takes messages only "
              "(set OMP_NUM_THREADS=1 for one thread; --help for the usage)", file=sys.stderr)
        sys.exit(2)
    asyncio.run(main(sys.argv[1:] or MESSAGES))
