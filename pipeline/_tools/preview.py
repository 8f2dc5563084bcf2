"""``packstream preview``: how the first records of each input are read, rendered and masked.

For the first ``n`` records of every input file: the shape the record was read as and how its
fields became turns, the rendered example with its training targets marked (colour on a
terminal, ``[[...]]`` otherwise), token counts, and what normalization did (turns dropped,
merged, trimmed; fields ignored); or the reason the record is refused, whose detail names the
fix. Records go through the same :class:`~pipeline._encode.Encoder` as ``packstream pack``, so
the tokens shown are the tokens that would be packed.

Inputs are checked and read by the job's own functions (:mod:`pipeline._read`), so preview and
``pack`` agree on every file and every position; local ones without importing Beam.
Like Axolotl's ``preprocess --debug``, without a training config.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator

from pipeline._formats import (KTO_TEXT_NOTE, TRANSCRIPT_NOTE, Reason, Rejected, conversations, detect,
                               pair_conversations)
from pipeline._options import Ids, PackOptions

def inputs(options: PackOptions) -> list:
    """The input files of every data set, as :class:`pipeline._read.InputFile`: the job's own input check
    (:func:`pipeline._read.expand_datasets`), so a FIFO, a fake ``.parquet`` or a broken ``.jsonl.gz`` is
    the same one error line here as in ``pack``."""
    from pipeline._read import expand_datasets

    return expand_datasets(options.datasets())[0]


def records(f, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` of one input, lazily, as the job reads them
    (:func:`pipeline._read.read_file`); a file that breaks off ends with a ``corrupt_input`` refusal,
    at the position the job's dead letter would have."""
    from pipeline._read import read_file, until_break

    return until_break(read_file(f, max_bytes))


