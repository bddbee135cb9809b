"""MetricsLogger with a real W&B offline run, read back from W&B's own record file."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import metrics, registry
from grpo.metrics import LogConfig, MetricsLogger, group_key, redact_secrets

ROOT = Path(__file__).resolve().parent.parent


def read_wandb_records(path: Path):
    """Every protobuf Record of a run-<id>.wandb file.

    The file is a LevelDB log (32 KiB blocks of records: crc32 of type+data, length, type
    FULL/FIRST/MIDDLE/LAST) after a 7-byte ':W&B' header, holding wandb.proto Records; wandb 0.31
    ships the proto but no Python reader, so this is the reader, checking every CRC."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's zero trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at byte {pos}"
        pos += 7 + length
        if kind == 1:
            records.append(payload)
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            records.append(pending + payload)
    out = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def wandb_history(path: Path) -> dict[int, dict]:
    """step -> {key: value} of the history records (W&B's own _step/_runtime/_timestamp left out)."""
    rows: dict[int, dict] = {}
    for rec in read_wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = rows.setdefault(rec.history.step.num, {})
            for item in rec.history.item:
                key = "/".join(item.nested_key) if item.nested_key else item.key
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
    return rows


def wandb_run_record(path: Path):
    return next(r.run for r in read_wandb_records(path) if r.WhichOneof("record_type") == "run")


