"""Tokenising a dataset says how far it is while it runs (services/orchestrator/data.py prompt_table): the lines the
controller hands the driver during its setup, so a large file is never minutes of silence."""

from tandem.core.config import JobConfig
from tandem.services.orchestrator import data


def test_tokenising_says_how_many_rows_are_done(tiny_model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    cfg = JobConfig.from_dict({"model": {"path": tiny_model}, "data": {"path": "d.jsonl"}, "rewards": ["r.py:f"],
                               "generation": {"max_prompt_length": 64}})
    rows = [{"prompt": f"{i} + {i}"} for i in range(50)]
    monkeypatch.setattr(data, "SAY_EVERY_S", 0.0)  # every row: the count must climb to the last
    said = []
    table = data.prompt_table(rows, cfg, AutoTokenizer.from_pretrained(tiny_model), None, "d.jsonl", said.append)
    assert len(said) == 50 and said[0] == "tandem: tokenising the prompts of d.jsonl: 1 of 50 rows in 0 s"
    assert said[-1].startswith("tandem: tokenising the prompts of d.jsonl: 50 of 50 rows in ")
    assert len(table.token_ids) == 50 and all(len(ids) > 0 for ids in table.token_ids)
    monkeypatch.setattr(data, "SAY_EVERY_S", 10.0)  # the default: a table of seconds says nothing
    quiet = []
    data.prompt_table(rows, cfg, AutoTokenizer.from_pretrained(tiny_model), None, "d.jsonl", quiet.append)
    assert quiet == []