def preview(options: PackOptions, n: int) -> list[dict]:
    """The first ``n`` records of each input, read, rendered and tokenized as ``pack`` would (see the module docstring).

    Each item: ``source``, ``position``, ``dataset``; then either ``reason`` and ``detail``, or
    ``format``, ``mapping`` (words), ``notes``, ``spans`` (``[(text, is_target), ...]`` decoded
    from the tokens; each image's placeholder run as one ``<image NAME: N tokens, grid TxHxW>``, each video's as
    ``<video NAME: N tokens, F frames, grid TxHxW>``), ``tokens`` and ``targets`` (counts); with ``--processor``,
    ``images`` (each image's or video's name under ``image`` or ``video``, ``grid_thw`` and ``tokens``; a video's
    sampled ``frames``) and ``image_tokens`` (images' and videos') for an example that holds some; with ``--pairs``,
    ``sides``: the spans of the pair's chosen and rejected sequences. ``format`` is set for refused records
    too when their shape was recognised.
    """
    from pipeline._encode import Encoder, input_folders

    files = inputs(options)
    encoder = Encoder(options, input_folders(files))
    tok = encoder.renderer.tok
    specs = options.datasets()
    items: list[dict] = []
    for f in files:
        fmt = specs[f.dataset].format
        first, own_ids = len(items), []
        for position, record in itertools.islice(records(f, options.max_record_bytes), n):
            own_ids.append(record.get("id") if isinstance(record, dict) else None)
            item: dict[str, Any] = {"source": f.source, "position": position, "dataset": specs[f.dataset].name}
            convs = []
            if not isinstance(record, Rejected):
                try:
                    if options.pairs:  # read as a pair whatever else its keys match (--pair-sides: no layout's keys)
                        # each side is read as --preference does; the mapping shown is the chosen side's
                        convs = [pair_conversations(record, fmt)[0]]
                        item["format"] = "preference"
                    else:
                        item["format"] = detect(record, fmt)
                        convs = conversations(record, fmt)
                except Rejected as r:
                    if options.pairs and r.reason is not Reason.NOT_A_PAIR:
                        item["format"] = "preference"  # a pair, refused (a tie, a prompt mismatch): say what it is
                    item["_refused"] = record
            encoded = encoder.encode([(f.dataset, f.source, position, record)])
            dead = {d.get("example_id"): d for d in encoded.rejected}
            packed = dict(zip(encoded.batch.ids, range(len(encoded.batch.ids))))
            # One item per example: a message tree's paths are shown one after the other (ids <id>~p2, ...).
            for k, eid in enumerate(_example_ids(encoded, len(convs))):
                it = dict(item, **({"path": k + 1} if len(convs) > 1 else {}))
                items.append(it)
                if k < len(convs):
                    it["mapping"], it["notes"] = list(convs[k].mapping), dict(convs[k].notes)
                    if options.pairs:  # both sides are packed: say so, not what --preference chosen would do
                        it["mapping"] = ["a preference pair: the shared prompt, then the chosen and the rejected "
                                         "answer, each a sequence (--pairs)"] + [
                            m for m in it["mapping"] if not m.startswith("a preference pair")]
                        it["notes"].pop("other_side_not_trained", None)
                if eid not in packed:
                    d = dead.get(eid) or encoded.rejected[0]
                    it["reason"], it["detail"] = d["reason"], d["detail"]
                    continue
                batch, i = encoded.batch, packed[eid]
                ids, mask = _example(batch, int(batch.offsets[i]), int(batch.offsets[i + 1]))
                it["tokens"], it["targets"] = len(ids), int(sum(mask))
                shown = _image_marks(batch, i, ids, mask, encoder.vision)
                if shown is not None:
                    ids, mask, it["images"] = shown
                    it["image_tokens"] = sum(im["tokens"] for im in it["images"])
                it["spans"] = [(_decode(tok, run_ids), bool(flag)) for flag, run_ids in _runs(ids, mask)]
                if batch.cuts is not None:  # a pair: its chosen and rejected sides, each on its own
                    cut = int(batch.cuts[i])  # in marked ids, each image run before it is one mark
                    cut -= sum(im["tokens"] - 1 for im in it.get("images", ())[:len(it.get("images", ())) // 2])
                    it["sides"] = [[(_decode(tok, r), bool(flag)) for flag, r in _runs(ids[x:y], mask[x:y])]
                                   for x, y in ((0, cut), (cut, len(ids)))]
        _fold_ids(items[first:], own_ids if fmt.ids is Ids.AUTO else [],
                  lambda rec: pair_conversations(rec, fmt) if options.pairs else conversations(rec, fmt))
    return items


def _fold_ids(items: list[dict], own_ids: list, read: Callable[[Any], Any]) -> None:
    """Where the sample's own ids repeat (Tulu: one record per completion, each with its prompt's id), each printed
    fix also names ``--ids position``: without it, the records the fix reads would be dead-lettered as
    ``duplicate_id`` but the first of each id (issue 42). ``read``: the reader whose refusal (its fix tried) the
    items show."""
    ids = [i for i in own_ids if isinstance(i, (str, int)) and not isinstance(i, bool) and i != ""]
    repeat = len(ids) != len(set(ids))
    for it in items:
        record = it.pop("_refused", None)
        if not repeat or record is None:
            continue
        try:
            read(record)
            continue
        except Rejected as e:
            r = e
        fix = r.fix
        if fix is None or fix.failed or it.get("detail") != r.detail or "ids" in dict(fix.options):
            continue
        ids_option = (("ids", Ids.POSITION),)  # last, unless the fix's last option carries an alternative
        options = ids_option + fix.options if fix.alternative is not None else fix.options + ids_option
        it["detail"] = r.with_fix(dataclasses.replace(fix, options=options)).detail + (
            " (ids repeat among the records shown: each is keyed by its file and position instead)")


_IMAGE_MARK = -1
"""Stands, in a previewed example's ids, for the whole placeholder run of one image (see :func:`_image_marks`)."""


def _image_marks(batch, i: int, ids: list[int], mask: list[int], vision
                 ) -> tuple[list[Any], list[int], list[dict]] | None:
    """Example ``i``'s ids and mask with each image's placeholder run cut to one mark that names the image, its grid
    and its token count (a 1,000-token run of ``<|image_pad|>`` says nothing), and the images as data; None without
    images."""
    images = getattr(batch, "images", None)
    if images is None or vision is None or images.index[i] == images.index[i + 1]:
        return None
    out: list[Any] = []
    out_mask: list[int] = []
    shown: list[dict] = []
    at = 0
    for k in range(int(images.index[i]), int(images.index[i + 1])):
        start, grid = int(images.offsets[k]), [int(v) for v in images.grids[k]]
        count = vision.grid_tokens(grid)
        path, data = images.refs[k]
        video = bool(images.video[k])
        item = {"video" if video else "image": path if path else f"<{len(data or b'')} bytes>", "grid_thw": grid,
                "tokens": count}
        runs = [(start, count)]
        if video:
            item["frames"] = grid[0] * vision.temporal_patch_size
            runs = vision.video_runs(ids, start, grid, len(ids)) or runs  # Qwen3-VL: a run per frame group
        for g, (a, n) in enumerate(runs):
            mark = item if g == 0 else {**item, "group": (g + 1, len(runs)), "tokens": n}
            out += ids[at:a] + [(_IMAGE_MARK, mark)]
            out_mask += mask[at:a] + [mask[a]]  # a placeholder run is never a target: one 0 stands for it
            at = a + n
        shown.append(item)
    return out + ids[at:], out_mask + mask[at:], shown


def _decode(tok, run: list[Any]) -> str:
    """A run of ids as text, each image mark as ``<image NAME: N tokens, grid TxHxW>``, each video's as
    ``<video NAME: N tokens, F frames, grid TxHxW>``."""
    text, plain = [], []
    for t in run:
        if isinstance(t, tuple):
            text.append(tok.decode(plain) if plain else "")
            plain = []
            im, grid = t[1], "x".join(map(str, t[1]["grid_thw"]))
            if "group" in im:  # a Qwen3-VL video's later frame group
                text.append(f"<video {im['video']}: frame group {im['group'][0]} of {im['group'][1]}>")
            elif "video" in im:
                text.append(f"<video {im['video']}: {im['tokens']} tokens, {im['frames']} frames, grid {grid}>")
            else:
                text.append(f"<image {im['image']}: {im['tokens']} tokens, grid {grid}>")
        else:
            plain.append(t)
    return "".join(text) + (tok.decode(plain) if plain else "")


def _media_counts(media: list[dict]) -> str:
    """`` (N in K images)``, `` (N in K images, M in J videos)`` or `` (M in J videos)``; "" without either."""
    parts = []
    for kind in ("image", "video"):
        mine = [m["tokens"] for m in media if kind in m]
        if mine:
            parts.append(f"{sum(mine)} in {len(mine)} {kind}s")
    return f" ({', '.join(parts)})" if parts else ""


def _example_ids(encoded, n: int) -> list:
    """The example ids one record gave, packed or dead-lettered, in order (one, or one per kept tree path)."""
    ids = list(dict.fromkeys([*encoded.batch.ids, *(d.get("example_id") for d in encoded.rejected)]))
    if n > 1:
        base = next((i for i in ids if i and "~p" not in i), None)
        if base is not None:
            return [base if k == 0 else f"{base}~p{k + 1}" for k in range(n)]
    return ids[:1] or [None]


def _example(batch, a: int, b: int) -> tuple[list[int], list[int]]:
    if hasattr(batch, "input_ids"):
        return batch.input_ids[a:b].tolist(), batch.loss_mask[a:b].tolist()
    return batch.tokens[0, a:b].tolist(), batch.tokens[1, a:b].tolist()


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return runs


_GREEN, _DIM, _RED, _BOLD, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[31m", "\x1b[1m", "\x1b[0m"


def format_preview(items: list[dict], color: bool) -> str:
    """Items of :func:`preview` as text: targets in green (``color``) or inside ``[[...]]``."""
    from pipeline._read import file_kind

    c = (lambda code, s: f"{code}{s}{_RESET}") if color else (lambda code, s: s)  # noqa: E731
    out: list[str] = []
    source = None
    for it in items:
        if it["source"] != source:
            source = it["source"]
            out.append(c(_BOLD, f"== {source}") + ("" if it["dataset"] == "default" else f"  (data set {it['dataset']})"))
        where = f"line {it['position']}" if file_kind(str(source)) == "jsonl" else f"record {it['position']}"
        shape = it.get("format", "shape not recognised")
        if "path" in it:  # one of the conversations of a message tree
            where += f", path {it['path']}"
        if "reason" in it:
            out.append(f"-- {where}: {shape}  " + c(_RED, f"REFUSED {it['reason']}"))
            out.append(f"   {it['detail']}")
            out.append("")
            continue
        images = _media_counts(it.get("images") or [])
        out.append(f"-- {where}: {shape}  {it['tokens']} tokens{images}, {it['targets']} trained")
        for line in it.get("mapping", []):
            out.append(f"   {line}")
        notes = it.get("notes") or {}
        if notes:
            out.append("   notes: " + ", ".join(f"{k} {v}" for k, v in sorted(notes.items())))
        for k in sorted(notes):
            if k.startswith(KTO_TEXT_NOTE):
                field = k[len(KTO_TEXT_NOTE):]
                out.append(c(_BOLD, f"   suggest: --kto-label {field}") + f" ({field} holds true/false "
                           "as text, which a CSV cell must; without it the record packs as plain SFT, unlabelled)")
            if k.startswith(TRANSCRIPT_NOTE):
                field = k[len(TRANSCRIPT_NOTE):]
                out.append(c(_BOLD, f"   suggest: --field {field}=transcript") + f" ({field} holds 'Human:'/'Assistant:' "
                           "turns; as plain text every turn is trained, the human ones too)")
        for k, spans in enumerate(it.get("sides") or [it["spans"]]):
            if "sides" in it:
                out.append(c(_BOLD, "   chosen:" if k == 0 else "   rejected:"))
            text = "".join(c(_GREEN, t) if y else c(_DIM, t) for t, y in spans) if color else \
                "".join(f"[[{t}]]" if y else t for t, y in spans)
            out.append(text)
        out.append("")
    if not color:
        out.append("[[...]]: training targets (loss mask 1)")
    return "\n".join(out).rstrip("\n") + "\n"
