"""Typed configs: dataclasses loaded from YAML, with dotted command-line overrides.

Each component module owns a small dataclass for its own knobs (torchtitan style); this
module only knows how to fill a dataclass tree from YAML + `a.b=c` overrides and how to
report a mistake so that the user can find it: every error names the file and the dotted key.

Convention for components: validate in `__post_init__` and raise `ValueError("<field>: why")`;
the loader prefixes the section path and the file, e.g.
`configs/x.yaml: grpo.v: must be >= 1, got 0`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names key and source."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`, converting only where lossless (int -> float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [arg for arg in args if arg is not type(None)]
        if len(non_none) == 1:  # Optional[X]: X's own message says more than "expected Optional[X]"
            return _coerce(value, non_none[0], key, source)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{source}: {key}: expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{source}: {key}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{source}: {key}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        out = [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a section (mapping), got {value!r}")
        return _build(tp, value, source, prefix=key + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        # YAML 1.1 reads `1e-6` (no dot) as a string; accept it as the number everyone means.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}: expected a number, got {value!r}")
        if not math.isfinite(value):
            # No knob means anything at nan or inf (a nan learning rate trains nothing, silently).
            raise ConfigError(f"{source}: {key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{source}: {key}: unsupported annotation {tp!r}")


def _build(cls: type, data: dict, source: str, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {prefix}{unknown[0]} (known in {prefix.rstrip('.') or 'top level'}: "
            f"{', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], prefix + name, source)
    # Sections left out of the file still get built, so their defaults are validated too.
    for name, f in fields.items():
        if name not in kwargs and dataclasses.is_dataclass(hints[name]) and f.default is dataclasses.MISSING \
                and f.default_factory is dataclasses.MISSING:
            kwargs[name] = _build(hints[name], {}, source, prefix + name + ".")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {prefix}{e}") from None


def yaml_error(where: str, e: yaml.YAMLError, columns_only: bool = False) -> ConfigError:
    """PyYAML's several-line report (its marks name `<unicode string>`) as one line naming `where`,
    then the line and column of the problem (only the column for a one-line override value)."""
    def at(mark) -> str:
        return f"column {mark.column + 1}" if columns_only else f"line {mark.line + 1}, column {mark.column + 1}"

    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return ConfigError(f"{where}: not valid YAML: {' '.join(str(e).split())}")
    text = f"{where}: not valid YAML at {at(mark)}: {problem}" if mark else f"{where}: not valid YAML: {problem}"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        text += f" ({context}" + (f" from {at(context_mark)})" if context_mark else ")")
    return ConfigError(" ".join(text.split()))


def _parse_override_value(text: str, item: str) -> Any:
    # YAML gives the natural reading of `1e-6`, `true`, `null`, `[1, 2]`; a bare word stays a string.
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise yaml_error(f"command line: {item}", e, columns_only=True) from None
    if isinstance(value, str):
        if text.strip()[:1] in ("'", '"'):
            return value  # quoted: the text the user wrote, even where it reads as a number ('0', "1e-6")
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf") else value
        except ValueError:
            return text if text.strip() != value else value
    return value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: override {item!r} is not of the form key=value")
        key, _, text = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"command line: {key}: {p} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_override_value(text, item)
    return data


def _deep_merge(base: dict, child: dict) -> dict:
    out = dict(base)
    for key, value in child.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def unshared(value: Any) -> Any:
    """A copy of a YAML tree in which no two places hold the same dict or list. PyYAML hands back
    one object for an anchor and each of its aliases (`eval_data: *data`), so an override of one
    section (`data.dataset=...`, applied in place) rewrote the other too. copy.deepcopy keeps such
    sharing (its memo), so the tree is rebuilt node by node: every section its own value."""
    if isinstance(value, dict):
        return {key: unshared(item) for key, item in value.items()}
    if isinstance(value, list):
        return [unshared(item) for item in value]
    return value


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A config file as a dict; `base: other.yaml` (relative to the file; or a list of files, merged
    in order) is read first and the file's own keys override it, section by section, so experiment
    configs state only differences (e.g. `base: [gsm8k_qwen0.5b_v1-i1.yaml, objectives/dapo.yaml]`)."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise ConfigError(f"{source}: config file not found")
    if path.resolve() in _seen:
        raise ConfigError(f"{source}: base: cycle through {[str(p) for p in _seen]}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise yaml_error(source, e) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: top level must be a mapping of sections")
    loaded = unshared(loaded)
    base = loaded.pop("base", None)
    if base is not None:
        bases = [base] if isinstance(base, str) else base
        if not isinstance(bases, list) or not bases or not all(isinstance(b, str) for b in bases):
            raise ConfigError(f"{source}: base: expected a file name or a list of file names, got {base!r}")
        merged: dict = {}
        for name in bases:  # later bases override earlier ones; the file's own keys override them all
            merged = _deep_merge(merged, read_yaml(path.parent / name, _seen + (path.resolve(),)))
        loaded = _deep_merge(merged, loaded)
    return loaded


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from a YAML file (optional) and dotted overrides; raises ConfigError. When `cls`
    has a `plugins` field, the modules it names (the user's own losses, advantages, reward terms,
    metrics: grpo/registry.py) are imported first, so their names and knobs are known."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = read_yaml(path)
    if overrides:
        source = f"{source} + command line" if path is not None else "command line"
        apply_overrides(data, overrides)
    if "plugins" in {f.name for f in dataclasses.fields(cls)}:
        import_plugins(data.get("plugins", []), source)
    return _build(cls, data, source)


def import_plugins(names: Any, source: str) -> None:
    """Import the modules a config's `plugins:` names; a bad one is one line naming it: one that is not
    there, and whatever a module raises while it is imported (its own ValueError, a registration
    the registry refused: a name taken, a knob that collides), with the file or module it came from."""
    from grpo.registry import PluginNotFound, import_plugin

    names = _coerce(names, list[str], "plugins", source)
    for name in names:
        try:
            import_plugin(name)
        except PluginNotFound as e:
            raise ConfigError(f"{source}: {e}") from None
        except Exception as e:  # the user's module failed while importing: its own error, in one line
            raise ConfigError(f"{source}: plugins: {name}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML, next to the run's outputs."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # json round-trip turns tuples into lists so the YAML is plain and reloadable.
    plain = json.loads(json.dumps(to_dict(cfg)))
    path.write_text(yaml.safe_dump(plain, sort_keys=False))