def run_file(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


CONFIG = {"model": {"path": "tiny", "max_tokens": 128, "pad_token_id": 0},
          "server": {"hf_token": "hf_abcdefghijklmnopqrstuvwx", "url": "http://x", "api_key": "abc123"},
          "log": {"project": "grpo"}}


def test_log_config_validation():
    assert LogConfig().wandb_mode == "offline"
    for kwargs, field in [({"wandb_mode": "cloud"}, "wandb_mode"), ({"sample_table_every": -1}, "sample_table_every"),
                          ({"run_name": "a/b"}, "run_name"), ({"tags": ["ok", ""]}, "tags"),
                          ({"project": ""}, "project"), ({"out_dir": ""}, "out_dir"), ({"group": " "}, "group")]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            LogConfig(**kwargs)


def test_key_groups():
    metrics.load_declarations()  # the run's modules, as train.py imports them
    expected = {
        "reward_mean": "rollout/reward_mean", "reward_std": "rollout/reward_std", "pass_rate": "rollout/pass_rate",
        "masked_frac": "rollout/masked_frac", "completion_len_mean": "rollout/completion_len_mean",
        "truncated_frac": "rollout/truncated_frac", "loss": "train/loss", "clip_frac": "train/clip_frac",
        "clip_low_frac": "train/clip_low_frac", "kl": "train/kl", "entropy": "train/entropy",
        "is_weight_mean": "train/is_weight_mean", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "time_generate": "time/time_generate", "tokens_per_s": "time/tokens_per_s", "tv_pik_alpha": "bound/tv_pik_alpha",
        "kl_pik_alpha": "bound/kl_pik_alpha", "server_threads": "time/server_threads", "eval/pass@1": "eval/pass@1",
        "tv_staleness": "bound/tv_staleness", "parity_kl": "bound/parity_kl", "reward_term_correct": "rollout/reward_term_correct",
        "step": "step", "stage": "stage", "iteration": "iteration", "weights_version": "weights_version",
    }
    assert {k: group_key(k) for k in expected} == expected
    assert group_key("not_declared_anywhere") == "not_declared_anywhere"  # the top level, never dropped


def test_docs_tables_are_the_declarations():
    metrics.load_declarations()
    block = registry.generated_block(ROOT / "docs" / "metrics.md", metrics.DOCS_BEGIN, metrics.DOCS_END)
    assert block.strip() == metrics.markdown().strip(), \
        "docs/metrics.md is stale: python -m grpo.metrics --write docs/metrics.md"
    assert all(m.section in metrics.SECTIONS for m in metrics.DECLARED.values())


def test_generated_docs_include_the_plugins_a_config_names(tmp_path, capsys):
    """`python -m grpo.metrics` imported only the library: a user's keys never reached their docs.
    --config imports the plugins a config names, --plugins the ones given; --write fills a file's block."""
    from plugins import EXAMPLES, registered

    config = tmp_path / "mine.yaml"
    config.write_text(f"plugins: [{EXAMPLES / 'length_by_correctness.py'}]\n")
    doc = tmp_path / "my_metrics.md"
    doc.write_text(f"# my run\n{metrics.DOCS_BEGIN}\n{metrics.DOCS_END}\n")
    with registered("length_by_correctness.py"):
        args = ["--config", str(config), "--plugins", str(EXAMPLES / "answer_sentence.py"), "--write", str(doc)]
        assert registry.docs_main("grpo.metrics", args, load=metrics.load_declarations) == 0
        assert registry.docs_main("grpo.metrics", ["--plugins", str(tmp_path / "nowhere.py")]) == 2
    text = doc.read_text()
    assert "| `completion_len_right` | mean completion length of the correct answers" in text
    assert "length_by_correctness.py` |" in text and "| `reward_term_answer_sentence` |" in text and "| `loss` |" in text
    assert capsys.readouterr().err.strip() == f"grpo.metrics: command line: plugins: {tmp_path / 'nowhere.py'}: no such file"


def test_a_key_without_a_declaration_is_logged_at_the_top_level_with_one_warning(tmp_path):
    logger = MetricsLogger(LogConfig(wandb_mode="disabled"), tmp_path, {}, rank=0)
    with pytest.warns(UserWarning, match="my_new_key is logged but not declared"):
        logger.log({"step": 1, "my_new_key": 2.0, "reward_mean": 0.5})
    logger.log({"step": 2, "my_new_key": 3.0})  # once: no second warning (pytest would not fail on it; count below)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["my_new_key"] for r in rows] == [2.0, 3.0]
    assert metrics.wandb_payload(rows[0])["my_new_key"] == 2.0


def test_redact_secrets():
    assert redact_secrets(CONFIG) == {"model": {"path": "tiny", "max_tokens": 128, "pad_token_id": 0},
                                      "server": {"url": "http://x"}, "log": {"project": "grpo"}}
    assert redact_secrets({"args": ["--x", "sk-ABCDEFGHIJKLMNOPQRSTUV"]}) == {"args": ["--x"]}


STEPS = [
    {"step": 1, "stage": 0, "iteration": 0, "weights_version": 0, "reward_mean": 0.25, "kl": 0.0,
     "clip_frac": 0.0, "time_generate": 1.5, "tv_pik_alpha": 0.0, "eval/pass@1": 0.125},
    {"step": 2, "stage": 0, "iteration": 1, "weights_version": 0, "reward_mean": 0.5, "kl": 0.001,
     "clip_frac": 0.0625, "time_generate": 1.25, "tv_pik_alpha": 0.03},
    {"step": 3, "stage": 0, "iteration": 2, "weights_version": 1, "reward_mean": 0.75, "kl": 0.002,
     "clip_frac": 0.125, "time_generate": 1.0, "tv_pik_alpha": 0.0},
]


def test_logs_jsonl_and_wandb_offline(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "demo"
    cfg = LogConfig(run_name="demo", tags=["test", "tiny"], group="sweep/point", sample_table_every=2)
    logger = MetricsLogger(cfg, run_dir, CONFIG, rank=0)
    bar = logger.progress(total=3)
    for i, row in enumerate(STEPS):
        logged = dict(row)
        if i == 1:  # a 0-d tensor and a numpy scalar, as train loops produce them
            logged["reward_mean"] = torch.tensor(0.5)
            logged["kl"] = np.float64(0.001)
        logger.log(logged)
        bar.update(1)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        if row["step"] == 2:
            logger.log_samples(2, [{"prompt": "1+1?", "completion": "\\boxed{2}", "reward": 1.0},
                                   {"prompt": "2+3?", "completion": "6", "reward": 0.0, "truncated": True}])
    with pytest.warns(UserWarning, match=r"log_samples\(step=1\) after step 3 .* metrics.jsonl/samples.jsonl only"):
        logger.log_samples(1, [{"prompt": "late"}])
    logger.close()
    logger.close()  # idempotent

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    # Every row carries the run's group and tags (how a sweep's rows name their grid point).
    assert [json.loads(line) for line in lines] == [{**row, "group": "sweep/point", "tags": ["test", "tiny"]}
                                                    for row in STEPS]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 2, "prompt": "1+1?", "completion": "\\boxed{2}", "reward": 1.0},
                       {"step": 2, "prompt": "2+3?", "completion": "6", "reward": 0.0, "truncated": True},
                       {"step": 1, "prompt": "late"}]
    assert "3/3" in capsys.readouterr().err

    files = run_file(run_dir)
    assert len(files) == 1
    history = wandb_history(files[0])
    assert sorted(history) == [1, 2, 3]
    assert {k: v for k, v in history[1].items()} == {
        "stage": 0, "iteration": 0, "weights_version": 0, "rollout/reward_mean": 0.25, "train/kl": 0.0,
        "train/clip_frac": 0.0, "time/time_generate": 1.5, "bound/tv_pik_alpha": 0.0, "eval/pass@1": 0.125}
    table = {k: v for k, v in history[2].items() if k.startswith("samples/")}
    assert table["samples/_type"] == "table-file" and table["samples/nrows"] == 2 and table["samples/ncols"] == 4
    assert {k: v for k, v in history[2].items() if not k.startswith("samples/")} == {
        "stage": 0, "iteration": 1, "weights_version": 0, "rollout/reward_mean": 0.5, "train/kl": 0.001,
        "train/clip_frac": 0.0625, "time/time_generate": 1.25, "bound/tv_pik_alpha": 0.03}
    assert history[3]["rollout/reward_mean"] == 0.75 and history[3]["weights_version"] == 1
    table_json = json.loads((files[0].parent / "files" / table["samples/path"]).read_text())
    assert table_json["columns"] == ["prompt", "completion", "reward", "truncated"]
    assert table_json["data"][1] == ["2+3?", "6", 0.0, True]

    run = wandb_run_record(files[0])
    assert run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    assert run.display_name == "demo" and list(run.tags) == ["test", "tiny"] and run.project == "grpo"
    assert run.run_group == "sweep/point"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["server"] == {"url": "http://x"}
    assert config["model"] == {"path": "tiny", "max_tokens": 128, "pad_token_id": 0}
    assert "hf_abcdefghijklmnopqrstuvwx" not in files[0].read_bytes().decode("latin-1")


