"""``packstream repack``: packed folders of text rows to a new budget, mixture or split, without tokenizing again.

A repack is the pack its folders came from, run again at new row options, with each folder's examples read back
from its rows (:func:`pipeline._read.rows_batch`) in place of reading, rendering and tokenizing its raw inputs::

    packed folder(s)   manifest.json checked as the loader checks it (complete, text rows, readable version);
                       every shard and row checked (pipeline._read.open_shard) before an example is cut from it
    resolve            the equivalent pack: the folders' recorded options (tokenizer, template, every data set's
                       format options) with the repack's row options (--max-tokens, --mode, ...), its inputs
                       the folders' recorded inputs (named as one pack over them all names them) and any raw
                       inputs of a --config; the run id is that pack's, so the shards are byte-identical to it
    REPACK plan        spill (a packed shard -> its examples spilled per packing group, as encode spills a
                       read task's; a raw input's read task -> encode itself), then pack's own pack and write
                       stages and commit (pipeline._job._plan)

What the folders lost at their pack stays lost, and is carried with its reason: their dead letters (rejected.jsonl)
and counts (records read, normalization notes) go into the repack's. An example cut at pack time (``--long split``
pieces, ``--long truncate`` windows) is carried as it is, marked, never joined back (the summary says how many).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from packers import PackstreamError
from packers.files import show_path
from packers.manifest import MANIFEST, Manifest, escape_source, id_source
from pipeline import _read, _rows, _spill, _trace, _write
from pipeline._job._context import Layout, RunContext, input_entries
from pipeline._job._outputs import Failure, Rejects, Spilled, Stats
from pipeline._options import DatasetSpec, FormatOptions, PackOptions

ROW_OPTIONS = ("max_tokens", "mode", "group_size", "max_per_row", "refine", "seed", "validation_fraction", "num_shards",
               "output_format", "long", "truncate_side", "max_reject_fraction")
"""The options of ``pack`` a repack takes (with pack's rules and messages): how rows are made from examples. An option
not given is the folders' own (it must then agree between them)."""

RUN_OPTIONS = ("tokenizer", "chat_template", "pairs", "max_record_bytes", "batch_size", "processor")
"""A folder's options that decide what its examples are, beside each data set's format options: folders mixed in
one repack must agree on them (a raw input beside them is encoded with them)."""

ROWS_PER_PART = 4096
PART_TOKENS = 2**22
"""The most rows, and row tokens (a part's rows at the folder's budget), one element reads back and spills: memory
is a part's examples, bounded as a read task's in encode, whatever the folder's size."""
MIN_PART_ROWS = 64
PARTS_PER_WORKER = 4
"""A shard is cut into parts of about ``rows / (PARTS_PER_WORKER x workers)`` rows (within MIN_PART_ROWS ..
ROWS_PER_PART), so every worker respills some of even one big shard. The parts never change the output: a group's
examples are sorted by id before they are packed."""

CARRIED_COUNTS = ("records_read", "repeated_copies", "extra_paths", "not_sampled", "dropped_too_long_tokens",
                  "no_target_pieces", "no_target_piece_tokens")
"""A packed folder's counts a repack carries: what its pack read, copied and lost before its rows."""


@dataclasses.dataclass(frozen=True)
class PackedSource:
    """One packed folder a repack reads, as resolved at launch."""

    folder: str
    """Its absolute local path."""
    manifest_sha256: str
    """The sha256 of its manifest.json at launch: a folder changed under the run is refused."""
    run_id: str
    contract_version: int
    shards: tuple[tuple[str, int], ...]
    """The shards its manifest lists, in name order, with their rows."""
    files: tuple[_read.InputFile, ...]
    """Its recorded inputs, named and numbered (data set) as the repack names them."""
    renames: tuple[tuple[str, str], ...]
    """(escaped source as packed, escaped source as the repack names it), per input."""
    reweight: float = 1.0
    """A --config weight on the folder: below 1, keep that stable fraction of its examples; an integer above 1,
    repeat each; 1: as packed."""
    pairs: bool = False
    budget: int = 4096
    """The folder's ``--max-tokens``."""

    def lineage(self) -> dict:
        """The output manifest's ``repacked_from`` entry."""
        return {"folder": self.folder, "run_id": self.run_id, "manifest_sha256": self.manifest_sha256,
                "contract_version": self.contract_version}


@dataclasses.dataclass(frozen=True)
class PackedShard:
    """An element of the repack's source: rows ``[start, stop)`` of one shard of one packed folder (the part that
    starts at row 0 also checks the whole file's sha256)."""

    source: int
    name: str
    start: int = 0
    stop: int = 0

    @property
    def key(self) -> str:
        return f"packed-{self.source}-{self.name}-{self.start}"


@dataclasses.dataclass(frozen=True)
class PackedLosses:
    """An element of the repack's source: one packed folder's dead letters and counts, carried."""

    source: int

    @property
    def key(self) -> str:
        return f"losses-{self.source}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RepackOptions:
    """What ``packstream repack`` was asked: the folders (or a --config mixing them with raw inputs), the output, and
    the row options given (the rest are the folders' own)."""

    folders: tuple[str, ...] = ()
    config: Optional[str] = None
    """A --config file whose data sets name packed folders (each data set: folders only) or raw inputs."""
    output: str = ""
    rows: tuple[tuple[str, Any], ...] = ()
    """The :data:`ROW_OPTIONS` given, as (name, value)."""
    overwrite: bool = False
    workers: int = 0
    tokenizer_threads: int = 0
    force_workers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "folders", tuple(self.folders))
        object.__setattr__(self, "rows", tuple(self.rows))
        unknown = [k for k, _ in self.rows if k not in ROW_OPTIONS]
        if unknown:
            raise PackstreamError(f"repack takes the row options {', '.join(ROW_OPTIONS)}; not {unknown[0]!r}")
        if not self.folders and not self.config:
            raise PackstreamError("no packed folder given; pass the --output folder(s) of packstream pack, or --config")
        if self.folders and self.config:
            raise PackstreamError("give FOLDER arguments or --config, not both; list every folder in the config")
        if not self.output.strip():
            raise PackstreamError("--output is empty; give a folder for the repacked data, e.g. -o repacked/")


