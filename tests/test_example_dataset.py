"""docs/extending.md, dataset fields: examples/fields.yaml reads a JSONL file whose fields are named
otherwise, with no code; a row without them is one line naming the file, the line and the field."""
import json

import pytest

from grpo.config import load_config
from grpo.data import DataError, load_problems
from grpo.train_config import TrainConfig
from plugins import EXAMPLES, doc_holds


def test_other_field_names_by_config_alone(tmp_path):
    rows = tmp_path / "mine.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [{"q": "What is 2 + 3?", "final": "5"},
                                                            {"q": "What is 7 * 6?", "final": "42"}]))
    cfg = load_config(TrainConfig, EXAMPLES / "fields.yaml", [f"data.dataset={rows}"])
    problems = load_problems(cfg.data)
    assert [(p.prompt, p.answer) for p in problems] == [("What is 2 + 3?", "5"), ("What is 7 * 6?", "42")]
    rows.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match=r"mine\.jsonl.*1.*'q'"):
        load_problems(cfg.data)
    assert doc_holds("fields.yaml")
