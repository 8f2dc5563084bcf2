"""What ``packstream pack`` runs: :class:`PackOptions` (a :class:`FormatOptions` plus the job's own options), and
the :class:`DatasetSpec` s of a ``--config`` mix."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Optional, Sequence

from packers import LongPolicy, PackstreamError, VisionSpec
from packers.schema import MAX_TOKENS_LIMIT
from pipeline._options._fields import cli, jsonable, option_enum
from pipeline._options._format import FormatOptions
from pipeline._options._modes import DEFAULT_TOKENIZER, ImageStorage, OutputFormat, PackMode, TrainOn, TruncateSide


MAX_SEED = 2**63 - 1
"""The largest --seed: seeds feed numpy's and Python's generators (which refuse a negative one) and
hash salts; one range, checked once here, for every tool."""

MAX_REPEAT = 1000
"""The largest repeat weight of a data set: each record is read, tokenized and packed that many times."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """One data set of a ``--config`` mix: its inputs, its shape, and how much of it to take."""

    name: str
    paths: tuple[str, ...]
    format: FormatOptions
    weight: float = 1.0
    """Below 1: keep that fraction, chosen by a stable hash of the example id. An integer above 1:
    repeat every record that many times, each copy with its own id (``...~2``)."""
    split: Optional[str] = None
    """The split to read from a ``datasets`` DatasetDict folder (e.g. ``train_sft``)."""
    loss_weight: float = 1.0
    """What each of this data set's target tokens counts in the loss, relative to the other data sets', when
    training with ``PackedDataset(batching=Batching(loss_weighting="source"))`` (recorded in the manifest; ``weight`` decides how
    many records are packed, this how much their tokens count)."""

    def __post_init__(self) -> None:
        lw = self.loss_weight
        if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not math.isfinite(lw) or lw < 0:
            raise PackstreamError(f"dataset {self.name!r}: loss_weight {lw!r} must be a finite number >= 0")
        if not self.paths:
            raise PackstreamError(f"dataset {self.name!r} has no paths; give it 'paths: [FILE, ...]'")
        w = self.weight
        if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                or not (0 < w <= 1 or (w > 1 and float(w).is_integer()))):
            raise PackstreamError(
                f"dataset {self.name!r}: weight {w!r} must be a fraction in (0, 1] (sample) or an integer > 1 (repeat)"
            )
        if w > MAX_REPEAT:
            raise PackstreamError(
                f"dataset {self.name!r}: weight {w!r} would repeat every record {w:,.0f} times, above the limit of "
                f"{MAX_REPEAT:,} repeats; use a weight of at most {MAX_REPEAT} (or a fraction in (0, 1] to sample)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "paths": list(self.paths), "weight": self.weight, "split": self.split,
                "loss_weight": self.loss_weight, **self.format.format_dict()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackOptions(FormatOptions):
    """Options of ``packstream pack``: the format options of the one-dataset shortcut, plus the job's."""

    inputs: tuple[str, ...] = dataclasses.field(default=(), metadata={"doc": "INPUT arguments"})
    """Files, globs or folders: local, gs://, s3:// (anything Beam's FileSystems reads)."""
    output: str = dataclasses.field(default="", metadata=cli(
        "--output", "Output folder (local, gs://, s3://); packstream owns it: it must be empty, or hold an earlier "
        "packstream output (replaced only with --overwrite).", short="-o", metavar="DIR", commands=("pack",)))
    config: tuple[DatasetSpec, ...] = dataclasses.field(default=(), metadata=cli(
        "--config", "A YAML (or JSON) mix of data sets, each with its own paths, format options, weight and split "
        "(see README, 'Several data sets'); the flags above are their defaults.", metavar="FILE", kind="config"))
    tokenizer: str = dataclasses.field(default=DEFAULT_TOKENIZER, metadata=cli(
        "--tokenizer", "Hugging Face tokenizer name or local path (fast tokenizers only).", metavar="NAME"))
    max_tokens: int = dataclasses.field(default=4096, metadata=cli(
        "--max-tokens", "Token budget of every packed row.", metavar="N"))
    chat_template: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--chat-template", "Jinja chat template file overriding the tokenizer's own and the built-in ChatML.",
        metavar="FILE", kind="file"))
    long: LongPolicy = dataclasses.field(default=LongPolicy.DROP, metadata=cli(
        "--long", "Examples longer than --max-tokens: drop (dead-lettered), truncate, or split. Pieces without a "
        "target token are dropped and counted."))
    truncate_side: TruncateSide = dataclasses.field(default=TruncateSide.RIGHT, metadata=cli(
        "--truncate-side", "With --long truncate: keep the start (right) or the end (left) of the example."))
    pairs: bool = dataclasses.field(default=False, metadata=cli(
        "--pairs", "Preference pairs (DPO, ORPO, SimPO): read chosen/rejected records (see docs/formats.md), render "
        "each side with the chat template, train on each side's completion only; both sides share one prompt and "
        "sit next to each other in one row, chosen first. --long: drop a pair, or truncate both completions at "
        "one length.", kind="switch"))
    processor: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--processor", "Pack image+text records for a vision-language model: a shipped processor (qwen2-vl, "
        "qwen2.5-vl, qwen3-vl, llava-1.5, internvl3, gemma3) or the model's folder (its preprocessor_config.json). Each image "
        "counts the tokens the processor expands it to, so rows stay within --max-tokens; pass the model's tokenizer "
        "with --tokenizer. Without it, records with images are refused (non_text_content).", metavar="NAME|PATH"))
    media_root: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--media-root", "With --processor: the folder relative image paths resolve against [default: the folder of "
        "the input file that names them].", metavar="DIR"))
    images: ImageStorage = dataclasses.field(default=ImageStorage.REFERENCE, metadata=cli(
        "--images", "With --processor: how rows carry an image the record names by a local path. reference: its "
        "absolute path (train where the files are, or map moved folders with PixelLoader(remap=...)); embed: the "
        "file's encoded bytes, so the shards train anywhere (at most 64 MiB per file; larger ones are bad_image). "
        "Images the record holds as bytes or data URLs are stored as bytes either way.",
        commands=("pack", "estimate")))
    image_max_pixels: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--image-max-pixels", "With --processor (Qwen family): the most pixels an image is resized to, as the "
        "processor's max_pixels (LLaMA-Factory's image_max_pixels; 589824 is 768x768, which keeps a 4000x3000 photo "
        "at 713 tokens instead of 15,301 under qwen2-vl). Recorded in the manifest and in the shards' vision spec; "
        "the loader resizes with the same limit. [default: the processor's]", metavar="N"))
    image_min_pixels: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--image-min-pixels", "With --processor (Qwen family): the fewest pixels an image is resized to, as the "
        "processor's min_pixels (LLaMA-Factory's image_min_pixels). Recorded like --image-max-pixels. "
        "[default: the processor's]", metavar="N"))
    video_fps: Optional[float] = dataclasses.field(default=None, metadata=cli(
        "--video-fps", "With --processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): pack videos ({\"type\": \"video\"} "
        "parts, a 'videos' column with <video>), sampling this many frames per second as the family's transformers "
        "video processor does (2 is Qwen's default; Qwen3-VL: a <t seconds> timestamp per frame group, as its "
        "processor writes it). Recorded in the manifest and the shards' vision spec; the loader samples the same "
        "frames. [default: videos are refused]", metavar="FPS"))
    video_max_frames: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--video-max-frames", "With --video-fps: the most frames sampled from one video (the video processor's "
        "max_frames). [default: 768]", metavar="N"))
    video_max_pixels: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--video-max-pixels", "With --video-fps: the most pixels a video frame is resized to (the video processor's "
        "size.longest_edge; Qwen3-VL: all sampled frames together). [default: 602112; Qwen3-VL 786432]", metavar="N"))
    video_min_pixels: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--video-min-pixels", "With --video-fps: the fewest pixels a video frame is resized to (the video "
        "processor's size.shortest_edge; Qwen3-VL: all sampled frames together). [default: 100352; Qwen3-VL "
        "131072]", metavar="N"))
    max_per_row: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--max-per-row", "Cap on examples per row.", metavar="N"))
    refine: bool = dataclasses.field(default=True, metadata=cli(
        "--refine", "After best-fit decreasing, try exact fill (minimum bin slack) per group and keep the fewer "
        "rows. Off when --max-per-row is set.", kind="flag"))
    group_size: int = dataclasses.field(default=10_000, metadata=cli(
        "--group-size", "Examples per packing group (grouped mode); bounds each worker's memory.", metavar="N"))
    mode: PackMode = dataclasses.field(default=PackMode.GROUPED, metadata=cli(
        "--mode", "grouped: pack bounded groups; global: each split as one group (the last bit of fill; its memory "
        "grows with the data)."))
    seed: int = dataclasses.field(default=0, metadata=cli("--seed", "Seed of the row shuffle and of sampling.",
                                                          metavar="N"))
    validation_fraction: float = dataclasses.field(default=0.0, metadata=cli(
        "--validation-fraction", "Hold out this fraction of examples (by a stable hash of the id) into "
        "validation-*.arrow shards, the 'validation' split of load_dataset(DIR).", metavar="F"))
    num_shards: int = dataclasses.field(default=0, metadata=cli(
        "--num-shards", "Output shards per split (0: about one per 64M tokens of input); at most one per 1,000 records "
        "(or per --group-size, if smaller, down to 8).", metavar="N",
        commands=("pack", "estimate")))
    output_format: OutputFormat = dataclasses.field(default=OutputFormat.ARROW, metadata=cli(
        "--output-format", "arrow (zero-copy loading) or parquet.", commands=("pack", "estimate")))
    max_record_bytes: int = dataclasses.field(default=16 * 2**20, metadata=cli(
        "--max-record-bytes", "Records larger than this are dead-lettered before parsing.", metavar="N"))
    max_reject_fraction: float = dataclasses.field(default=0.5, metadata=cli(
        "--max-reject-fraction", "Fail (exit 3, no complete manifest; the counts and rejected.jsonl still written) "
        "when more than this fraction of records is rejected or dropped; 1 never fails.", metavar="F",
        commands=("pack",)))
    trust_remote_code: bool = dataclasses.field(default=False, metadata=cli(
        "--trust-remote-code", "Allow tokenizers with custom code (off by default).", kind="switch"))
    overwrite: bool = dataclasses.field(default=False, metadata=cli(
        "--overwrite", "Replace an earlier packstream output in --output (only the files its manifest lists), or "
        "break the lock a killed run left.", kind="switch", commands=("pack",)))
    batch_size: int = dataclasses.field(default=512, metadata=cli(
        "--batch-size", "Records per tokenizer batch (one Beam element).", metavar="N"))
    workers: int = dataclasses.field(default=0, metadata=cli(
        "--workers", "Local worker processes; auto (0) picks workers and tokenizer threads from the cores and "
        "the input's size (see docs/operations.md, 'Workers').", metavar="N|auto", kind="auto",
        commands=("pack", "estimate")))
    tokenizer_threads: int = dataclasses.field(default=0, metadata=cli(
        "--tokenizer-threads", "Tokenizer threads in each worker process; auto (0): locally the cores shared out "
        "over --workers, on a cluster the tokenizer's default (every core of the worker's machine).",
        metavar="N|auto", kind="auto", commands=("pack", "estimate")))
    force_workers: bool = dataclasses.field(default=False, metadata=cli(
        "--force-workers", "Allow --workers above 4 per core (each worker holds a tokenizer, ~0.4 GB).",
        kind="switch", commands=("pack",)))

    _NOT_RECORDED = ("overwrite", "workers", "tokenizer_threads", "force_workers")
    """How this run treated the folder and the machine, not what it produced: reruns stay identical."""
    _RECORDED_WHEN_SET = ("processor", "media_root", "images", "image_max_pixels", "image_min_pixels", "video_fps",
                          "video_max_frames", "video_max_pixels", "video_min_pixels")
    """Options of image runs: recorded only when not at their default, so a text-only run's (and a default image
    run's) manifest and id stay as they were."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, cls in (("long", LongPolicy), ("truncate_side", TruncateSide), ("mode", PackMode),
                          ("output_format", OutputFormat), ("images", ImageStorage)):
            object.__setattr__(self, name, option_enum(cls, getattr(self, name), name))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "config", tuple(self.config))
        if not self.inputs and not self.config:
            raise PackstreamError("no inputs given; pass files, globs or folders, or omit INPUT for the bundled sample")
        if self.inputs and self.config:
            raise PackstreamError("give INPUT paths or --config, not both; list every data set's paths in the config")
        if not 8 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise PackstreamError(
                f"--max-tokens {self.max_tokens} is out of range; use 8..{MAX_TOKENS_LIMIT:,} (typical: 2048-8192)"
            )
        if self.group_size < 1:
            raise PackstreamError(f"--group-size {self.group_size} must be >= 1 (default 10000)")
        if self.max_per_row is not None and self.max_per_row < 1:
            raise PackstreamError(f"--max-per-row {self.max_per_row} must be >= 1, or omitted for no cap")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise PackstreamError(f"--seed {self.seed!r} must be an integer within 0..{MAX_SEED} (e.g. --seed 0)")
        if not 0 <= self.num_shards <= 99_999:
            raise PackstreamError(f"--num-shards {self.num_shards} must be within 0..99999 (0 = automatic)")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise PackstreamError(f"--max-reject-fraction {self.max_reject_fraction} must be within [0, 1]")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise PackstreamError(f"--validation-fraction {self.validation_fraction} must be within [0, 1)")
        if not 1 <= self.max_record_bytes <= 2**31 - 1:
            raise PackstreamError(f"--max-record-bytes {self.max_record_bytes} must be within 1..{2**31 - 1}")
        if not 1 <= self.batch_size <= 1_000_000:
            raise PackstreamError(f"--batch-size {self.batch_size} must be within 1..1000000")
        cores = os.cpu_count() or 1
        if self.workers < 0:
            raise PackstreamError(f"--workers {self.workers} must be >= 1, or auto (0) "
                                  f"(this machine has {cores} cores)")
        if not 0 <= self.tokenizer_threads <= 1024:
            raise PackstreamError(f"--tokenizer-threads {self.tokenizer_threads} must be within 1..1024, or auto (0) "
                                  f"(this machine has {cores} cores)")
        if self.workers > 4 * cores and not self.force_workers:
            raise PackstreamError(
                f"--workers {self.workers} is more than 4 per core ({cores} cores here), and each worker holds a "
                "tokenizer (~0.4 GB); use fewer, or pass --force-workers"
            )
        if self.pairs:
            self._check_pairs()
        if self.media_root is not None and "://" not in self.media_root:  # stored absolute: verify from anywhere
            if not self.media_root.strip():
                raise PackstreamError("--media-root '' is empty; give the folder that holds the images (--media-root / "
                                      "lets records name any file on this machine), or omit it")
            object.__setattr__(self, "media_root", os.path.abspath(self.media_root))
        if (self.processor is not None or self.media_root is not None or self.images is not ImageStorage.REFERENCE
                or self.image_max_pixels is not None or self.image_min_pixels is not None or self._video_given()):
            self._check_vision()
        for spec in self.config:
            if not isinstance(spec, DatasetSpec):
                raise PackstreamError(f"--config entries must be DatasetSpec, got {type(spec).__name__}")
        for spec in self.datasets():
            if spec.format.maps_pairs() and not self.pairs:
                raise PackstreamError(f"data set {spec.name!r}: --pair-sides/--pair-ranked/--pair-prompt name the fields "
                                      "of preference pairs, which --pairs packs; add --pairs")
            if spec.format.kto_label is not None and self.long is LongPolicy.SPLIT:
                raise PackstreamError(f"data set {spec.name!r}: --kto-label {spec.format.kto_label} packs KTO examples, "
                                      "and --long split would cut one into pieces that each carry its label, the later "
                                      "ones starting mid-answer with no prompt (TRL truncates, never splits); use "
                                      "--long truncate or --long drop")
            if spec.format.tokenized_with not in (None, self.tokenizer):
                raise PackstreamError(
                    f"--tokenized-with {spec.format.tokenized_with!r} (data set {spec.name!r}) differs from --tokenizer "
                    f"{self.tokenizer!r}; pre-tokenized input_ids must come from the tokenizer that packs them"
                )

    def _check_pairs(self) -> None:
        """Options that cannot hold for a pair (each side: its whole prompt, then a completion it trains on)."""
        if self.long is LongPolicy.SPLIT:
            raise PackstreamError("--long split cannot split a preference pair (each side needs its whole prompt, and "
                                  "half a pair trains nothing); use --long truncate (both completions cut at one "
                                  "length) or --long drop with --pairs")
        if self.truncate_side is not TruncateSide.RIGHT:
            raise PackstreamError("--pairs truncates both completions at one length, keeping their starts; "
                                  "--truncate-side left does not apply: leave it at right")
        if self.max_per_row is not None and self.max_per_row < 2:
            raise PackstreamError(f"--max-per-row {self.max_per_row} is less than one pair (2 sequences) with --pairs; "
                                  "use at least 2")
        for spec in self.datasets():
            if spec.format.kto_label is not None:  # never ignored in silence (issue 42)
                raise PackstreamError(
                    f"data set {spec.name!r}: --kto-label {spec.format.kto_label} labels single answers (KTO); --pairs "
                    "packs both sides of a preference pair, which needs no label: drop --kto-label, or pack without "
                    "--pairs"
                )
            if spec.format.preference is not None:
                raise PackstreamError(
                    f"data set {spec.name!r}: --preference {spec.format.preference.value} trains one side of each pair "
                    "as SFT, --pairs packs both sides as pairs; give one of them"
                )
            if spec.format.train_on is not TrainOn.ASSISTANT or spec.format.mask_reasoning:
                raise PackstreamError(
                    f"data set {spec.name!r}: --pairs trains on each side's whole completion (what DPO scores); "
                    "--train-on all and --mask-reasoning do not apply: drop them"
                )

    def _check_vision(self) -> None:
        """--processor resolves to a :class:`packers.VisionSpec` now (one error line, before anything is read)."""
        if self.processor is None and self.media_root is not None:
            raise PackstreamError(f"--media-root {self.media_root} says where images are, and only --processor packs "
                                  "images; add --processor NAME|PATH (e.g. --processor qwen2-vl) or drop --media-root")
        limits = [f"--image-{k}-pixels" for k in ("min", "max") if getattr(self, f"image_{k}_pixels") is not None]
        if self.processor is None and limits:
            raise PackstreamError(f"{' and '.join(limits)} {'limit' if len(limits) > 1 else 'limits'} how images are resized, and only --processor packs "
                                  "images; add --processor NAME|PATH (e.g. --processor qwen2-vl) or drop them")
        if self.processor is None and self._video_given():
            raise PackstreamError("--video-fps and the --video-* limits say how videos are sampled, and only --processor "
                                  "packs them; add --processor qwen2-vl (or qwen2.5-vl, or the model's folder) or drop "
                                  "them")
        if self.processor is None:
            raise PackstreamError(f"--images {self.images.value} says how rows carry images, and only --processor "
                                  "packs images; add --processor NAME|PATH (e.g. --processor qwen2-vl) or drop "
                                  f"--images {self.images.value}")
        if not self.processor.strip():
            raise PackstreamError("--processor '' is empty; give a shipped processor (qwen2-vl, qwen2.5-vl, qwen3-vl, "
                                  "llava-1.5, internvl3, gemma3) or the model's folder, or omit --processor for text-only "
                                  "packing")
        if self.media_root is not None and not os.path.isdir(self.media_root):
            raise PackstreamError(f"--media-root {self.media_root}: no such folder; give the folder that relative "
                                  "image paths start from, or omit it to resolve them against each input's folder")
        self.vision()

    def vision(self) -> Optional[VisionSpec]:
        """The image rules of ``--processor`` (None for a text-only run); resolved once per process."""
        if self.processor is None:
            return None
        return _vision_spec(self.processor, self.image_min_pixels, self.image_max_pixels, self.video_fps,
                            self.video_max_frames, self.video_min_pixels, self.video_max_pixels)

    def _video_given(self) -> bool:
        return any(v is not None for v in (self.video_fps, self.video_max_frames, self.video_max_pixels,
                                           self.video_min_pixels))

    def datasets(self) -> tuple[DatasetSpec, ...]:
        """The data sets of this run: the config's, or one made of INPUT and the format flags."""
        if self.config:
            return self.config
        return (DatasetSpec(name="default", paths=self.inputs, format=self.format_options()),)

    def format_options(self) -> FormatOptions:
        """The format flags alone (the defaults of every ``--config`` data set)."""
        return FormatOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(FormatOptions)})

    def to_dict(self) -> dict:
        """JSON-ready, for manifest.json."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in self._NOT_RECORDED or (f.name in self._RECORDED_WHEN_SET and getattr(self, f.name) == f.default):
                continue
            v = getattr(self, f.name)
            out[f.name] = [d.to_dict() for d in v] if f.name == "config" else jsonable(v)
        return out


def options_from_config(config: dict, inputs: Sequence[str], output: str,
                        trust_remote_code: bool = False) -> PackOptions:
    """The :class:`PackOptions` of a finished run, from ``manifest.json``'s ``config`` (data sets included).

    ``inputs`` replaces the recorded INPUT paths (not possible for a ``--config`` run: its data sets
    name their own paths). ``trust_remote_code`` comes from the caller, never from the manifest.
    """
    names = {f.name for f in dataclasses.fields(PackOptions)}
    fmt_names = {f.name for f in dataclasses.fields(FormatOptions)}
    given = ("config", "inputs", "output", "trust_remote_code")  # set below, never taken from the manifest as is
    kw = {k: v for k, v in config.items() if k in names and k not in given}
    try:
        specs = tuple(
            DatasetSpec(name=d["name"], paths=tuple(d["paths"]), weight=d.get("weight", 1.0), split=d.get("split"),
                        format=FormatOptions(**{k: v for k, v in d.items() if k in fmt_names}))
            for d in config.get("config") or ()
        )
        if specs and inputs:
            raise PackstreamError("this run read --config data sets, each with its own paths; verify --inputs re-reads "
                                  "the paths recorded in manifest.json: give no INPUT paths")
        kw.update(config=specs, inputs=() if specs else tuple(inputs) or tuple(config.get("inputs") or ()),
                  output=output, trust_remote_code=trust_remote_code)
        return PackOptions(**kw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PackstreamError(f"manifest.json config cannot be read back into options ({type(e).__name__}: {e}); "
                              "it was written by another packstream version: verify with that version") from None


@functools.lru_cache(maxsize=8)
def _vision_spec(processor: str, min_pixels: Optional[int], max_pixels: Optional[int], fps: Optional[float] = None,
                 max_frames: Optional[int] = None, video_min: Optional[int] = None,
                 video_max: Optional[int] = None) -> VisionSpec:
    folder = VisionSpec.folder_video_settings(processor) if fps is not None else {}  # the model's own settings
    return VisionSpec.from_processor(processor).with_pixel_limits(min_pixels, max_pixels).with_video(
        fps, max_frames if max_frames is not None else folder.get("max_frames"),
        video_min if video_min is not None else folder.get("min_pixels"),
        video_max if video_max is not None else folder.get("max_pixels"))