def is_packed_folder(path: str) -> bool:
    """A local folder holding a manifest.json: one a repack reads as packed rows, not as raw inputs."""
    return "://" not in path and os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))


def _remote_packed(path: str) -> bool:
    """A remote path holding a packstream manifest.json (never read as raw rows); False when it cannot be told."""
    from pipeline import _fs

    try:
        return bool(_fs.exists(path.rstrip("/") + "/" + MANIFEST))
    except Exception:  # noqa: BLE001 - no credentials, no such bucket: the raw reader says what is wrong
        return False


def _manifest_sha(folder: str) -> str:
    from packers.files import GiB, read_checked

    return hashlib.sha256(read_checked(os.path.join(folder, MANIFEST), what=MANIFEST, limit=GiB)).hexdigest()


@dataclasses.dataclass(frozen=True)
class _Folder:
    """A packed folder at launch: its manifest, checked, and where the repack's data set list puts it."""

    path: str
    manifest: Manifest
    sha: str
    dataset: Optional[DatasetSpec]
    """The --config data set that names it (None: a FOLDER argument)."""


def resolve(ropts: RepackOptions) -> tuple[PackOptions, tuple[PackedSource, ...], tuple[Manifest, ...],
                                           list[_read.InputFile], list[dict]]:
    """The equivalent pack of a repack: its options, the packed sources and their manifests (as read at launch),
    every input (named as that pack names them) and their sizes (:attr:`RunContext.sizes`). One PackstreamError line
    for anything a repack cannot map."""
    from pipeline._options import options_from_config

    order = _datasets(ropts)
    folders = [f for kind, value in order if kind == "packed" for f in value]
    _check_distinct(folders, ropts.output)
    if not folders:
        raise PackstreamError(f"--config {show_path(ropts.config)} names no packed folder; use packstream pack for "
                              "raw inputs alone")
    _check_compatible(folders)
    first = folders[0]
    datasets, plan = _equivalent_datasets(order, named=not ropts.config)
    single = not ropts.config and len(folders) == 1 and not first.manifest.config.get("config")
    if single:
        kw = dict(inputs=tuple(first.manifest.config.get("inputs") or ()), config=())
    else:  # a --config of every data set; the format flags at their defaults, as pack records a --config run's
        kw = dict(inputs=(), config=tuple(datasets),
                  **{f.name: getattr(FormatOptions(), f.name) for f in dataclasses.fields(FormatOptions)})
    try:
        options = dataclasses.replace(options_from_config(first.manifest.config, (), ropts.output), **kw,
                                      **_row_options(ropts, folders), output=ropts.output, overwrite=ropts.overwrite,
                                      workers=ropts.workers, tokenizer_threads=ropts.tokenizer_threads,
                                      force_workers=ropts.force_workers)
    except TypeError as e:
        raise PackstreamError(f"the folders' options cannot be read back ({e}); repack with the packstream that "
                              "packed them") from None
    files, sized = _equivalent_files(datasets, plan)
    named = {(x.path, x.split): x for x in files}
    sources = []
    for f, _, reweight in plan:
        mine = tuple(named[(e.path, e.split)] for e in _inputs(f))
        renames = tuple((escape_source(e.source), escape_source(x.source)) for e, x in zip(_inputs(f), mine))
        sources.append(PackedSource(folder=f.path, manifest_sha256=f.sha, run_id=f.manifest.run_id,
                                    contract_version=int(f.manifest.raw.get("contract_version")),
                                    shards=tuple((s.name, s.rows) for s in f.manifest.listed(None)), files=mine,
                                    renames=renames, reweight=reweight, pairs=bool(f.manifest.config.get("pairs")),
                                    budget=int(f.manifest.config.get("max_tokens") or 4096)))
    return (options, tuple(sources), tuple(f.manifest for f, _, _ in plan), files,
            [sized[(x.path, x.split)] for x in files])


