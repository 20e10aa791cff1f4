"""Prompt datasets: jsonl / json / parquet files, a saved Hugging Face dataset directory, a Hub dataset id, or
rows given from Python (tandem.GRPOTrainer); then shaped as the job says (data.map, data.system_prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.core.config import JobConfigError
from tandem.core.hub import is_hub_id, load_hub_dataset


class DataError(JobConfigError):
    """A data file (data.path, eval.path) that cannot be trained on: `tandem` prints it in one line."""


def read_dataset(field: str, path: str, name: str | None = None, split: str = "train") -> list[dict[str, Any]]:
    """`field` (data.path, eval.path): a local file or directory (it wins), else a Hub dataset's split."""
    if is_hub_id(path):  # no local path of that name
        return load_hub_dataset(field, path, name, split)
    return load_rows(path)


def shaped(rows: list[dict], data, tokenizer, where: str) -> list[dict]:
    """The job's shaping of each row (data: the job's DataConfig): `map` first (its dict updates the row, as
    Dataset.map), then `system_prompt` into the prompt column."""
    if data.map is not None:
        from tandem.core.loader import load_function

        fn = load_function(data.map)
        rows = [_mapped(fn, r, i, data.map, where) for i, r in enumerate(rows)]
    if data.system_prompt is not None:
        rows = [{**r, data.prompt_column: _with_system(r.get(data.prompt_column), data.system_prompt, tokenizer, i,
                                                       where)} if isinstance(r, dict) else r
                for i, r in enumerate(rows)]
    return rows


SAY_EVERY_S = 10.0  # tokenising a large dataset says how far it is this often


def prompt_table(rows: list[dict], cfg, tokenizer, schemas: list[dict] | None, where: str, say=None):
    """The rows as training reads them: shaped, checked and each prompt tokenised once (the chat template, the
    system prompt, the tools' schemas, max_prompt_length), by the controller at start and by `tandem check` before
    it. A prompt that cannot be is a DataError naming `where` (the file, or the rows given from Python) and the row.
    say: told every SAY_EVERY_S how many rows are tokenised (a large file is minutes of work, never of silence)."""
    import time

    from tandem.rollout.prompts import PromptError, tokenize_prompt
    from tandem.services.orchestrator.prompt_source import PromptTable

    pc, g = cfg.data.prompt_column, cfg.generation
    rows = shaped(rows, cfg.data, tokenizer, where)
    check_rows(rows, pc, where)
    ids, t0, told = [], time.time(), time.time()
    try:
        for i, r in enumerate(rows):
            ids.append(tokenize_prompt(tokenizer, r[pc], max_prompt_length=g.max_prompt_length,
                                       truncate=cfg.data.truncate_long_prompts, row=i, tools=schemas))
            if say is not None and time.time() - told >= SAY_EVERY_S:
                told = time.time()
                say(f"tandem: tokenising the prompts of {where}: {i + 1:,} of {len(rows):,} rows in "
                    f"{told - t0:.0f} s")
    except PromptError as e:
        raise DataError(f"{where}: {e}") from None
    return PromptTable(rows, ids, pc)


def _mapped(fn, row: Any, i: int, spec: str, where: str) -> dict:
    try:
        out = fn(row)
    except Exception as e:
        raise DataError(f"data.map = {spec!r} on {where} row {i} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, dict):
        raise DataError(f"data.map = {spec!r} on {where} row {i} returned {type(out).__name__}; allowed: a dict of "
                        "the columns to add or replace (as Dataset.map)")
    return {**row, **out}


def _with_system(prompt: Any, system: str, tokenizer, i: int, where: str) -> Any:
    if isinstance(prompt, list):  # messages: a system message first, unless the row has its own
        has_own = prompt and isinstance(prompt[0], dict) and prompt[0].get("role") == "system"
        return prompt if has_own else [{"role": "system", "content": system}, *prompt]
    if isinstance(prompt, str):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"data.system_prompt with {where} row {i}'s string prompt: the model's tokenizer has no "
                            "chat template to put a system turn in; allowed: conversational prompts (lists of "
                            "messages), a tokenizer with a chat template, or the instruction written into the prompts")
        return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return prompt  # check_rows names what is wrong with it


