"""The job file reference, generated from the pydantic models (README embeds it; a test keeps
them in step): `python -m tandem.services.devtools.reference`."""

from __future__ import annotations

from pydantic import BaseModel

from tandem.core.config import JobConfig


def _default(f) -> str:
    if f.is_required():
        return "required"
    v = f.get_default(call_default_factory=True)
    if isinstance(v, BaseModel):
        return "(section)"
    return "null" if v is None else f"`{v}`"


def rows(model=JobConfig, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        sub = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
        if sub is not None:
            out += rows(sub, f"{prefix}{name}.")
            if getattr(ann, "__args__", None):  # optional section (model.lora: null = full fine-tuning)
                out.append(f"| `{prefix}{name}` | {_default(f)} | {f.description or ''} |")
            continue
        out.append(f"| `{prefix}{name}` | {_default(f)} | {f.description or ''} |")
    return out


def markdown() -> str:
    return "\n".join(["| field | default | meaning |", "| --- | --- | --- |", *rows()])


if __name__ == "__main__":
    print(markdown())
