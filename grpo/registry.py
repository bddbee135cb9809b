"""What every registry of the research surface shares: knobs, and the user's own modules.

A loss (grpo/losses.py), an advantage estimator or step (grpo/advantages.py) and a reward term
(grpo/rewards.py) may add config knobs. A knob is a field of its config section (`objective:` for
losses and advantages, `reward:` for terms), with a default, a type the config loader checks and a
check of its own; the section's dataclass gets every registered knob as a field (`with_knobs`),
also a knob registered after the dataclass was built, from a user's module named in the config:

    plugins: [my_research.py]        # or a dotted module name; imported before the config is read

(`grpo.config.load_config` imports them; docs/extending.md). This module imports nothing of grpo,
and nothing heavy: the reward workers import the term registry, which imports it.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Knob:
    """A config field a registered function adds to its section."""

    name: str
    default: Any
    type: Any
    doc: str
    check: Optional[Callable[[Any], Optional[str]]] = None  # value -> why it is refused (None: fine)


def in_unit_interval(value) -> Optional[str]:
    return None if 0.0 <= value <= 1.0 else "must be in [0, 1]"


def non_negative(value) -> Optional[str]:
    return None if value >= 0.0 else "must be >= 0"


def positive(value) -> Optional[str]:
    return None if value > 0.0 else "must be > 0"


def unique_knobs(groups) -> list[Knob]:
    """Knobs of several registered entries, once each by name, in registration order."""
    out: dict[str, Knob] = {}
    for knobs in groups:
        for knob in knobs:
            out.setdefault(knob.name, knob)
    return list(out.values())


def check_knobs(cfg, knobs: list[Knob]) -> None:
    """Each knob's own check on cfg's value: ValueError("<knob>: why, got <value>")."""
    for knob in knobs:
        why = knob.check(getattr(cfg, knob.name)) if knob.check else None
        if why:
            raise ValueError(f"{knob.name}: {why}, got {getattr(cfg, knob.name)!r}")


# ----------------------------------------------------------------------------------------------
# A config section whose fields grow with its registries
# ----------------------------------------------------------------------------------------------

_SECTIONS: list[tuple[type, Callable[[], list[Knob]]]] = []
_ADDED: dict[type, set] = {}  # the fields each section got from knobs


def with_knobs(knobs: Callable[[], list[Knob]]):
    """Class decorator, below @dataclass: every knob `knobs()` lists becomes a field of the
    section, now and whenever a registry gains one (`add_knobs` rebuilds the dataclass)."""

    def decorate(cls):
        _SECTIONS.append((cls, knobs))
        _ADDED[cls] = set()
        _set_fields(cls, knobs())
        return cls
    return decorate


def add_knobs() -> None:
    """Called by a registry after it registered an entry: new knobs become fields of their section
    (a config built later accepts and checks them; configs built before keep the defaults)."""
    for cls, knobs in _SECTIONS:
        _set_fields(cls, knobs())


def prune_knobs() -> None:
    """Remove the fields of knobs no registry lists any more (an entry registered, then removed:
    tests that load a user's module and take it back)."""
    for cls, knobs in _SECTIONS:
        gone = _ADDED[cls] - {k.name for k in knobs()}
        for name in gone:
            del cls.__annotations__[name]
            delattr(cls, name)
        _ADDED[cls] -= gone
        if gone:
            _rebuild(cls)


def _set_fields(cls, knobs: list[Knob]) -> None:
    fields = getattr(cls, "__dataclass_fields__", {})
    new = [k for k in knobs if k.name not in fields and k.name not in cls.__dict__.get("__annotations__", {})]
    if not new:
        return
    for knob in new:
        cls.__annotations__[knob.name] = knob.type
        setattr(cls, knob.name, knob.default)
        _ADDED[cls].add(knob.name)
    if dataclasses.is_dataclass(cls):
        _rebuild(cls)


def _rebuild(cls) -> None:
    """Run @dataclass again on cls after its annotations changed: the methods it generated go
    first (it never replaces a method the class holds), default factories are handed back."""
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            setattr(cls, f.name, f)
    for name in ("__init__", "__repr__", "__eq__", "__match_args__", "__dataclass_fields__",
                 "__dataclass_params__"):
        if name in cls.__dict__:
            delattr(cls, name)
    dataclasses.dataclass(cls)


# ----------------------------------------------------------------------------------------------
# The user's own modules
# ----------------------------------------------------------------------------------------------

PLUGIN_PREFIX = "grpo_plugin_"


def plugin_module_name(path: Path) -> str:
    """The name a plugin file is imported under: the same in every process (ranks, reward workers)."""
    return f"{PLUGIN_PREFIX}{path.stem}_{zlib.crc32(str(path).encode()):08x}"


def import_plugin(name: str):
    """Import a user's module: a path to a .py file (relative to the working directory), or a
    dotted module name on sys.path. Importing it twice is importing it once. ValueError names it."""
    if name.endswith(".py"):
        path = Path(name).resolve()
        if not path.is_file():
            raise ValueError(f"plugins: {name}: no such file")
        module_name = plugin_module_name(path)
        if module_name in sys.modules:
            return sys.modules[module_name]
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        return module
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and name.startswith(e.name):
            raise ValueError(f"plugins: {name}: no such module (a dotted name on sys.path, or a path to a .py file)") \
                from None
        raise


# ----------------------------------------------------------------------------------------------
# Docs generated from a registry
# ----------------------------------------------------------------------------------------------

def cell(text) -> str:
    """Text for a markdown table cell."""
    return str(text).replace("|", "\\|")


def write_block(path: str, begin: str, end: str, text: str) -> None:
    """Replace what stands between the lines `begin` and `end` of the file `path` with `text`."""
    file = Path(path)
    content = file.read_text()
    if begin not in content or end not in content:
        raise ValueError(f"{path}: no generated block between {begin!r} and {end!r}")
    head, _, rest = content.partition(begin)
    _, _, tail = rest.partition(end)
    file.write_text(f"{head}{begin}\n{text}{end}{tail}")


def generated_block(path: str, begin: str, end: str) -> str:
    """What stands between `begin` and `end` in the file `path` (the docs tests compare it)."""
    return Path(path).read_text().split(begin)[1].split(end)[0]
