"""`\\boxed{...}` extraction with balanced braces, used by `boxed_<type>`, `math` and `deepscaler`."""

from __future__ import annotations


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, braces balanced; None if absent."""
    start, name = max((text.rfind("\\boxed"), "\\boxed"), (text.rfind("\\fbox"), "\\fbox"))
    if start < 0:
        return None
    rest = text[start + len(name) :]
    if rest.startswith(" "):  # `\boxed 5` is valid LaTeX: the next token
        token = rest.split(maxsplit=1)
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for j, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:j]
    return None  # unbalanced: the answer was cut off


def strip_boxed(label: str) -> str:
    """Labels are sometimes stored as `\\boxed{42}`: grade against the inside."""
    inner = last_boxed(label) if "\\boxed" in label else None
    return label if inner is None else inner