def _datasets(ropts: RepackOptions) -> list[tuple[str, Any]]:
    """The repack's data sets in order: ``("raw", DatasetSpec)`` or ``("packed", [_Folder, ...])``."""
    from pipeline._options import load_config

    if not ropts.config:
        for p in ropts.folders:
            if "://" in p:
                raise PackstreamError(f"{p}: repack reads local folders only for now; copy the folder here first "
                                      "(gsutil -m cp -r, aws s3 sync), or pack its raw inputs on the cluster")
            if not is_packed_folder(p):
                what = "no such folder" if not os.path.exists(p) else "not a packed folder (no manifest.json)"
                raise PackstreamError(f"{show_path(p)}: {what}; repack takes the --output folders of packstream pack "
                                      "(raw inputs beside them go in a --config)")
        return [("packed", [_load(p, None)]) for p in ropts.folders]
    order: list[tuple[str, Any]] = []
    for spec in load_config(ropts.config, FormatOptions()):
        for p in spec.paths:
            if "://" in p and _remote_packed(p):
                raise PackstreamError(f"--config data set {spec.name!r}: {p} is a packed folder, and repack reads local "
                                      "folders only for now; copy it here first (gsutil -m cp -r, aws s3 sync)")
        packed = [p for p in spec.paths if is_packed_folder(p)]
        if packed and len(packed) != len(spec.paths):
            raw = next(p for p in spec.paths if p not in packed)
            raise PackstreamError(f"--config {show_path(ropts.config)} data set {spec.name!r} names packed folders "
                                  f"and raw inputs ({show_path(raw)}); give each its own data set")
        if not packed:
            order.append(("raw", spec))
            continue
        changed = [f.name for f in dataclasses.fields(FormatOptions)
                   if getattr(spec.format, f.name) != getattr(FormatOptions(), f.name)]
        if changed:
            raise PackstreamError(f"--config data set {spec.name!r} names packed folders, whose format options "
                                  f"their pack fixed; drop {', '.join(changed)} (repack reads rows, it renders "
                                  "nothing)")
        order.append(("packed", [_load(p, spec) for p in packed]))
    return order


def _row_options(ropts: RepackOptions, folders: Sequence[_Folder]) -> dict[str, Any]:
    """The row options given, and for each one not given the folders' own, which must then agree."""
    rows = dict(ropts.rows)
    for name in ROW_OPTIONS:
        if name in rows:
            continue
        values = {json.dumps(f.manifest.config.get(name), sort_keys=True) for f in folders}
        if len(values) > 1:
            flag = "--" + name.replace("_", "-")
            shown = ", ".join(f"{show_path(f.path)}: {f.manifest.config.get(name)!r}" for f in folders)
            raise PackstreamError(f"the folders were packed with different {flag} ({shown}); give {flag} to say "
                                  "which the repack uses")
        rows[name] = folders[0].manifest.config.get(name)
    return rows


