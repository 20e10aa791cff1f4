"""The references generated from the code (a test keeps each in step with the file that shows it): the job file's
fields from the pydantic models (README), every field of the installed TRL's GRPOConfig as Tandem classes it
(docs/trl.md). `python -m tandem.services.devtools.reference [trl]`."""

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


def trl_defaults() -> dict:
    """The installed TRL's GRPOConfig fields and defaults (a CPU config: TRL's bf16 default needs a GPU)."""
    import dataclasses
    import warnings

    import trl

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conf = trl.GRPOConfig(output_dir="trl-fields", use_cpu=True, bf16=False)
    return {f.name: getattr(conf, f.name) for f in dataclasses.fields(conf) if f.init}


def trl_markdown() -> str:
    """docs/trl.md's table: what Tandem does with each name of the installed TRL's GRPOConfig."""
    import enum

    import trl

    from tandem.core.trl import field_table

    def shown(v):
        v = v.value if isinstance(v, enum.Enum) else v
        return "`" + repr(v).replace("|", "\\|")[:40] + "`"
    defaults = trl_defaults()
    out = [f"TRL {trl.__version__}: {len(defaults)} fields (bf16 shown as a CPU config has it; TRL's own default is "
           "true where a GPU has bfloat16).", "", "| TRL field | TRL default | Tandem | how |",
           "| --- | --- | --- | --- |"]
    defaults["output_dir"] = "<model's name>-GRPO"  # not TRL's: the table's own CPU config named one
    out += [f"| `{name}` | {shown(defaults[name])} | {what} | {how} |" for name, what, how in field_table(defaults)]
    return "\n".join(out)


if __name__ == "__main__":
    import sys

    print(trl_markdown() if sys.argv[1:] == ["trl"] else markdown())
