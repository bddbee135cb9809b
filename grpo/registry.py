"""What every registry of the research surface shares: knobs, and the user's own modules.

A loss (grpo/losses.py), an advantage estimator or step (grpo/advantages.py) and a reward term
(grpo/rewards.py) may add config knobs. A knob is a field of its config section (`objective:` for
losses and advantages, `reward:` for terms), with a default, a type the config loader checks and a
check of its own; the section's dataclass gets every registered knob as a field (`with_knobs`),
also a knob registered after the dataclass was built, from a user's module named in the config:

    plugins: [my_research.py]        # or a dotted module name; imported before the config is read

(`grpo.config.load_config` imports them; docs/extending.md). Nothing a researcher sets is silently
ignored: a knob whose name a field of the section or another owner's knob already has, with
another default, type or check, is refused at registration (one name, one meaning); a knob set
away from its default while none of its owners is selected (a loss's knob with another loss
chosen) is refused when the config is read, naming the owner to select or the key to drop. An
error that comes from a user's module names its file (`plugin_origin`). This module imports
nothing of grpo, and nothing heavy: the reward workers import the term registry, which imports it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
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
    selects: bool = False  # it turns its owner on or off (a step's switch, `red`): it always has an effect


@dataclass(frozen=True)
class Owner:
    """A registered entry that adds knobs to a config section, and whether a config selects it."""

    kind: str  # as messages name it: "loss", "advantage", "advantage step", "reward term"
    name: str
    knobs: tuple
    module: str  # the module that registered it (a user's: plugin_origin names its file)
    selected: Callable[[Any], bool]  # the section's config -> whether its knobs have an effect there
    select: str  # how a config selects it, e.g. "objective.loss: dual_clip"

    def describe(self) -> str:
        """'loss grpo'; a user's entry with its file: 'loss dual_clip (examples/dual_clip.py)'."""
        where = plugin_origin(self.module)
        return f"{self.kind} {self.name}" + (f" ({where})" if where else "")


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


def register(table: dict, name: str, entry, kind: str) -> None:
    """Put a registry's new entry (anything with `fn` and `knobs`) into its table: a name registered
    twice is refused, naming where the first came from, and so is a knob that collides with a
    field or another owner's knob; then every section gets the entry's knobs as fields. ValueError,
    one line; a refused entry leaves the registry as it was."""
    if name in table:
        raise ValueError(f"{kind} {name!r} is already registered (by {origin(table[name].fn.__module__)})")
    table[name] = entry
    try:
        add_knobs()
    except ValueError:
        del table[name]
        raise


@contextlib.contextmanager
def blame(kind: str, name: str, module: str):
    """A ValueError raised inside (a registered entry's own check) names the entry and the user's
    file it came from; the library's own messages pass as they are."""
    try:
        yield
    except ValueError as e:
        where = plugin_origin(module)
        if where is None:
            raise
        raise ValueError(f"{e} ({kind} {name}, {where})") from None


# ----------------------------------------------------------------------------------------------
# A config section whose fields grow with its registries
# ----------------------------------------------------------------------------------------------

_SECTIONS: list[tuple[type, Callable[[], list[Owner]]]] = []
_ADDED: dict[type, set] = {}  # the fields each section got from knobs


def with_knobs(owners: Callable[[], list[Owner]]):
    """Class decorator, below @dataclass: every knob of the entries `owners()` lists becomes a field
    of the section, now and whenever a registry gains one (`add_knobs` rebuilds the dataclass)."""

    def decorate(cls):
        _SECTIONS.append((cls, owners))
        _ADDED[cls] = set()
        _set_fields(cls, owners())
        return cls
    return decorate


def add_knobs() -> None:
    """Called by a registry after it registered an entry: new knobs become fields of their section
    (a config built later accepts and checks them; configs built before keep the defaults). A knob
    that collides is refused (ValueError) before any section changes."""
    for cls, owners in _SECTIONS:
        check_collisions(cls, owners())
    for cls, owners in _SECTIONS:
        _set_fields(cls, owners())


def prune_knobs() -> None:
    """Remove the fields of knobs no registry lists any more (an entry registered, then removed:
    tests that load a user's module and take it back)."""
    for cls, owners in _SECTIONS:
        gone = _ADDED[cls] - {k.name for k in section_knobs(owners())}
        for name in gone:
            del cls.__annotations__[name]
            delattr(cls, name)
        _ADDED[cls] -= gone
        if gone:
            _rebuild(cls)


def section_knobs(owners: list[Owner]) -> list[Knob]:
    """Every knob of a section's owners, once each by name, in registration order."""
    return unique_knobs(owner.knobs for owner in owners)


def _same(a: Knob, b: Knob) -> bool:
    """One knob declared twice: a shared Knob object, or the same default, type and check."""
    return (a.default, a.type, a.check, a.selects) == (b.default, b.type, b.check, b.selects)


def check_collisions(cls, owners: list[Owner]) -> None:
    """One name, one knob: a knob named like a field of the section itself, or like another owner's
    knob with another default, type or check, is refused: ValueError naming both."""
    own_fields = set(getattr(cls, "__dataclass_fields__", {})) - _ADDED.get(cls, set())
    first: dict[str, tuple[Knob, Owner]] = {}
    for owner in owners:
        for knob in owner.knobs:
            if knob.name in own_fields:
                raise ValueError(f"knob {knob.name!r} of {owner.describe()}: the {cls.__name__} section has a field "
                                 f"of that name (with its own default and check); give the knob another name")
            known, known_owner = first.setdefault(knob.name, (knob, owner))
            if not _same(known, knob):
                raise ValueError(f"knob {knob.name!r} of {owner.describe()} (default {knob.default!r}) collides with "
                                 f"the knob of {known_owner.describe()} (default {known.default!r}): another default, "
                                 f"type or check under one name; give it another name, or share the Knob object")