def _equivalent_datasets(order: list[tuple[str, Any]], named: bool
                         ) -> tuple[list[DatasetSpec], list[tuple[_Folder, list[int], float]]]:
    """The equivalent pack's data sets (each folder's own, with its recorded paths and format options; the raw ones
    as given), and per folder: the indices of its data sets and the weight the repack puts on it."""
    datasets: list[DatasetSpec] = []
    plan: list[tuple[_Folder, list[int], float]] = []
    for kind, value in order:
        if kind == "raw":
            datasets.append(value)
            continue
        for f in value:
            own, reweight = _own_datasets(f, named=named), 1.0
            spec = f.dataset
            if spec is not None:
                if len(own) > 1 and (spec.weight != 1 or spec.loss_weight != 1):
                    raise PackstreamError(f"{show_path(f.path)} was packed from a --config of {len(own)} data sets; "
                                          "a weight or loss_weight on it in the repack config would apply to all of "
                                          "them: repack it at its own weights, or pack its raw inputs")
                if spec.weight != 1 and any(d.weight != 1 for d in own):
                    raise PackstreamError(f"{show_path(f.path)} was packed with weight {own[0].weight} (data set "
                                          f"{own[0].name!r}); a weight in the repack config would sample it again: "
                                          "give it weight 1, or pack its raw inputs at the weight you want")
                reweight = spec.weight
                if len(own) == 1:
                    own = [dataclasses.replace(own[0], name=spec.name, weight=spec.weight, loss_weight=spec.loss_weight)]
            plan.append((f, list(range(len(datasets), len(datasets) + len(own))), reweight))
            datasets.extend(own)
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise PackstreamError(f"two data sets of the repack are named {dup!r} (the folders' own names); repack them "
                              "through a --config that names each")
    return datasets, plan


def _equivalent_files(datasets: list[DatasetSpec], plan: list[tuple[_Folder, list[int], float]]
                      ) -> tuple[list[_read.InputFile], dict[tuple[str, str], dict]]:
    """Every input of the equivalent pack (the folders' recorded ones, the raw data sets' expanded), named as one
    pack over them all names them, and each one's size (recorded, or estimated for a folder from before)."""
    files: list[_read.InputFile] = []
    sized: dict[tuple[str, str], dict] = {}
    for f, indices, _ in plan:
        sizes = f.manifest.raw.get("input_sizes")
        for k, entry in enumerate(_inputs(f)):
            d = indices[entry.dataset] if entry.dataset < len(indices) else indices[0]
            files.append(dataclasses.replace(entry, dataset=d, text_split=_text_split(datasets[d], entry.kind)))
            sized[(entry.path, entry.split)] = (sizes[k] if isinstance(sizes, list) and k < len(sizes)
                                                and isinstance(sizes[k], dict) else _estimated_size(f.manifest))
    raw = [(i, s) for i, s in enumerate(datasets) if not any(i in ix for _, ix, _ in plan)]
    if raw:
        found, _, _ = _read.expand_datasets(tuple(s for _, s in raw))
        for x in found:
            files.append(dataclasses.replace(x, dataset=raw[x.dataset][0]))
            sized[(x.path, x.split)] = {"records": int(_read.expected_records(x)), "bytes": int(_read.input_bytes(x))}
    seen: set[tuple[str, str]] = set()
    for x in files:
        key = (os.path.realpath(x.path) if "://" not in x.path else x.path, x.split)
        if key in seen:
            raise PackstreamError(f"input {show_path(x.path)} is in two of the repack's sources (two packed folders, "
                                  "or a folder and a raw data set); its records would be packed twice: give each once")
        seen.add(key)
    return _read.rename_sources(files), sized


