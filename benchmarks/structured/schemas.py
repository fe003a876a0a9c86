"""The structured workload: five JSON schemas of 3 to 12 fields (a person, an order with line
items, an address with an enum country, an event with a date and optional fields, a product with
nested objects), chat prompts that ask for one of them from seeded random facts, and the checks
of an answer (``json.loads`` and ``jsonschema`` with its format checker)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import jsonschema

_S, _I, _B, _N = ({"type": t} for t in ("string", "integer", "boolean", "number"))


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


# name -> schema; each top-level object has 3-12 fields.
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({
        "name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": _S, "occupation": _S, "employed": _B}),
    "order": _obj({
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"}, "customer": _S,
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": _obj({
            "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "name": _S,
            "quantity": {"type": "integer", "minimum": 1}, "unit_price": _N})},
        "currency": {"enum": ["USD", "EUR", "GBP"]}, "total": _N}),
    "address": _obj({
        "street": _S, "city": _S, "postal_code": _S,
        "country": {"enum": ["US", "GB", "DE", "FR", "JP", "CA"]}}),
    "event": _obj({
        "title": _S, "date": {"type": "string", "format": "date"},
        "start_time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "location": _S, "attendees": {"type": "integer", "minimum": 0}, "online": _B,
        "organizer": _S}, required=["title", "date", "online"]),
    "product": _obj({
        "name": _S, "sku": _S, "price": {"type": "number", "minimum": 0}, "in_stock": _B,
        "dimensions": _obj({"width_cm": _N, "height_cm": _N, "depth_cm": _N}),
        "manufacturer": _obj({"name": _S, "country": _S}),
        "tags": {"type": "array", "items": _S, "maxItems": 4}}),
}

SYSTEM = "You extract facts into JSON. Reply with the JSON object only."
_FIRST = ["Ada", "Maria", "Kenji", "Lena", "Omar", "Priya", "Tom", "Sofia", "Lukas", "Amara"]
_LAST = ["Lovelace", "Chen", "Tanaka", "Novak", "Haddad", "Patel", "Berg", "Rossi", "Weber"]
_JOBS = ["nurse", "software engineer", "teacher", "chef", "architect", "pilot", "accountant"]
_CITIES = [("London", "GB", "SW1A 1AA"), ("Berlin", "DE", "10115"), ("Paris", "FR", "75001"),
           ("Osaka", "JP", "530-0001"), ("Toronto", "CA", "M5H 2N2"), ("Austin", "US", "73301")]
_STREETS = ["Baker Street", "Hauptstrasse", "Rue de Rivoli", "Maple Avenue", "Queen Street"]
_GOODS = [("mechanical keyboard", 89.0), ("USB-C cable", 9.5), ("desk lamp", 34.0),
          ("notebook", 4.25), ("coffee grinder", 59.9), ("water bottle", 18.0)]
_EVENTS = ["Quarterly planning", "Python meetup", "Board review", "Team offsite", "Book club"]


def _person(rng: random.Random) -> str:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    job, age = rng.choice(_JOBS), rng.randint(19, 77)
    status = rng.choice(["works full time", "works part time", "is looking for work"])
    return (f"{first} {last} is {age} years old, a {job} who {status}. You can reach "
            f"{first} at {first.lower()}.{last.lower()}@example.com.")


def _order(rng: random.Random) -> str:
    lines = []
    for item, price in rng.sample(_GOODS, rng.randint(1, 3)):
        sku = f"{item[:2].upper()}{rng.randint(100, 999)}"
        lines.append(f"{rng.randint(1, 4)} x {item} (SKU {sku}) at {price:.2f} each")
    currency = rng.choice(["USD", "EUR", "GBP"])
    return (f"Order ORD-{rng.randint(1000, 9999)} from {rng.choice(_FIRST)} "
            f"{rng.choice(_LAST)}, paid in {currency}: {'; '.join(lines)}.")


def _address(rng: random.Random) -> str:
    city, country, postal = rng.choice(_CITIES)
    return (f"Please ship it to {rng.randint(1, 220)} {rng.choice(_STREETS)}, {city} "
            f"{postal}, country code {country}.")


def _event(rng: random.Random) -> str:
    title = rng.choice(_EVENTS)
    day = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    where = rng.choice(["online, on the usual video call", f"in room {rng.randint(1, 40)}"])
    return (f"{title} on {day} at {rng.randint(8, 18):02d}:{rng.choice(['00', '30'])}, "
            f"{where}; about {rng.randint(5, 60)} people are expected, hosted by "
            f"{rng.choice(_FIRST)}.")


def _product(rng: random.Random) -> str:
    item, price = rng.choice(_GOODS)
    maker = rng.choice(["Acme", "Nordlicht", "Kaizen Works", "Lumen & Co"])
    w, h, d = (rng.randint(5, 60) for _ in range(3))
    stock = rng.choice(["in stock", "sold out"])
    return (f"The {maker} {item} (SKU {maker[:3].upper()}-{rng.randint(10, 99)}) costs "
            f"{price:.2f}, is {stock}, measures {w} x {h} x {d} cm and is made in "
            f"{rng.choice(['Germany', 'Japan', 'Canada', 'Portugal'])}. Tags: home, office.")


_FACTS = {"person": _person, "order": _order, "address": _address, "event": _event,
          "product": _product}


@dataclass(frozen=True)
class Task:
    """One request of the workload: its schema's name and its chat messages."""

    schema: str
    messages: list[dict[str, str]]

    @property
    def schema_json(self) -> dict[str, Any]:
        return SCHEMAS[self.schema]


def tasks(count: int, seed: int = 0) -> list[Task]:
    """``count`` requests, the schemas in turn, each with its own seeded facts."""
    rng = random.Random(seed)
    names = list(SCHEMAS)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        facts = _FACTS[name](rng)
        out.append(Task(name, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": f"Extract the {name} as JSON.\n\n"
                                                           f"{facts}"}]))
    return out


def one_per_schema(work: list[Task]) -> list[Task]:
    """The first task of each schema: a warm-up that compiles every grammar once."""
    first: dict[str, Task] = {}
    for task in work:
        first.setdefault(task.schema, task)
    return list(first.values())


@dataclass
class Answer:
    """One request's outcome: its schema, text, finish reason (``stop``, ``length``, ...) and
    completion tokens (the stop token counted, as the engine's usage counts it)."""

    schema: str
    text: str
    finish_reason: str
    completion_tokens: int


def valid(answer: Answer) -> bool:
    """Whether the answer's text parses as JSON and matches its schema (formats checked)."""
    try:
        value = json.loads(answer.text)
    except ValueError:
        return False
    validator = jsonschema.Draft202012Validator(
        SCHEMAS[answer.schema], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(value)


def summarize(answers: list[Answer], wall_s: float) -> dict[str, Any]:
    """Output tokens/s (completion tokens over the run's wall seconds), answers by finish
    reason and the share of ``stop`` answers valid per their schema (0-1; None without any)."""
    stopped = [a for a in answers if a.finish_reason == "stop"]
    n_valid = sum(valid(a) for a in stopped)
    tokens = sum(a.completion_tokens for a in answers)
    return {"requests": len(answers), "completion_tokens": tokens, "wall_s": wall_s,
            "tok_s": tokens / wall_s if wall_s > 0 else None,
            "stop": len(stopped), "length": sum(a.finish_reason == "length" for a in answers),
            "other": sum(a.finish_reason not in ("stop", "length") for a in answers),
            "valid": n_valid, "valid_share": n_valid / len(stopped) if stopped else None,
            "invalid_examples": [a.text[:200] for a in stopped if not valid(a)][:3]}
