"""How the stores write Python values as Redis hash fields: strings and numbers as they
are, anything else as JSON."""

from __future__ import annotations

import json
from typing import Any


def field_value(value: Any) -> str | int | float:
    return value if isinstance(value, (str, int, float)) else json.dumps(value)


def flat_fields(fields: dict[str, Any]) -> list[Any]:
    """A record's fields as a script's name, value, name, value arguments."""
    return [x for k, v in fields.items() for x in (k, field_value(v))]