def _load(path: str, spec: Optional[DatasetSpec]) -> _Folder:
    """A packed folder, checked at launch: its manifest (as the loader checks it) and every listed shard there at
    its recorded size (the bytes and rows are checked as each shard is read)."""
    from packers.manifest import RESTORE

    folder = os.path.abspath(path)
    m = _read.open_folder(folder)
    for s in m.listed(None):
        try:
            size = os.stat(os.path.join(folder, s.name)).st_size
        except OSError:
            raise PackstreamError(f"{show_path(folder)}/{s.name}: listed in {MANIFEST} but missing; {RESTORE}") from None
        if size != s.bytes:
            raise PackstreamError(f"{show_path(folder)}/{s.name}: {size:,} bytes, {MANIFEST} says {s.bytes:,}; "
                                  f"{RESTORE}")
    return _Folder(folder, m, _manifest_sha(folder), spec)


def _own_datasets(f: _Folder, named: bool) -> list[DatasetSpec]:
    """The data sets a folder was packed from, as its manifest records them, their paths absolute (a relative INPUT
    joined to the folder its pack started in). ``named``: the one data set of a pack without --config takes the
    folder's name (``default`` is every such pack's)."""
    from pipeline._options import options_from_config

    opts = options_from_config(f.manifest.config, (), "-")
    base = f.manifest.raw.get("inputs_from")
    out = []
    for d in opts.datasets():
        paths = tuple(os.path.normpath(os.path.join(base, p)) if isinstance(base, str) and _read.relative_input(p)
                      else p for p in d.paths)
        name = os.path.basename(f.path.rstrip(os.sep)) if named and not opts.config else d.name
        out.append(dataclasses.replace(d, paths=paths, name=name))
    return out


def _inputs(f: _Folder) -> list[_read.InputFile]:
    """A folder's recorded inputs (the manifest's ``inputs``), as the InputFiles its pack read."""
    out = []
    for i, e in enumerate(f.manifest.raw.get("inputs") or ()):
        try:
            out.append(_read.InputFile(str(e["path"]), str(e["source"]), str(e["kind"]), str(e.get("split") or ""),
                                       int(e.get("dataset") or 0)))
        except (KeyError, TypeError, ValueError):
            raise PackstreamError(f"{show_path(f.path)}/{MANIFEST} inputs[{i}] is not a path, source, kind, split and "
                                  "data set: it was not written by packstream pack") from None
    return out


def _text_split(spec: DatasetSpec, kind: str) -> str:
    return spec.format.text_split.value if kind == "text" else ""


