"""Terminal chat: a real `python -m lavis_ds.apps.chat` process fed typed lines, and ChatSession in-process.

The model is conftest's ``demo_export`` (the tiny demo trained once per session). What the
chat must answer is computed with the library call the conversation stands for:
``lavis_ds.apps.generation.generate`` on the ChatML turns, the earlier answers as history.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from PIL import Image

from lavis_ds.apps.chat import main
from lavis_ds.apps.chat_session import ChatSession, Interrupted
from lavis_ds.datasets.records import IMAGE_PLACEHOLDER as IMG
from lavis_ds.apps.export import load_exported
from lavis_ds.apps.generation import GenerationSettings, eval_processors, generate
from run_utils import REPO, env

CAPTION, COLOUR, SHAPE = "Describe the image in a few words.", "What colour is the shape?", "What shape is it?"


@pytest.fixture(scope="module")
def model(demo_export):
    return load_exported(demo_export.folder)


@pytest.fixture(scope="module")
def pixels(demo_export):
    image_processor, _ = eval_processors(demo_export.folder)

    def load(*paths) -> torch.Tensor:
        tensors = []
        for path in paths:
            with Image.open(path) as image:
                tensors.append(image_processor(image.convert("RGB")))
        return torch.stack(tensors)

    return load


@pytest.fixture
def session(model, demo_export):
    image_processor, text_processor = eval_processors(demo_export.folder)
    return ChatSession(model, image_processor, text_processor)


def test_a_conversation_typed_into_the_terminal(demo_export, model, pixels):
    first, second = demo_export.image("test", 0), demo_export.image("test", 3)
    typed = [CAPTION, COLOUR, ":his", ":conf tmperature=0.5", ":conf num_beams=3", SHAPE,
             ":img nope.png", f":img {second}", ":img", CAPTION, ":seed", ":seed 11", ":clh", CAPTION,
             ":reset", COLOUR, ":frobnicate", ":q", "never asked"]
    proc = subprocess.run([sys.executable, "-m", "lavis_ds.apps.chat", "--model", str(demo_export.folder),
                           "--image", str(first)], input="\n".join(typed) + "\n", cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]

    # Each answer is the model's answer to the ChatML conversation so far (greedy, then 3 beams).
    a1 = generate(model, pixels(first), [[f"{IMG} {CAPTION}"]], max_new_tokens=256)[0]
    a2 = generate(model, pixels(first), [[f"{IMG} {CAPTION}", COLOUR]], [[a1]], max_new_tokens=256)[0]
    a3 = generate(model, pixels(first), [[f"{IMG} {CAPTION}", COLOUR, SHAPE]], [[a1, a2]], max_new_tokens=256,
                  num_beams=3)[0]
    # The second image is shown with the question asked after it was loaded.
    a4 = generate(model, pixels(first, second), [[f"{IMG} {CAPTION}", COLOUR, SHAPE, f"{IMG} {CAPTION}"]],
                  [[a1, a2, a3]], num_images=[2], max_new_tokens=256, num_beams=3)[0]
    # After :clh both images come again with the next question, in the order they were loaded.
    a5 = generate(model, pixels(first, second), [[f"{IMG} {IMG} {CAPTION}"]], num_images=[2], max_new_tokens=256,
                  num_beams=3)[0]
    # After :reset no image is loaded: a text-only turn (no image tensor, no marker).
    a6 = generate(model, torch.zeros((0, 3, 1, 1)), [[COLOUR]], num_images=[0], max_new_tokens=256, num_beams=3)[0]
    answers = [line.split("Assistant: ", 1)[1] for line in out.splitlines() if "Assistant: " in line]
    assert answers[:6] == [a1, a2, a3, a4, a5, a6]
    assert a1 and a1 != a2  # a caption, then a colour: the history does not swallow the question

    assert f"User[0]: [{first}] {CAPTION}\nAssistant[0]: {a1}\nUser[1]: {COLOUR}\nAssistant[1]: {a2}\n" in out
    assert "[ERROR] unknown setting 'tmperature'; did you mean 'temperature'?" in out
    assert "[INFO] num_beams = 3" in out
    assert "[ERROR] image file nope.png not found" in out
    assert f"[INFO] image 1: {first} (shown)\n" in out and f"[INFO] image 2: {second} (not shown yet)" in out
    assert "[INFO] random seed: 42" in out and "[INFO] random seed set to 11" in out
    assert "[INFO] 4 turn(s) cleared; 2 image(s) will be shown with the next question" in out
    assert "[ERROR] unknown command :frobnicate; :h lists the commands" in out
    assert len(answers) == 6  # nothing after :q


def test_answers_stream_piece_by_piece(session, demo_export, model, pixels):
    session.add_image(demo_export.image("test", 1))
    pieces = list(session.ask(CAPTION))
    expected = generate(model, pixels(demo_export.image("test", 1)), [[f"{IMG} {CAPTION}"]], max_new_tokens=256)[0]
    # The streamer hands out words as they are complete ("a ", "green ", "triangle"), not the answer at the end.
    assert len(pieces) == len(expected.split()) > 1
    assert "".join(pieces).strip() == expected == session.turns[-1].answer


def test_several_images_in_one_batch_reach_their_own_sample(model, demo_export, pixels):
    a, b, c = (demo_export.image("test", i) for i in (0, 3, 5))
    both = generate(model, pixels(a, b, c), [[f"{IMG} {IMG} {CAPTION}"], [f"{IMG} {CAPTION}"]],
                    num_images=[2, 1], max_new_tokens=12)
    assert both[0] == generate(model, pixels(a, b), [[f"{IMG} {IMG} {CAPTION}"]], num_images=[2], max_new_tokens=12)[0]
    assert both[1] == generate(model, pixels(c), [[f"{IMG} {CAPTION}"]], max_new_tokens=12)[0]
    with pytest.raises(ValueError, match=r"num_images \[2, 2\] adds up to 4 images, but the batch holds 3"):
        generate(model, pixels(a, b, c), [CAPTION, CAPTION], num_images=[2, 2])
    with pytest.raises(ValueError, match=r"2 image\(s\) but 1 <ImageHere> marker\(s\)"):
        model.llm.prompt.generation_prompt([f"{IMG} {CAPTION}"], num_images=2)
    # 8 placeholders (the tiny Q-Former's queries) per image, each run inside its own <Img>...</Img>.
    ids = model.llm.prompt.generation_prompt([f"{IMG} {IMG} {CAPTION}"], num_images=2)
    assert ids.count(model.llm.prompt.image_token_id) == 2 * model.llm.prompt.num_image_tokens == 16


def test_the_conversations_own_system_prompt_is_sent_as_training_sends_a_records(session, demo_export, model,
                                                                                 pixels):
    own = "You are a useful and harmless assistant"  # ms-swift's example record (tests/fixtures/chat_messages)
    session.system = own
    session.set("max_new_tokens", "12")
    session.add_image(demo_export.image("test", 2))
    image = pixels(demo_export.image("test", 2))
    assert session.answer(CAPTION) == generate(model, image, [[f"{IMG} {CAPTION}"]], systems=[own],
                                               max_new_tokens=12)[0]
    text = model.llm.tokenizer.decode(model.llm.prompt.generation_prompt([f"{IMG} {CAPTION}"], system=own))
    assert text.startswith(f"<|im_start|>system\n{own}<|im_end|>\n<|im_start|>user\n")
    # batch inference: each sample of a batch keeps its own system prompt (or the model's)
    both = generate(model, torch.cat([image, image]), [[f"{IMG} {CAPTION}"]] * 2, num_images=[1, 1],
                    systems=[own, None], max_new_tokens=12)
    assert both == [generate(model, image, [[f"{IMG} {CAPTION}"]], systems=[own], max_new_tokens=12)[0],
                    generate(model, image, [[f"{IMG} {CAPTION}"]], max_new_tokens=12)[0]]


def test_seed_makes_sampling_repeatable(session, demo_export):
    session.add_image(demo_export.image("test", 2))
    session.settings = GenerationSettings(max_new_tokens=12, do_sample=True, temperature=2.0, top_k=0)
    session.seed = 5
    first = session.answer(CAPTION)
    session.clear_history()
    assert session.answer(CAPTION) == first
    texts = set()
    for seed in range(6):
        session.clear_history()
        session.seed = seed
        texts.add(session.answer(CAPTION))
    assert len(texts) > 1  # hot sampling from a 3-epoch model: the seed does change the text


def test_interrupt_stops_the_answer_and_keeps_no_turn(session, demo_export):
    session.add_image(demo_export.image("test", 0))
    session.settings = GenerationSettings(max_new_tokens=200, do_sample=True, temperature=5.0, top_k=0)
    pieces = session.ask(CAPTION)
    session.interrupt()  # as Ctrl-C does during the answer
    with pytest.raises(Interrupted, match="generation interrupted"):
        list(pieces)
    assert session.turns == [] and session.pending == [0]  # the image still waits for a question


def test_a_conversation_too_long_for_the_context_drops_its_oldest_turns(session, demo_export, model):
    session.add_image(demo_export.image("test", 0))
    for question in (CAPTION, COLOUR, SHAPE):
        session.answer(question)
    context = model.llm_model.config.max_position_embeddings
    # Room for the system turn, one earlier turn and the new question, not for two earlier turns.
    kept = session.turns[-1]
    one_turn = len(model.llm.prompt.generation_prompt([f"{IMG} {kept.question}", CAPTION], [kept.answer]))
    session.settings = GenerationSettings(max_new_tokens=context - one_turn)
    answer = session.answer(CAPTION)
    assert [t.question for t in session.turns] == [SHAPE, CAPTION]
    assert session.turns[0].images == [0]  # the image moved to the oldest turn kept: the model still sees it
    assert answer == session.turns[-1].answer
    session.settings = GenerationSettings(max_new_tokens=context)
    with pytest.raises(ValueError, match=f"exceeds the model's context of {context} tokens"):
        session.ask(COLOUR)


def test_bad_input_gets_a_clear_error(demo_export, tmp_path, capsys):
    assert main(["--model", str(demo_export.folder), "--image", "nope.png"]) == 2
    assert capsys.readouterr().err.strip() == "lavis_ds chat: image file nope.png not found"
    assert main(["--model", str(tmp_path), "--image", str(demo_export.image())]) == 2
    err = capsys.readouterr().err
    assert "is not an export folder: config.yaml and model.safetensors missing" in err and "Traceback" not in err
    assert main(["--model", str(demo_export.folder), "--temperature", "0"]) == 2
    assert "temperature=0.0 is out of range (> 0)" in capsys.readouterr().err
