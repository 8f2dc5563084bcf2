"""``--config mix.yaml``: a YAML (or JSON) mix of data sets, read bounded and type-checked against the fields
it sets."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import typing
from typing import Any

from packers import PackstreamError
from packers.files import read_checked, show_path
from pipeline._options._format import FormatOptions
from pipeline._options._pack import DatasetSpec


_YAML_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
               type(None): "null"}


def _describe(value: Any) -> str:
    """``list [1, 2]``, ``string 'false'``, ``null``: a config value as the error shows it."""
    kind = _YAML_TYPES.get(type(value), type(value).__name__)
    if value is None:
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 80 else text[:77] + '...'}"


def check_type(value: Any, hint: Any, what: str, kind: str = "") -> None:
    """Raise PackstreamError(``WHAT must be ..., got ...``) unless the YAML/JSON ``value`` fits the type ``hint``.

    ``hint`` is a field's annotation (``Optional[str]``, ``bool``, ``int``, ``float``, an enum,
    ``tuple[str, ...]``, ``tuple[str, str]``); ``kind`` its cli kind (``pairs`` fields also take a
    ``{NAME: VALUE}`` mapping or ``NAME=VALUE`` text). Booleans must be booleans (not "false"),
    integers not booleans, floats finite numbers, enums one of their values.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        return check_type(value, inner[0] if len(inner) == 1 else Any, what, kind)

    def fail(need: str, fix: str = "") -> None:
        raise PackstreamError(f"{what} must be {need}, got {_describe(value)}" + (f"; {fix}" if fix else ""))

    if kind == "pairs":
        if isinstance(value, str):
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise PackstreamError(f"{what} key {k!r} must be a string, got {_describe(k)}; quote it: '{k}'")
                check_type(v, str, f"{what}.{k}")
            return
        if isinstance(value, list):
            for j, item in enumerate(value):
                if not isinstance(item, str):
                    check_type(item, args[0] if args else tuple[str, str], f"{what}[{j}]")
            return
        fail("a mapping {NAME: VALUE}, a list of NAME=VALUE strings, or one 'NAME=VALUE,...' string")
    if hint is bool:
        if not isinstance(value, bool):
            fail("a boolean", "write true or false, without quotes")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail("a finite number")
    elif hint is str:
        if not isinstance(value, str):
            scalar = isinstance(value, (int, float, bool))
            fail("a string", f"quote it: '{value}'" if scalar else "")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        if not (isinstance(value, str) and value in values):
            fail(f"one of {', '.join(values)}")
    elif origin is tuple:
        if not isinstance(value, list):
            fail("a list")
        if len(args) == 2 and args[1] is Ellipsis:
            for j, item in enumerate(value):
                check_type(item, args[0], f"{what}[{j}]")
        else:
            if len(value) != len(args):
                fail(f"a list of {len(args)}")
            for j, (item, h) in enumerate(zip(value, args)):
                check_type(item, h, f"{what}[{j}]")
    # Anything else (Any, a nested dataclass) is checked where it is built.


_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(DatasetSpec) if f.name != "format"}
_CONFIG_KEYS = set(_SPEC_FIELDS)
"""The keys of a data set in a --config besides the format options: name, paths, weight, split, loss_weight."""


@functools.lru_cache(maxsize=1)
def _config_fields() -> dict[str, tuple[Any, str]]:
    """Every key a data set of a --config may hold -> (its declared type, its cli kind)."""
    out = {}
    for cls, names in ((DatasetSpec, _CONFIG_KEYS), (FormatOptions, {f.name for f in dataclasses.fields(FormatOptions)})):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in names:
                out[f.name] = (hints[f.name], (f.metadata.get("cli") or {}).get("kind", ""))
    return out


MAX_CONFIG_BYTES = 1 << 20
"""The largest --config file (a mix of data sets is a few KB)."""
MAX_CONFIG_DEPTH = 32
"""The deepest nesting of a --config (a data set's options nest 3 levels)."""
MAX_CONFIG_EXPANDED = 4 << 20
"""The most a --config may expand to, in characters of its values plus one per node, every alias
counted where it is used: YAML aliases let 1 MiB of text stand for gigabytes."""