def load_rows(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    if p.is_dir():
        import pyarrow as pa

        files = sorted(p.glob("**/data-*.arrow")) or sorted(p.glob("**/*.arrow"))
        if not files:
            raise DataError(f"data.path = {path!r}: a directory without .arrow files (not a saved dataset)")
        rows: list[dict] = []
        for f in files:
            with pa.memory_map(str(f)) as src:
                try:
                    table = pa.ipc.open_stream(src).read_all()
                except pa.ArrowInvalid:
                    table = pa.ipc.open_file(src).read_all()
            rows += table.to_pylist()
        return rows
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save the file as UTF-8") from None
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON: {e}") from None
        return json_rows(data, path)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not valid JSON: {e}") from None
    return rows


def json_rows(data: Any, path: str) -> list:
    """A .json file's rows: a list of rows, {"data": [rows]}, or {column: [values]} with equal lengths.
    Anything else is refused (a {"prompt": "hello"} object would otherwise train on 'h', 'e', 'l'...)."""
    allowed = 'allowed: a list of rows, {"data": [rows]}, or {column: [values, ...]} with equal-length columns'
    if isinstance(data, list):
        return data
    if not isinstance(data, dict):
        raise DataError(f"{path}: a JSON {type(data).__name__} at the top; {allowed}")
    if isinstance(data.get("data"), list):
        return data["data"]
    bad = [k for k, v in data.items() if not isinstance(v, list)]
    if bad:
        raise DataError(f"{path}: column {bad[0]!r} is a {type(data[bad[0]]).__name__}, not a list; {allowed}")
    lengths = {k: len(v) for k, v in data.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(f"{path}: columns of unequal length {lengths} (rows would be dropped); {allowed}")
    cols = list(data)
    return [dict(zip(cols, vals)) for vals in zip(*data.values())]


def check_rows(rows: list[dict], prompt_column: str, path: str) -> None:
    if not rows:
        raise DataError(f"data.path = {path!r}: no rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or prompt_column not in r:
            raise DataError(f"{path}: row {i} has no column {prompt_column!r} (data.prompt_column); "
                            f"columns: {sorted(r) if isinstance(r, dict) else type(r).__name__}")
        if blank(r[prompt_column]):
            raise DataError(f"{path}: row {i}: the prompt ({prompt_column!r}) is {r[prompt_column]!r}, empty or "
                            "whitespace only; allowed: a prompt with text (remove the row)")


def blank(prompt: Any) -> bool:
    """A text prompt of whitespace only, or chat messages whose every content is (a model given nothing to
    answer; the chat template's own tokens would hide it from the tokenizer's empty check)."""
    if isinstance(prompt, str):
        return not prompt.strip()
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return all(isinstance(m.get("content"), str) and not m["content"].strip() for m in prompt)
    return False


def job_rows(cfg, given: dict, section: str) -> tuple[list, str]:
    """The rows of `section` ("data", "eval"), as given from Python (`given`: {section: rows, or a Ray reference to
    them}) or read from its path. -> (rows, where)."""
    rows = given.get(section)
    if rows is not None:
        import ray

        return (ray.get(rows) if isinstance(rows, ray.ObjectRef) else rows), f"the {section} rows given"
    sec = getattr(cfg, section)
    if sec.path is None:
        raise JobConfigError(f"{section}.path: required (a data file, a saved dataset directory or a Hub dataset "
                             "id); null only with rows given from Python (tandem.GRPOTrainer)")
    return read_dataset(f"{section}.path", sec.path, sec.name, sec.split), sec.path


def read_job_data(cfg, datasets: dict, own_process: bool, say):
    """The prompts (and eval prompts) read, shaped, checked and tokenised once, by the controller: workers receive
    token ids. own_process: the controller is a Ray actor of its own, which runs no model (its transformers may stay
    torch-less). -> (the prompts' table, the eval prompts' or None, the tokenizer, the rows' content hash where they
    did not come from a local file)."""
    from tandem.core.compat import load_tokenizer, tokenizer_without_torch
    from tandem.rollout.episodes import job_tool_schemas
    from tandem.services.orchestrator.checkpointer import rows_digest

    tok = (tokenizer_without_torch if own_process else load_tokenizer)(cfg.model.local_dir())
    schemas = job_tool_schemas(cfg, tok)
    rows, where = job_rows(cfg, datasets, "data")
    data, evals = prompt_table(rows, cfg, tok, schemas, where, say), None
    if cfg.eval.path is not None or "eval" in datasets:
        eval_rows, eval_where = job_rows(cfg, datasets, "eval")
        evals = prompt_table(eval_rows, cfg, tok, schemas, eval_where)
    local = "data" not in datasets and Path(cfg.data.path).exists()
    return data, evals, tok, None if local else rows_digest(rows)
