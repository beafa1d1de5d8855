"""JSON schemas the structured-output tests share."""

# Bounded everywhere, so that even random weights finish inside max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "tall": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "tall"],
    "additionalProperties": False,
}
