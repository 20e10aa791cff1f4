"""Prompt datasets: jsonl / json / parquet files or a saved Hugging Face dataset directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataError(ValueError):
    pass


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
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
        if isinstance(data, dict):  # {"column": [...]} or {"data": [...]} layouts
            if "data" in data and isinstance(data["data"], list):
                data = data["data"]
            else:
                cols = list(data)
                data = [dict(zip(cols, vals)) for vals in zip(*data.values())]
        return list(data)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not valid JSON: {e}") from None
    return rows


def check_rows(rows: list[dict], prompt_column: str, path: str) -> None:
    if not rows:
        raise DataError(f"data.path = {path!r}: no rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or prompt_column not in r:
            raise DataError(f"{path}: row {i} has no column {prompt_column!r} (data.prompt_column); "
                            f"columns: {sorted(r) if isinstance(r, dict) else type(r).__name__}")
