"""``lavis-ds``: one command for every job, each with the flags of its module.

    lavis-ds train --cfg-path projects/demo/tiny_zero2.yaml [--options k=v ...]   # = python train.py ...
    torchrun --nproc_per_node=2 --no-python lavis-ds train --cfg-path ...          # N processes
    lavis-ds export output/demo --out exports/demo                                 # = python export.py ...
    lavis-ds generate --model exports/demo --image x.png --prompt "Describe the image."
    lavis-ds eval --model output/demo --tasks demo_shapes_caption --include_path projects/demo/lmms_eval
    lavis-ds chat --model exports/demo
    lavis-ds webui --model exports/demo
    lavis-ds show-sample --cfg-path projects/demo/tiny_zero2.yaml --index 3

``lavis-ds <command> --help`` lists a command's flags. ``python -m lavis_ds.cli`` is the same command.
"""
from __future__ import annotations

import importlib
import sys

from lavis_ds.common.suggest import did_you_mean

# command -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "train": ("lavis_ds.train", "train (or evaluate) from one run YAML"),
    "export": ("lavis_ds.apps.export", "export a checkpoint for inference (safetensors, or transformers' BLIP-2)"),
    "generate": ("lavis_ds.apps.generate", "answer prompts about images with an exported model, or a data file's"),
    "eval": ("lavis_ds.apps.eval", "lmms-eval's benchmarks on a run, checkpoint or export (the eval extra)"),
    "chat": ("lavis_ds.apps.chat", "chat with an exported model in the terminal"),
    "webui": ("lavis_ds.apps.webui", "chat with an exported model in the browser (the webui extra)"),
    "show-sample": ("lavis_ds.show_sample", "show one training sample as the model sees it (prompt and loss mask)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: lavis-ds <command> [flags]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`lavis-ds <command> --help` lists a command's flags."


def main(argv: list[str] | None = None) -> int:
    """Run ``argv[0]``'s command with the rest of ``argv``; its exit code (2: no or an unknown command)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        hint = did_you_mean(command, COMMANDS, f"commands: {', '.join(COMMANDS)}")
        print(f"lavis_ds: unknown command {command!r}; {hint}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command][0]).main(rest)


def moved(old: str, command: str) -> None:
    """The end of a module path from older notes: one line naming the command that does it now; exit code 2."""
    print(f"lavis_ds: `python -m {old}` is `lavis-ds {command}` (or `python -m {COMMANDS[command][0]}`), with the "
          "same flags", file=sys.stderr)
    sys.exit(2)


def run() -> None:
    """The console script's entry point (``[project.scripts]`` in pyproject.toml)."""
    from lavis_ds.common.dist import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()