def test_resume_truncates_and_continues_the_same_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(LogConfig(), run_dir, {}, rank=0)
    for row in STEPS:
        logger.log(row)
        if row["step"] in (1, 3):
            logger.log_samples(row["step"], [{"prompt": "a", "reward": 1.0}])
    logger.close()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward_me')  # a line torn by a crash

    with pytest.raises(ValueError, match="already holds metrics"):
        MetricsLogger(LogConfig(), run_dir, {}, rank=0)

    logger = MetricsLogger(LogConfig(), run_dir, {}, rank=0, resume=True)
    assert logger.truncate_after(1) == 4  # steps 2, 3, the torn line, the step-3 sample
    assert [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == STEPS[:1]
    assert [json.loads(x)["step"] for x in (run_dir / "samples.jsonl").read_text().splitlines()] == [1]
    logger.log({"step": 2, "reward_mean": 0.875})
    logger.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [STEPS[0], {"step": 2, "reward_mean": 0.875}]

    first, second = run_file(run_dir)
    assert wandb_run_record(first).run_id == wandb_run_record(second).run_id
    assert wandb_history(second)[2] == {"rollout/reward_mean": 0.875}


def test_bad_metrics_name_the_key(tmp_path):
    logger = MetricsLogger(LogConfig(wandb_mode="disabled"), tmp_path, {}, rank=0)
    with pytest.raises(ValueError, match="'step' must be an integer"):
        logger.log({"reward_mean": 1.0})
    with pytest.raises(ValueError, match="kl: expected a number, got list"):
        logger.log({"step": 1, "kl": [0.1]})
    with pytest.raises(ValueError, match="kl: expected a number, got a tensor/array of shape \\(2,\\)"):
        logger.log({"step": 1, "kl": torch.zeros(2)})
    logger.log({"step": 1, "kl": 0.5})
    logger.log({"step": np.int64(2), "kl": float("nan")})  # a numpy step; NaN as Python's json writes it
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "kl": 0.5}\n{"step": 2, "kl": NaN}\n'
    assert not (tmp_path / "wandb").exists()


def test_other_ranks_do_nothing(tmp_path):
    logger = MetricsLogger(LogConfig(), tmp_path / "run", CONFIG, rank=1)
    logger.log({"step": 1, "reward_mean": 0.5})
    logger.log_samples(1, [{"prompt": "p"}])
    assert logger.truncate_after(0) == 0
    bar = logger.progress(10)
    bar.update(1)
    bar.set_postfix(reward="0.5")
    logger.close()
    assert not (tmp_path / "run").exists()
