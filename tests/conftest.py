"""Shared tiny fixtures: a ChatML tokenizer trained in a temp dir, the tiny model config."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import pytest

from lavis_ds.common.extensions import configure_build_environment

# In-process tests and the train.py processes they start compile DeepSpeed's ops into one folder.
configure_build_environment()


def pytest_sessionstart(session):
    """The whole suite: the server that forks its training processes (tests/forked.py) imports torch & co while
    pytest collects the tests, on the other core, instead of when the first process is needed. Not in
    pytest-xdist's controller (``-n``), which runs no test: each of its workers starts its own."""
    tests, config = Path(__file__).parent, session.config
    runs_tests = hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)
    if runs_tests and all(Path(arg).resolve() in (tests, tests.parent) for arg in config.args):
        import forked

        forked.start_server()


# The slowest files (docs/benchmarks.md, "The test suite"), collected first: the README's command runs whole files
# on two workers (pytest-xdist, --dist loadfile), and a long file handed out last leaves the other worker idle.
SLOWEST_FIRST = ("test_fsdp.py", "test_resume.py", "test_multinode.py", "test_export.py", "test_train.py",
                 "test_dpo_demo.py")


def pytest_collection_modifyitems(session, config, items):
    place = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(SLOWEST_FIRST)))  # stable: the rest keep their order


# Words the tests' prompts use, so the toy BPE has merges for them (any text still encodes: byte-level).
TINY_CORPUS = [
    "<Img><ImageHere></Img> What is in the image?",
    "A cat sitting on a mat.",
    "Describe the picture in detail.",
    "A dog runs on the grass next to a red ball.",
    "What color is the ball? It is red.",
    "How many animals are there? Two.",
    "You are a helpful assistant.",
] * 4


@contextlib.contextmanager
def user_module_imported(module: str, registry) -> Iterator[None]:
    """``module`` imported as a YAML's `imports: [module]` does, for the duration only: what it registered in
    ``registry`` leaves it afterwards, and a later import registers it again (the registries are global state, and
    pytest runs every file in one process, where other files must see the package's own entries)."""
    from lavis_ds.config import import_user_modules

    entries = dict(registry._entries)
    import_user_modules([module])
    try:
        yield
    finally:
        registry._entries.clear()
        registry._entries.update(entries)
        sys.modules.pop(module, None)


def demo_storage_fixture(num_train: int, num_val: int = 16, num_test: int = 8):
    """A module's ``demo_storage`` fixture: demo_shapes data of that size (images, annotations, tokenizer),
    generated once per module. In a test module: ``demo_storage = demo_storage_fixture(num_train=64)``."""

    @pytest.fixture(scope="module")
    def demo_storage(tmp_path_factory) -> Path:
        from lavis_ds.datasets.demo_shapes import DemoShapesSpec, ensure_demo_shapes

        return ensure_demo_shapes(tmp_path_factory.mktemp("demo") / "demo_shapes",
                                  DemoShapesSpec(num_train=num_train, num_val=num_val, num_test=num_test))

    return demo_storage


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A Qwen2-format ChatML tokenizer folder (trained once per session)."""
    from lavis_ds.models.tokenizer import train_chatml_tokenizer

    return train_chatml_tokenizer(TINY_CORPUS, tmp_path_factory.mktemp("tiny_tokenizer"), vocab_size=400)


@pytest.fixture(scope="session")
def tiny_bert_tokenizer_dir(tmp_path_factory) -> Path:
    """A BERT WordPiece tokenizer folder with [DEC] (InstructBLIP's Q-Former tokenizer at a toy size)."""
    from lavis_ds.models.tokenizer import train_bert_tokenizer

    return train_bert_tokenizer(TINY_CORPUS, tmp_path_factory.mktemp("tiny_bert_tokenizer"), vocab_size=200)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def tiny_model_config(tiny_tokenizer_dir) -> dict:
    """The `blip2_qwen` `tiny` preset as a plain dict, pointed at the tiny tokenizer."""
    from lavis_ds.models import Blip2Qwen

    cfg = Blip2Qwen.default_config("tiny")
    cfg["tokenizer"] = str(tiny_tokenizer_dir)
    return cfg


@pytest.fixture(scope="session")
def demo_export(tmp_path_factory):
    """The tiny demo model trained briefly (2 processes) and exported, once per session."""
    from demo_export import train_and_export

    return train_and_export(tmp_path_factory.mktemp("demo_export"))
