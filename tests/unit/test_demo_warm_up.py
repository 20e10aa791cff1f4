"""The demo's warm-up says how far it is while it runs (a minute or two on 2 cores, silent before)."""

import re

from examples.sevens import prepare
from tandem.services.devtools.tiny_model import build_tiny_model


def test_the_warm_up_says_its_progress(tmp_path, monkeypatch, capsys):
    build_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=2, kv_heads=1, vocab=512, seed=0)
    monkeypatch.setattr(prepare, "SAY_EVERY_S", 0.0)  # every step, rather than every 10 s
    loss = prepare.warm_up(tmp_path / "model", steps=3, batch=4)
    said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warm-up: ")]
    assert [re.sub(r"loss \S+ \(\d+ s\)", "", x) for x in said] == [f"warm-up: step {i} of 3, SFT " for i in (1, 2, 3)]
    assert said[-1].split("SFT loss ")[1].startswith(f"{loss:.3f}")