def load_yaml(data: bytes, what: str) -> Any:
    """The YAML (or JSON) document ``data``, bounded: a PackstreamError line naming ``what`` when it is not
    UTF-8 or not YAML, nests deeper than :data:`MAX_CONFIG_DEPTH`, or expands (aliases counted at each use)
    past :data:`MAX_CONFIG_EXPANDED`.

    The bounds are checked on the parser's events, which come one at a time without recursion, before
    anything is built: a 50,000-level nesting or an alias bomb costs the time to read the file once.

    >>> load_yaml(b"{a: &x [1, 2], b: *x}", "--config c.yaml")
    {'a': [1, 2], 'b': [1, 2]}
    >>> load_yaml(b"{a: &x '" + b"z" * 1000 + b"', b: [" + b"*x, " * 5000 + b"]}", "--config c.yaml")
    Traceback (most recent call last):
    ...
    packers.errors.PackstreamError: --config c.yaml expands to more than 4,194,304 characters (its aliases repeat the values they name); write the values out, or share less
    """
    import yaml

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PackstreamError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        open_nodes: list[list] = []  # [anchor, expanded size] of each open mapping or sequence
        anchors: dict[str, int] = {}
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_nodes) >= MAX_CONFIG_DEPTH:
                    raise PackstreamError(f"{what} nests deeper than {MAX_CONFIG_DEPTH} levels; a config lists data "
                                          "sets and their options (see README, 'Several data sets')")
                open_nodes.append([event.anchor, 1])
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, size = open_nodes.pop()
            elif isinstance(event, yaml.ScalarEvent):
                anchor, size = event.anchor, 1 + len(event.value)
            elif isinstance(event, yaml.AliasEvent):
                anchor, size = None, anchors.get(event.anchor, 1)
            else:
                continue
            if anchor is not None:
                anchors[anchor] = size
            if open_nodes:
                open_nodes[-1][1] += size
                size = open_nodes[-1][1]
            if size > MAX_CONFIG_EXPANDED:
                raise PackstreamError(f"{what} expands to more than {MAX_CONFIG_EXPANDED:,} characters (its aliases "
                                      "repeat the values they name); write the values out, or share less")
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PackstreamError(f"{what} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:  # pragma: no cover - the depth bound comes first
        raise PackstreamError(f"{what} nests too deep") from None


def load_config(path: str, defaults: FormatOptions) -> tuple[DatasetSpec, ...]:
    """The data sets of a ``--config`` file (YAML or JSON); ``defaults`` are the format flags.

    ::

        datasets:
          - name: gsm8k
            paths: [data/gsm8k/train.jsonl]
            fields: {question: user, answer: assistant}
            weight: 0.5                  # a stable half, chosen by id hash
          - name: chats
            paths: [data/chats/]
            messages_field: conversation
            roles: {bot: assistant}
            weight: 2                    # every record twice, with distinct ids
            loss_weight: 0.5             # its tokens count half with Batching(loss_weighting="source")
            split: train_sft             # for datasets folders with several splits
    """
    doc = load_yaml(read_checked(path, what="--config file", limit=MAX_CONFIG_BYTES,
                                 fix="a config lists data sets in a few KB"), f"--config {show_path(path)}")
    path = show_path(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), list) or not doc["datasets"]:
        raise PackstreamError(f"--config {path} must hold 'datasets:', a non-empty list of data sets (see README)")
    extra = sorted(set(doc) - {"datasets"})
    if extra:
        raise PackstreamError(f"--config {path}: unknown top-level key(s) {extra}; only 'datasets' is read "
                              "(job options such as --max-tokens stay on the command line)")
    known = {f.name for f in dataclasses.fields(FormatOptions)}
    base = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(FormatOptions)}
    specs, names = [], set()
    for i, d in enumerate(doc["datasets"]):
        where = f"--config {path} datasets[{i}]"
        if not isinstance(d, dict):
            raise PackstreamError(f"{where} must be a mapping with at least 'paths'")
        unknown = sorted(set(d) - known - _CONFIG_KEYS)
        if unknown:
            import difflib

            hints = [h for k in unknown for h in difflib.get_close_matches(k, sorted(known | _CONFIG_KEYS), n=1)]
            raise PackstreamError(f"{where}: unknown key(s) {unknown}" + (f"; did you mean {hints}?" if hints else ""))
        types = _config_fields()
        for key, value in d.items():
            hint, kind = types[key]
            if key == "paths" and isinstance(value, str):
                continue  # one path, for a list of one
            try:
                check_type(value, hint, f"datasets[{i}].{key}", kind)
            except PackstreamError as e:
                raise PackstreamError(f"--config {path}: {e}") from None
        name = d.get("name") or f"dataset{i}"
        if name in names:
            raise PackstreamError(f"{where}: name {name!r} is used twice; give each data set its own name")
        names.add(name)
        paths = d.get("paths")
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise PackstreamError(f"{where}: 'paths' must be a file, glob or folder, or a list of them")
        # Relative paths are relative to the config file, so a config travels with its data.
        root = os.path.dirname(os.path.abspath(path))
        paths = [p if "://" in p or os.path.isabs(p) else os.path.normpath(os.path.join(root, p)) for p in paths]
        fmt = {k: v for k, v in d.items() if k in known}
        try:
            options = FormatOptions(**(base | fmt))
            specs.append(DatasetSpec(name=name, paths=tuple(paths), format=options, weight=d.get("weight", 1.0),
                                     split=d.get("split"), loss_weight=d.get("loss_weight", 1.0)))
        except PackstreamError as e:
            raise PackstreamError(f"{where} ({name}): {e}") from None
        except TypeError as e:  # a value of the wrong type, e.g. a list where a string belongs
            raise PackstreamError(f"{where} ({name}): {e}") from None
    return tuple(specs)
