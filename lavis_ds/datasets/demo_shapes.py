"""An embedded demo dataset: coloured shapes on a plain background, generated on first use.

The output has the same on-disk layout as real data, so the demo exercises the
real code path (instruction JSON + image folder + a tokenizer folder):

    {storage}/images/{split}_{i:05d}.png
    {storage}/annotations/{train,val,test}.json   (MiniGPT4Qwen instruction format)
    {storage}/tokenizer/                          (ChatML tokenizer trained on the texts)
    {storage}/qformer_tokenizer/                  (BERT WordPiece + [DEC], for InstructBLIP's Q-Former)
    {storage}/DONE                                (JSON of the generation parameters)

Generation is deterministic (fixed seeds; image pixels and JSON are identical
across runs) and safe when several processes start at once: each writes a
private temporary folder next to ``storage`` and renames it into place; the
first rename wins and the others discard their copy.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from lavis_ds.datasets.instruction import IMAGE_PLACEHOLDER

# Bump when the generated content changes, so stale caches are detected.
FORMAT_VERSION = 4  # 2: shapes have a dark outline; 3: larger, near the centre; 4: a Q-Former tokenizer

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (35, 160, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 205, 25),
    "purple": (140, 50, 185),
    "orange": (245, 135, 25),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")

SYSTEM_PROMPT = "You are a helpful assistant."
CAPTION_PROMPT = f"{IMAGE_PLACEHOLDER} Describe the image in a few words."
COLOUR_QUESTION = "What colour is the shape?"
SHAPE_QUESTION = "What shape is it?"
SPLITS = ("train", "val", "test")

# Drawn at this multiple of the target size, then downsampled: cheap anti-aliasing.
_SUPERSAMPLE = 2
_NOISE_AMPLITUDE = 6  # +- grey levels of uniform background noise: "lightly noised"


@dataclass(frozen=True)
class DemoShapesSpec:
    """What to generate; stored in ``DONE`` so a cache made with other values is detected."""

    num_train: int = 2000
    num_val: int = 100
    num_test: int = 100
    image_size: int = 64
    seed: int = 0
    # 0: every image is image_size x image_size. Above: each image's width and height are drawn independently from
    # image_size * [1 - size_jitter, 1 + size_jitter] (towers that take images at their own sizes: Qwen-VL).
    size_jitter: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_train", "num_val", "num_test"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"demo_shapes: {name} must be a positive integer, got {value!r}")
        if isinstance(self.image_size, bool) or not isinstance(self.image_size, int) or self.image_size < 16:
            raise ValueError(f"demo_shapes: image_size must be an integer >= 16, got {self.image_size!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"demo_shapes: seed must be an integer, got {self.seed!r}")
        if isinstance(self.size_jitter, bool) or not isinstance(self.size_jitter, (int, float)) \
                or not 0 <= self.size_jitter < 1:
            raise ValueError(f"demo_shapes: size_jitter must be a number in [0, 1), got {self.size_jitter!r}")

    def split_sizes(self) -> dict[str, int]:
        return {"train": self.num_train, "val": self.num_val, "test": self.num_test}

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        if not self.size_jitter:  # square images: stored as before size_jitter existed, so those caches stay valid
            del fields["size_jitter"]
        return {"format_version": FORMAT_VERSION, **fields}


def caption(colour: str, shape: str) -> str:
    """The target caption, e.g. ``"a red circle"`` / ``"an orange star"``."""
    article = "an" if colour[0] in "aeiou" else "a"
    return f"{article} {colour} {shape}"


# ---- images -------------------------------------------------------------------------------------

def _star_points(cx: float, cy: float, radius: float) -> list[tuple[float, float]]:
    points = []
    for k in range(10):  # 5 outer + 5 inner vertices, first one pointing up
        r = radius if k % 2 == 0 else radius * 0.45
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points


def draw_shape_image(shape: str, colour: str, image_size: int, rng: random.Random,
                     noise_rng: np.random.RandomState) -> Image.Image:
    """One RGB image of ``image_size``² with a single shape; all randomness comes from the two generators."""
    big = image_size * _SUPERSAMPLE
    background = rng.randint(185, 235)
    image = Image.new("RGB", (big, big), (background,) * 3)
    draw = ImageDraw.Draw(image)
    # Large and near the centre: the tiny model should spend its few minutes on telling
    # shapes apart, not on learning translation invariance from 2000 images.
    radius = rng.uniform(0.28, 0.32) * big
    cx, cy = (big * (0.5 + rng.uniform(-0.03, 0.03)) for _ in range(2))
    fill = COLOURS[colour]
    # A dark outline makes the silhouette visible in every colour channel, so a tiny ViT trained
    # from scratch learns shapes about as fast as colours (without it, shapes lag far behind).
    pen = {"fill": fill, "outline": (20, 20, 20), "width": max(1, big // 40)}
    if shape == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), **pen)
    elif shape == "square":
        half = radius * 0.85  # similar area to the other shapes
        draw.rectangle((cx - half, cy - half, cx + half, cy + half), **pen)
    elif shape == "triangle":
        draw.polygon([(cx + radius * math.cos(a), cy + radius * math.sin(a))
                      for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)], **pen)
    elif shape == "star":
        draw.polygon(_star_points(cx, cy, radius), **pen)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    image = image.resize((image_size, image_size), Image.Resampling.BOX)
    noise = noise_rng.randint(-_NOISE_AMPLITUDE, _NOISE_AMPLITUDE + 1, size=(image_size, image_size, 3))
    pixels = np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


# ---- annotations --------------------------------------------------------------------------------

def _record(image: str, colour: str, shape: str, task: str, rng: random.Random) -> dict:
    answers = {COLOUR_QUESTION: colour, SHAPE_QUESTION: shape}
    if task == "caption":
        return {"image": image, "instruction": CAPTION_PROMPT, "output": caption(colour, shape)}
    if task in ("colour", "shape"):
        question = COLOUR_QUESTION if task == "colour" else SHAPE_QUESTION
        return {"image": image, "instruction": f"{IMAGE_PLACEHOLDER} {question}", "output": answers[question]}
    # Multi-turn: the image is shown in the first turn only, as in MiniGPT4Qwen's data.
    first, second = rng.sample([COLOUR_QUESTION, SHAPE_QUESTION], 2)
    return {"image": image,
            "instruction": [f"{IMAGE_PLACEHOLDER} {first}", second],
            "output": [answers[first], answers[second]]}


# Training/validation mix; the held-out test split uses the caption prompt only
# because the demo scores exact-match accuracy of generated captions on it.
_TASKS = ("caption", "colour", "shape", "multi_turn")
_TASK_WEIGHTS = (0.4, 0.2, 0.2, 0.2)


def generate_split(out_dir: Path, split: str, count: int, spec: DemoShapesSpec) -> list[dict]:
    """Draw ``count`` images into ``out_dir/images`` and return their annotation records."""
    split_number = SPLITS.index(split)
    # String seeds hash with SHA-512 in `random`, so this is stable across processes and Python versions.
    rng = random.Random(f"demo_shapes/{spec.seed}/{split}")
    # Legacy RandomState: its integer stream is frozen by NumPy's compatibility policy.
    noise_rng = np.random.RandomState([spec.seed % 2**32, split_number])
    # Sizes from a stream of their own: the shapes, colours and questions are those of square images.
    size_rng = random.Random(f"demo_shapes/{spec.seed}/{split}/sizes")
    records = []
    for i in range(count):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"{split}_{i:05d}.png"
        image = draw_shape_image(shape, colour, spec.image_size, rng, noise_rng)
        if spec.size_jitter:
            low, high = (round(spec.image_size * (1 + sign * spec.size_jitter)) for sign in (-1, 1))
            image = image.resize((size_rng.randint(low, high), size_rng.randint(low, high)), Image.Resampling.BICUBIC)
        # Fast zlib level: noisy pixels barely compress anyway, and generation should take seconds.
        image.save(out_dir / "images" / name, compress_level=1)
        task = "caption" if split == "test" else rng.choices(_TASKS, _TASK_WEIGHTS)[0]
        records.append(_record(name, colour, shape, task, rng))
    return records


def corpus_texts(records_by_split: dict[str, list[dict]]) -> list[str]:
    """Every string the model will read or write, for training the demo tokenizer."""
    texts = [SYSTEM_PROMPT]
    for records in records_by_split.values():
        for record in records:
            for key in ("instruction", "output"):
                value = record[key]
                texts.extend(value if isinstance(value, list) else [value])
    return texts


def generate_demo_shapes(out_dir: str | os.PathLike, spec: DemoShapesSpec) -> Path:
    """Write the complete dataset (images, annotations, tokenizer, DONE) into ``out_dir``."""
    # Imported here: the tokenizer module pulls in `tokenizers`, and only generation needs it.
    from lavis_ds.models.tokenizer import train_bert_tokenizer, train_chatml_tokenizer

    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    (out_dir / "annotations").mkdir(exist_ok=True)
    records_by_split = {}
    for split, count in spec.split_sizes().items():
        records = records_by_split[split] = generate_split(out_dir, split, count, spec)
        (out_dir / "annotations" / f"{split}.json").write_text(
            json.dumps(records, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    train_chatml_tokenizer(corpus_texts(records_by_split), out_dir / "tokenizer")
    train_bert_tokenizer(corpus_texts(records_by_split), out_dir / "qformer_tokenizer")
    # Written last: its presence means everything above is complete.
    (out_dir / "DONE").write_text(json.dumps(spec.to_json(), indent=1, sort_keys=True) + "\n")
    return out_dir


def needs_generation(storage: Path, spec: DemoShapesSpec) -> bool:
    """Whether ``ensure_demo_shapes`` would generate ``storage``: absent, empty, or an older format of the same
    parameters. Reads only."""
    if not storage.exists() or (storage.is_dir() and not any(storage.iterdir())):
        return True
    done = storage / "DONE"
    if not done.is_file():
        return False  # not ours: check_existing says so
    found, wanted = json.loads(done.read_text()), spec.to_json()
    return {k: v for k, v in found.items() if k != "format_version"} == \
        {k: v for k, v in wanted.items() if k != "format_version"} and found.get("format_version", 0) < FORMAT_VERSION


def check_existing(storage: Path, spec: DemoShapesSpec) -> None:
    """Raise (FileExistsError, ValueError) unless ``storage`` holds demo data generated with ``spec``. Reads only."""
    done = storage / "DONE"
    if not done.is_file():
        raise FileExistsError(
            f"demo_shapes: {storage} exists but is not a complete demo_shapes dataset (no DONE file); "
            f"delete it or point build_info.storage elsewhere")
    found = json.loads(done.read_text())
    if found != spec.to_json():
        differences = ", ".join(f"{k}: {found.get(k)!r} on disk vs {v!r} requested"
                                for k, v in spec.to_json().items() if found.get(k) != v)
        raise ValueError(
            f"demo_shapes: {storage} was generated with other parameters ({differences}); "
            f"delete it or set build_info.storage to another folder")


def ensure_demo_shapes(storage: str | os.PathLike, spec: DemoShapesSpec = DemoShapesSpec()) -> Path:
    """Generate the dataset at ``storage`` unless it is already there; return ``storage``.

    Safe to call from several processes at once: the folder appears atomically.
    """
    storage = Path(storage).expanduser()
    _retire_older_format(storage, spec)
    # An empty folder (e.g. made by hand) is replaced by the rename, so it counts as absent.
    if not storage.exists() or (storage.is_dir() and not any(storage.iterdir())):
        storage.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{storage.name}.tmp-", dir=storage.parent))
        try:
            generate_demo_shapes(scratch, spec)
            try:
                os.rename(scratch, storage)
            except OSError:
                if not (storage / "DONE").is_file():  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # no-op after a successful rename
    check_existing(storage, spec)
    return storage


def _retire_older_format(storage: Path, spec: DemoShapesSpec) -> None:
    """Move aside a cache that an older lavis_ds generated with the same parameters; it is regenerated.

    Only a lower ``format_version`` with otherwise equal parameters counts: other
    differences may be another run's data and are reported by ``check_existing``.
    Several processes may get here at once; one rename wins, the others find nothing.
    """
    done = storage / "DONE"
    if not done.is_file():
        return
    found, wanted = json.loads(done.read_text()), spec.to_json()
    same_parameters = {k: v for k, v in found.items() if k != "format_version"} == \
        {k: v for k, v in wanted.items() if k != "format_version"}
    if not (same_parameters and found.get("format_version", 0) < FORMAT_VERSION):
        return
    stale = Path(tempfile.mkdtemp(prefix=f".{storage.name}.stale-", dir=storage.parent))
    try:
        os.rename(storage, stale / storage.name)
    except OSError:  # another process moved it first
        pass
    shutil.rmtree(stale, ignore_errors=True)
