"""Chat with an exported model about images, in a terminal.

    lavis-ds chat --model exports/demo --image a.png [b.png ...]

Type a question and the answer is printed token by token as it is generated. Lines
that start with ``:`` are commands (``:help`` lists them), after MiniGPT4Qwen's
``cli_demo.py``: load another image, clear the history, change the generation
settings and the seed.

The conversation is the ChatML prompt the model was trained on
(:mod:`lavis_ds.models.prompt`): the system turn (``--system``, as a training record's own system turn; by
default the model's ``system_prompt``), then every earlier question with
the model's answer, then the new question. An image is shown once, in front of
the question asked after it was loaded, as ``<Img><ImageHere></Img>`` (the
training format of one image); several images give one such marker each, in the
order they were loaded (as several-image training records mark theirs). When a conversation no longer fits the LLM's
context, its oldest turns are left out (their images move to the oldest turn
kept). A question asked with no image loaded is a text-only turn. :class:`ChatSession`
is what the terminal and the web page (:mod:`lavis_ds.apps.webui`) share.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from typing import Any, Callable

from lavis_ds.apps.chat_session import CHAT_DEFAULTS, ChatSession, Interrupted
from lavis_ds.apps.export import ExportError
from lavis_ds.apps.generation import GenerationSettings, add_generation_arguments, open_image, settings_from_args

# ChatSession is the documented import path of the conversation (docs/inference.md) as well as the terminal's.
__all__ = ["ChatSession", "Terminal", "main"]


HELP = """\
Commands (after MiniGPT4Qwen's cli_demo.py):
    :help / :h                    show this help
    :exit / :quit / :q            leave
    :clear / :cl                  clear the screen
    :clear-history / :clh         forget the conversation; the images stay and are shown with the next question
    :history / :his               show the conversation
    :image <path> ... / :img      load image(s); they are shown with the next question (no path: list the images)
    :reset                        forget the conversation and the images
    :seed [<N>]                   show or set the random seed (set before every answer)
    :conf [<key>=<value> ...]     show or change generation settings, e.g. :conf do_sample=true temperature=0.7
                                  (greedy: do_sample=false num_beams=1; beam search: num_beams=4)
    :reset-conf                   back to the default generation settings
Ctrl-C stops an answer; Ctrl-D or :q leaves."""


class Terminal:
    """The read-answer loop around a :class:`ChatSession`; ``write`` receives everything shown."""

    def __init__(self, session: ChatSession, defaults: GenerationSettings, write: Callable[[str], Any]):
        self.session, self.defaults, self.write = session, defaults, write

    def say(self, text: str = "") -> None:
        self.write(text + "\n")

    def run(self, read: Callable[[str], str]) -> None:
        self.say(f"Chat with the model about {len(self.session.images)} image(s). Type a question; :h for commands.")
        while True:
            try:
                line = read("User> ").strip()
            except EOFError:
                self.say()
                return
            except KeyboardInterrupt:
                self.say()
                return
            if not line:
                continue
            if line.startswith(":"):
                if self.command(line[1:].split()) == "exit":
                    return
                continue
            self.answer(line)

    def answer(self, question: str) -> None:
        started = False  # whether "Assistant: " is on the screen: a message then starts on a new line
        try:
            pieces = self.session.ask(question)
            self.write("Assistant: ")
            started = True
            for piece in pieces:
                self.write(piece)
            self.say()
        except KeyboardInterrupt:
            self.session.interrupt()
            self.say("\n[WARNING] generation interrupted; the question was not kept")
        except (Interrupted, ValueError) as e:
            kind = "WARNING" if isinstance(e, Interrupted) else "ERROR"
            self.say(f"{chr(10) if started else ''}[{kind}] {e}")

    def command(self, words: list[str]) -> str | None:
        name, args = (words[0], words[1:]) if words else ("", [])
        session = self.session
        if name in ("exit", "quit", "q"):
            return "exit"
        if name in ("help", "h"):
            self.say(HELP)
        elif name in ("clear", "cl"):
            if sys.stdout.isatty():
                self.write("\033[2J\033[H")
        elif name in ("clear-history", "clh"):
            self.say(f"[INFO] {session.clear_history()} turn(s) cleared; {len(session.images)} image(s) will be "
                     "shown with the next question")
        elif name in ("history", "his"):
            self._history()
        elif name in ("image", "img"):
            for path in args:
                try:
                    self.say(f"[INFO] loaded {session.add_image(path)}; it is shown with the next question")
                except ValueError as e:
                    self.say(f"[ERROR] {e}")
            if not args:
                for i, image in enumerate(session.images):
                    shown = "not shown yet" if i in session.pending else "shown"
                    self.say(f"[INFO] image {i + 1}: {image.name} ({shown})")
                if not session.images:
                    self.say("[INFO] no image loaded; :img <path> loads one")
        elif name == "reset":
            session.reset()
            self.say("[INFO] conversation and images cleared; load an image with :img <path>")
        elif name == "seed":
            self._seed(args)
        elif name == "conf":
            self._conf(args)
        elif name == "reset-conf":
            session.settings = self.defaults
            self.say(f"[INFO] generation settings reset: {self._settings()}")
        else:
            self.say(f"[ERROR] unknown command :{name}; :h lists the commands")
        return None

    def _history(self) -> None:
        width = shutil.get_terminal_size((80, 20)).columns
        self.say(f" History ({len(self.session.turns)}) ".center(width, "="))
        for i, turn in enumerate(self.session.turns):
            images = f"[{', '.join(self.session.images[i].name for i in turn.images)}] " if turn.images else ""
            self.say(f"User[{i}]: {images}{turn.question}")
            self.say(f"Assistant[{i}]: {turn.answer}")
        self.say("=" * width)

    def _seed(self, args: list[str]) -> None:
        if not args:
            self.say(f"[INFO] random seed: {self.session.seed}")
            return
        try:
            self.session.seed = int(args[0])
            self.say(f"[INFO] random seed set to {self.session.seed}")
        except ValueError:
            self.say(f"[ERROR] {args[0]!r} is not an integer seed")

    def _conf(self, args: list[str]) -> None:
        for pair in args:
            key, sep, value = pair.partition("=")
            if not sep:
                self.say(f"[ERROR] {pair!r}: write <key>=<value>, e.g. temperature=0.7")
                continue
            try:
                self.session.set(key, value)
                self.say(f"[INFO] {key} = {getattr(self.session.settings, key)}")
            except ValueError as e:
                self.say(f"[ERROR] {e}")
        if not args:
            self.say(f"[INFO] generation settings: {self._settings()}")

    def _settings(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.session.settings).items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lavis-ds chat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="export folder (lavis-ds export ... --out <folder>)")
    parser.add_argument("--image", nargs="+", default=[], help="image file(s) to talk about (more with :img)")
    parser.add_argument("--seed", type=int, default=42, help="random seed, set before every answer")
    parser.add_argument("--system", default=None,
                        help="the conversation's system prompt, sent as training sent a record's own system turn "
                             "(default: the model's system_prompt)")
    add_generation_arguments(parser, CHAT_DEFAULTS)
    parser.add_argument("--dtype", default="auto", help="auto (the dtype it trained in), fp32, bf16 or fp16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        defaults = settings_from_args(args)
        images = [(path, open_image(path)) for path in args.image]  # bad paths fail before the model loads
        session = ChatSession.from_export(args.model, device=args.device, dtype=args.dtype, settings=defaults,
                                          seed=args.seed, system=args.system)
    except (ExportError, ValueError) as e:
        print(f"lavis_ds chat: {e}", file=sys.stderr)
        return 2
    for path, image in images:
        session.add_image(image, path)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()  # each piece as it comes, also into a pipe

    Terminal(session, defaults, write).run(input)
    return 0


if __name__ == "__main__":
    sys.exit(main())
