"""The config loader: types, unknown keys, bad values and overrides all name the key and the file."""
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from grpo.config import ConfigError, apply_overrides, load_config, save_config


@dataclass
class Inner:
    v: int = 1  # push weights every v iterations
    eps: float = 0.2
    mode: Literal["exact", "approx"] = "approx"
    cap: Optional[float] = None

    def __post_init__(self):
        if self.v < 1:
            raise ValueError(f"v: must be >= 1, got {self.v}")
        if self.eps < 0:
            raise ValueError(f"eps: must be >= 0, got {self.eps}")


@dataclass
class Outer:
    name: str = "run"
    tags: list[str] = field(default_factory=list)
    grpo: Inner = field(default_factory=Inner)


def write(tmp_path, text):
    p = tmp_path / "x.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "name: a\ngrpo:\n  v: 3\n  eps: 1\n")
    cfg = load_config(Outer, p, ["grpo.v=10", "grpo.mode=exact", "grpo.cap=2.5", "tags=[x, y]"])
    assert cfg.name == "a"
    assert cfg.grpo.v == 10 and cfg.grpo.mode == "exact" and cfg.grpo.cap == 2.5
    assert cfg.grpo.eps == 1.0 and isinstance(cfg.grpo.eps, float)  # int widened to float
    assert cfg.tags == ["x", "y"]


def test_override_scientific_and_null():
    data = apply_overrides({}, ["a.lr=1e-6", "a.cap=null", "a.flag=true", "a.s=hello"])
    assert data == {"a": {"lr": 1e-6, "cap": None, "flag": True, "s": "hello"}}


def test_a_quoted_override_stays_a_string():
    """A core list of one core ("0") or any number meant as text is quoted on the command line, as in
    YAML. The unquoted-1e-6 reading turned it into 0.0, so `cpu.engine_cores='0'` was refused
    ("expected a string, got 0.0") and one core could not be named from the command line."""
    data = apply_overrides({}, ["a.cores='0'", 'a.name="1e-6"', "a.lr=1e-6", "a.n=3"])
    assert data == {"a": {"cores": "0", "name": "1e-6", "lr": 1e-6, "n": 3}}


@pytest.mark.parametrize(
    "text,overrides,expected",
    [
        ("grpo:\n  vv: 3\n", [], "x.yaml: unknown key grpo.vv"),
        ("nme: a\n", [], "x.yaml: unknown key nme"),
        ("grpo:\n  v: 0\n", [], "x.yaml: grpo.v: must be >= 1, got 0"),
        ("grpo:\n  v: two\n", [], "x.yaml: grpo.v: expected an integer, got 'two'"),
        ("grpo:\n  v: 1.5\n", [], "grpo.v: expected an integer"),
        ("grpo:\n  eps: -0.1\n", [], "grpo.eps: must be >= 0"),
        ("grpo:\n  mode: both\n", [], "grpo.mode: must be one of ['exact', 'approx']"),
        ("grpo: 3\n", [], "grpo: expected a section"),
        ("", ["grpo.v=-1"], "x.yaml + command line: grpo.v: must be >= 1, got -1"),
        ("", ["grpo.eps"], "not of the form key=value"),
    ],
)
def test_errors_name_key_and_file(tmp_path, text, overrides, expected):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(Outer, p, overrides)
    assert expected in str(e.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(Outer, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(Outer, write(tmp_path, "grpo: [1,\n"))


def test_saved_config_reloads_identically(tmp_path):
    cfg = load_config(Outer, write(tmp_path, "grpo:\n  v: 4\n"), ["tags=[a]"])
    save_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(Outer, tmp_path / "run" / "config.yaml")
    assert again == cfg


def test_base_file_is_merged_section_by_section(tmp_path):
    (tmp_path / "base.yaml").write_text("name: base\ngrpo:\n  v: 3\n  eps: 0.3\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: base.yaml\ngrpo:\n  v: 10\n")
    cfg = load_config(Outer, child)
    assert (cfg.name, cfg.grpo.v, cfg.grpo.eps) == ("base", 10, 0.3)
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(Outer, tmp_path / "loop.yaml")


def test_base_list_is_merged_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("name: a\ngrpo:\n  v: 3\n  eps: 0.3\n")
    (tmp_path / "b.yaml").write_text("grpo:\n  eps: 0.5\n")
    child = tmp_path / "child.yaml"
    child.write_text("base: [a.yaml, b.yaml]\ngrpo:\n  v: 10\n")
    cfg = load_config(Outer, child)
    assert (cfg.name, cfg.grpo.v, cfg.grpo.eps) == ("a", 10, 0.5)  # b overrides a, the file overrides both
    child.write_text("base: [a.yaml, 3]\n")
    with pytest.raises(ConfigError, match="base: expected a file name or a list"):
        load_config(Outer, child)