def _estimated_size(m: Manifest) -> dict:
    """A folder packed before ``input_sizes``: sized from what it read (its records) and its shards' bytes."""
    per = max(1, len(m.inputs))
    records = int((m.counts.records_read if m.counts else 0) or 0)
    return {"records": records // per, "bytes": sum(s.bytes for s in m.listed(None)) // per}


def _check_distinct(folders: Sequence[_Folder], output: str) -> None:
    """A folder given twice, or the output among the folders (or inside one): one line."""
    seen: dict[str, str] = {}
    out = os.path.realpath(os.path.abspath(output)) if "://" not in output else output
    for f in folders:
        real = os.path.realpath(f.path)
        if real in seen:
            raise PackstreamError(f"packed folder {show_path(f.path)} is given twice; give each folder once "
                                  "(a --config weight repeats one)")
        seen[real] = f.path
        if out == real or out.startswith(real + os.sep):
            raise PackstreamError(f"--output {show_path(output)} is the packed folder {show_path(f.path)} it reads "
                                  "(or inside it); repack into a new folder, e.g. -o "
                                  f"{show_path(f.path.rstrip(os.sep) + '-repacked')}")


def _check_compatible(folders: Sequence[_Folder]) -> None:
    """Folders mixed in one repack hold examples of one tokenizer, template and kind: else one line naming the
    difference."""
    a = folders[0]
    for b in folders[1:]:
        ta, tb = a.manifest.raw.get("tokenizer") or {}, b.manifest.raw.get("tokenizer") or {}
        for key, what in (("vocab_sha256", "tokenizer vocabulary"), ("name", "tokenizer"),
                          ("chat_template", "chat template"), ("eos_token_id", "EOS token")):
            if ta.get(key) != tb.get(key):
                raise PackstreamError(
                    f"{show_path(a.path)} and {show_path(b.path)} were packed with different {what}s "
                    f"({str(ta.get(key))[:24]!r} and {str(tb.get(key))[:24]!r}); their token ids do not mix: repack "
                    "them apart, or pack the raw inputs with one tokenizer")
        for key in RUN_OPTIONS:
            va, vb = a.manifest.config.get(key), b.manifest.config.get(key)
            if va != vb:
                flag = "--" + key.replace("_", "-")
                raise PackstreamError(f"{show_path(a.path)} and {show_path(b.path)} were packed with different {flag} "
                                      f"({str(va)[:40]!r} and {str(vb)[:40]!r}); a repack mixes examples of one run's "
                                      "rules: repack them apart, or pack the raw inputs together")


# --- the plan's source and its first stage -------------------------------------------------------------------------


def repack_inputs(ctx: RunContext) -> list:
    """The repack's source: its raw inputs (read and encoded as pack does), each packed folder's losses, and every
    packed shard."""
    out: list = list(ctx.read_files())
    rows = sum(n for src in ctx.packed for _, n in src.shards)
    workers = ctx.options.workers or 4  # a cluster: parts for a few workers' worth of spreading
    for i, src in enumerate(ctx.packed):
        most = max(1, min(ROWS_PER_PART, PART_TOKENS // max(1, src.budget)))
        part = min(most, max(MIN_PART_ROWS, -(-rows // (PARTS_PER_WORKER * workers))))
        out.append(PackedLosses(i))
        for name, n in src.shards:
            out.extend(PackedShard(i, name, a, min(a + part, n)) for a in range(0, max(n, 1), part))
    return out


def repack_cut(element: Any, ctx: RunContext) -> list:
    """A raw input's read tasks; a packed element is one element."""
    if isinstance(element, (PackedShard, PackedLosses)):
        return [element]
    from pipeline._job._steps import cut_tasks

    return cut_tasks(element, ctx.task_bytes)


def element_key(element: Any) -> str:
    return element.key if isinstance(element, (PackedShard, PackedLosses)) else element.name


def element_weight(element: Any) -> float:
    """Packed shards first, by size (a raw read task: its own weight, :func:`pipeline._job._plan.task_weight`)."""
    if isinstance(element, PackedLosses):
        return 0.0
    if isinstance(element, PackedShard):
        return float("inf")
    from pipeline._job._steps import task_weight

    return task_weight(element)


class SpillExamples:
    """The repack's first stage: a packed shard -> its examples spilled per packing group (:class:`Spilled`, as
    encode spills a read task's), a folder's losses -> its dead letters and counts, carried; a raw input's read
    task -> :class:`pipeline._job._steps.EncodeTasks` (started on the first one: a repack of packed folders alone
    never loads the tokenizer)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.encode = None
        self.manifests: dict[int, Manifest] = {}

    def teardown(self):
        if self.encode is not None:
            self.encode.teardown()

    def process(self, element):
        if isinstance(element, (PackedShard, PackedLosses)):
            try:
                with _trace.span("respill", element=element.key):
                    yield from (self._shard(element) if isinstance(element, PackedShard) else self._losses(element))
            except (OSError, PackstreamError) as e:
                yield Failure.of(e, self.ctx.output)
            return
        if self.encode is None:
            from pipeline._job._steps import EncodeTasks

            self.encode = EncodeTasks(self.ctx)
            self.encode.setup()
        yield from self.encode.process(element)

    def _manifest(self, i: int) -> Manifest:
        m = self.manifests.get(i)
        if m is None:
            src = self.ctx.packed[i]
            if _manifest_sha(src.folder) != src.manifest_sha256:
                raise PackstreamError(f"{show_path(src.folder)}/{MANIFEST} changed while the repack ran; run it again")
            m = self.manifests[i] = _read.open_folder(src.folder)
        return m

    def _shard(self, element: PackedShard):
        """Rows ``[start, stop)`` of a packed shard -> their examples, spilled per packing group (the shard is
        memory-mapped: memory stays a part's examples, as a read task's in encode)."""
        ctx, src = self.ctx, self.ctx.packed[element.source]
        m = self._manifest(element.source)
        entry = next(s for s in m.listed(None) if s.name == element.name)
        table = _read.open_shard(src.folder, m, entry, rows=(element.start, element.stop),
                                 digest=element.start == 0)
        stats: dict[str, int] = {}
        batch, marks = _read.rows_batch(table, src.pairs)
        batch = self._weighted(_renamed(_marked(batch, marks, src), src), src, stats)
        keys = [ctx.layout.key(_whole_id(eid), ctx.options.validation_fraction) for eid in batch.ids]
        for split in ("train", "validation"):
            which = [i for i, k in enumerate(keys) if k[0] == split]
            if not which:
                continue
            sub = batch if len(which) == len(batch) else batch.take(which)
            groups = np.array([keys[i][1] for i in which], dtype=np.int64)
            for sl in _spill.write_part(ctx.spill, f"{element.key}-{split}", sub, groups):
                yield Spilled(split, sl.group, sl)
            stats[f"examples_{split}"] = stats.get(f"examples_{split}", 0) + len(which)
        yield Stats(stats)

    def _weighted(self, batch: _rows.ExampleBatch, src: PackedSource, stats: dict) -> _rows.ExampleBatch:
        """A --config weight on the folder, applied as pack applies it to its records: a stable fraction by the
        record's id (seeded), or each example again as ``<id>~k``."""
        w = src.reweight
        if w == 1:
            return batch
        if w < 1:
            seed = self.ctx.options.seed
            keep = [i for i, eid in enumerate(batch.ids)
                    if _rows.stable_hash(_record_id(eid), salt=f"sample:{seed}") < w * 2**64]
            stats["not_sampled"] = stats.get("not_sampled", 0) + len(batch) - len(keep)
            return batch.take(keep)
        parts = [batch]
        for copy in range(2, int(w) + 1):
            part = batch.take(range(len(batch)))
            parts.append(dataclasses.replace(part, ids=[_copy_id(eid, copy) for eid in part.ids]))
        stats["repeated_copies"] = stats.get("repeated_copies", 0) + (int(w) - 1) * len(batch)
        return _rows.ExampleBatch.concat(parts)

    def _losses(self, element: PackedLosses):
        """A folder's dead letters (renamed, and sampled as its examples are) and the counts its pack carried."""
        src = self.ctx.packed[element.source]
        m = self._manifest(element.source)
        counts = dict(m.raw.get("counts") or {})
        stats = {k: int(counts.get(k) or 0) for k in CARRIED_COUNTS}
        for k, v in (counts.get("normalization") or {}).items():
            stats[k] = stats.get(k, 0) + int(v)
        renames = dict(src.renames)
        names = {old: x.source for (old, _), x in zip(src.renames, src.files)}
        kept: list[dict] = []
        path = os.path.join(src.folder, m.raw.get("rejected_file") or "rejected.jsonl")
        w, seed = src.reweight, self.ctx.options.seed
        if os.path.isfile(path):
            from packers.files import open_checked

            with open_checked(path, what="rejected.jsonl") as f:
                for line in f:
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    esc = escape_source(rec["source"])
                    rec["source"] = names.get(esc, rec["source"])
                    eid = rec.get("example_id")
                    if isinstance(eid, str):
                        old = id_source(eid)
                        eid = rec["example_id"] = renames.get(old, old) + eid[len(old):]
                        if w < 1 and not _rows.stable_hash(_record_id(eid), salt=f"sample:{seed}") < w * 2**64:
                            stats["not_sampled"] += 1
                            continue
                    kept.append(rec)
        part = _write.write_reject_part(self.ctx.spill, element.key, kept)
        if part:
            yield Rejects(part)
        yield Stats(stats)


def _marked(batch: _rows.ExampleBatch, marks: Optional[np.ndarray], src: PackedSource) -> _rows.ExampleBatch:
    """The batch with the cut marks its rows hold (version 9: the ``cuts`` column, per sequence; a pair's two sides
    side by side), or, for a version-6 folder (no marks), ``[-1, -1]`` on each piece (``<id>#k``): a piece of an
    example split by an older packstream, count unknown. Version 6 never marked a truncated window."""
    if marks is not None:
        return batch.with_marks(marks.reshape(len(batch), -1))
    if src.pairs:
        return batch
    piece = [i for i, eid in enumerate(batch.ids) if _rows.whole_id(eid) != eid]
    if not piece:
        return batch
    found = np.zeros((len(batch), 2), np.int32)
    found[piece] = -1
    return batch.with_marks(found)


_SOURCE_END = re.compile(r"[:@]")
_POSITION = re.compile(r"@(\d+)(?=[~#]|$)")


def _renamed(batch: _rows.ExampleBatch, src: PackedSource) -> _rows.ExampleBatch:
    """The batch's ids with their sources as the repack names them, and each example's source and position (its
    line or index, where its id holds it: ``src@7``; else 0: packed rows keep no position, and the dead letter of
    such a record names it by its ``example_id``)."""
    renames = dict(src.renames)
    names = {new: x.source for (_, new), x in zip(src.renames, src.files)}
    same = all(old == new for old, new in src.renames)
    ids, sources, positions = [], [], []
    for eid in batch.ids:
        m = _SOURCE_END.search(eid)
        cut = m.start() if m else len(eid)
        old = eid[:cut]
        new = old if same else renames.get(old, old)
        ids.append(eid if new == old else new + eid[cut:])
        sources.append(names.get(new, new))
        p = _POSITION.match(eid, cut)
        positions.append(int(p.group(1)) if p else 0)  # rows keep no position: a record's own id names it
    return dataclasses.replace(batch, ids=ids, sources=sources, positions=positions)


def _whole_id(eid: str) -> str:
    """The id of the example a piece was cut from (``x#2`` -> ``x``): pack keys an example's split and group before
    cutting it, so a repack keeps every piece of one example in one split and group."""
    return _rows.whole_id(eid)


def _record_id(eid: str) -> str:
    """The id pack samples a record by: before any tree path or copy (``~``) and piece (``#k``) suffix."""
    return _whole_id(eid).split("~", 1)[0]


def _copy_id(eid: str, copy: int) -> str:
    """Copy ``copy`` of an example, as pack names it: ``x~2``, and for a piece ``x~2#1`` (pack repeats before it
    cuts)."""
    whole = _whole_id(eid)
    return f"{whole}~{copy}{eid[len(whole):]}"


# --- the context --------------------------------------------------------------------------------------------------


def _lost_notes(sources: Sequence[PackedSource], manifests: Sequence[Manifest], options: PackOptions) -> list[str]:
    """One line per folder whose pack lost or cut examples at its budget: a repack carries what the rows hold,
    so those examples are missing (dropped) or stay cut (truncated, split) at the new budget too."""
    notes = []
    for src, m in zip(sources, manifests):
        c, budget = m.raw.get("counts") or {}, m.config.get("max_tokens")
        where = show_path(src.folder)
        dropped = int(c.get("dropped_too_long") or 0)
        if dropped and options.max_tokens > (budget or 0):
            notes.append(f"{where} dropped {dropped:,} records longer than its budget {budget} (--long drop): its rows "
                         f"do not hold them, so this repack at {options.max_tokens} lacks them too; pack the raw inputs "
                         "to include them")
        cut = int(c.get("truncated_examples") or 0) + int(c.get("split_examples") or 0)
        if cut:
            notes.append(f"{where} cut {cut:,} examples at its budget {budget} ({int(c.get('truncated_examples') or 0):,} "
                         f"truncated, {int(c.get('split_examples') or 0):,} split): carried as they were cut, never "
                         "joined back; pack the raw inputs to cut them at this budget")
    return notes


def context(ropts: RepackOptions, run_id: str, task_bytes: int = _read.TASK_BYTES) -> RunContext:
    """The repack's :class:`RunContext`: the equivalent pack's options, inputs, tokenizer, layout and run id."""
    options, sources, manifests, files, sizes = resolve(ropts)
    first = manifests[0]
    tokenizer = dict(first.raw.get("tokenizer") or {})
    weights = [d.weight for d in options.datasets()]
    records = sum(s["records"] * weights[f.dataset] for s, f in zip(sizes, files))
    groups, shards = _write.shard_layout(options, records, sum(s["bytes"] for s in sizes))
    digest = _write.run_digest(options.to_dict(), input_entries(files), tokenizer)
    inputs_from = first.raw.get("inputs_from") if not options.config else None
    return RunContext(options=options, files=tuple(files), read_once=(), tokenizer=tokenizer,
                      layout=Layout(groups, shards), run_id=run_id, digest=digest,
                      notes=tuple(_write.shard_cap_notes(options, shards)) + tuple(_lost_notes(sources, manifests, options)),
                      spill=_spill.spill_folder(options.output, run_id), task_bytes=task_bytes,
                      inputs_from=inputs_from if isinstance(inputs_from, str) else None,
                      sizes=tuple(sizes), packed=sources)