def check_section(cfg) -> None:
    """The registry's part of a section's __post_init__: each knob's own check, then that every knob
    set away from its default has an effect, i.e. one of its owners is selected (a knob that
    selects its owner, a step's switch, always has one). ValueError("<knob>: why")."""
    owners = next((list_owners() for cls, list_owners in _SECTIONS if isinstance(cfg, cls)), [])
    for knob in section_knobs(owners):
        mine = [o for o in owners if any(k.name == knob.name for k in o.knobs)]
        value = getattr(cfg, knob.name)
        why = knob.check(value) if knob.check else None
        if why:
            users = [o for o in mine if plugin_origin(o.module)]
            raise ValueError(f"{knob.name}: {why}, got {value!r}"
                             + (f" ({users[0].kind} {users[0].name}, {plugin_origin(users[0].module)})" if users else ""))
        if knob.selects or value == knob.default or any(o.selected(cfg) for o in mine):
            continue
        select = " or ".join(dict.fromkeys(o.select for o in mine))
        if len(mine) == 1:
            raise ValueError(f"{knob.name}: set to {value!r}, but {mine[0].describe()}, which reads it, is not "
                             f"selected, so it would have no effect: select it ({select}), or drop the key")
        raise ValueError(f"{knob.name}: set to {value!r}, but none of its owners ({', '.join(o.describe() for o in mine)}) "
                         f"is selected, so it would have no effect: select one ({select}), or drop the key")


def _set_fields(cls, owners: list[Owner]) -> None:
    fields = getattr(cls, "__dataclass_fields__", {})
    new = [k for k in section_knobs(owners)
           if k.name not in fields and k.name not in cls.__dict__.get("__annotations__", {})]
    if not new:
        return
    check_collisions(cls, owners)
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


class PluginNotFound(ValueError):
    """A module the config's `plugins:` names that is not there (no such file, no such module)."""


def plugin_module_name(path: Path) -> str:
    """The name a plugin file is imported under: the same in every process (ranks, reward workers)."""
    return f"{PLUGIN_PREFIX}{path.stem}_{zlib.crc32(str(path).encode()):08x}"


def plugin_origin(module: str) -> Optional[str]:
    """The user's file or module a registered function comes from, as messages name it (`origin`);
    None for the library's own (grpo.*, kernels.*)."""
    return None if module.split(".")[0] in ("grpo", "kernels", "train") else origin(module)


def origin(module: str) -> str:
    """Where a module is, as messages name it: a plugin file by its path (relative to the working
    directory when it lies under it), any other module by its dotted name."""
    file = getattr(sys.modules.get(module), "__file__", None)
    if not module.startswith(PLUGIN_PREFIX) or not file:
        return module
    path = Path(file).resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd().resolve()) else str(path)


def import_plugin(name: str):
    """Import a user's module: a path to a .py file (relative to the working directory), or a
    dotted module name on sys.path. Importing it twice is importing it once. PluginNotFound names
    it; what the module itself raises while it is imported is raised as it is."""
    if name.endswith(".py"):
        path = Path(name).resolve()
        if not path.is_file():
            raise PluginNotFound(f"plugins: {name}: no such file")
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
            raise PluginNotFound(f"plugins: {name}: no such module (a dotted name on sys.path, or a path to a .py "
                                 "file)") from None
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


def docs_main(module: str, argv: Optional[list] = None, load: Optional[Callable[[], None]] = None) -> int:
    """`python -m <module> [--write FILE] [--plugins P ...] [--config C]`: the registry's tables of
    `module` (its `markdown()`), with the user's own entries: the plugins named, and those a config
    names under `plugins:`. --write replaces the generated block of FILE; else they are printed.
    load: imports what declares the rest (grpo.metrics: the run's modules). A bad plugin: one line, 2."""
    import argparse

    from grpo.config import ConfigError, import_plugins, read_yaml

    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=f"the generated tables of {module}")
    ap.add_argument("--write", metavar="FILE", help="replace the generated block of FILE (else: print the tables)")
    ap.add_argument("--plugins", nargs="+", default=[], metavar="PLUGIN", help="the user's files or modules to include")
    ap.add_argument("--config", help="include the plugins this config names")
    args = ap.parse_args(argv)
    try:
        names = list(args.plugins) + (read_yaml(args.config).get("plugins", []) if args.config else [])
        import_plugins(names, args.config or "command line")
        if load is not None:
            load()
        text = importlib.import_module(module).markdown()  # the registry, not a file run again as __main__
        if args.write:
            write_block(args.write, *(getattr(importlib.import_module(module), k) for k in ("DOCS_BEGIN", "DOCS_END")),
                        text)
        else:
            print(text, end="")
    except (ConfigError, ValueError) as e:
        print(f"{module}: {e}", file=sys.stderr)
        return 2
    return 0


def generated_block(path: str, begin: str, end: str) -> str:
    """What stands between `begin` and `end` in the file `path` (the docs tests compare it)."""
    return Path(path).read_text().split(begin)[1].split(end)[0]
