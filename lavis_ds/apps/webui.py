"""Chat with an exported model about images in a browser (Gradio).

    lavis-ds webui --model exports/demo                  # http://127.0.0.1:7860
    lavis-ds webui --model exports/demo --host 0.0.0.0 --port 8080

Upload an image and ask about it; answers appear token by token. Every uploaded
image joins the conversation and is shown to the model with the next question
(as in the terminal chat, :mod:`lavis_ds.apps.chat`, whose :class:`~lavis_ds.apps.chat.ChatSession`
this page drives: the same ChatML history and the same settings). "Clear history"
keeps the images, "Restart" forgets them too. The settings on the left are
greedy / beam search / sampling with temperature, top-p and top-k, the repetition
penalty, the answer length and the seed (MiniGPT4Qwen's ``webui_demo.py`` offers
the sampling ones). Each browser tab has its own conversation; the model is shared
and answers one question at a time.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Iterator

from lavis_ds.apps.chat_session import CHAT_DEFAULTS, ChatSession, Interrupted
from lavis_ds.apps.export import ExportError, load_exported
from lavis_ds.apps.generation import GenerationSettings, add_generation_arguments, eval_processors, settings_from_args

TITLE = "lavis_ds chat"
SETTING_FIELDS = ("do_sample", "num_beams", "temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")


class _Page:
    """What the page does on each event, for one loaded model; each browser tab's ChatSession is its state."""

    def __init__(self, model, image_processor, text_processor, defaults: GenerationSettings, seed: int):
        self.model, self.image_processor, self.text_processor = model, image_processor, text_processor
        self.defaults, self.seed = defaults, seed

    def session_of(self, session: ChatSession | None) -> ChatSession:
        # Created on first use: a gr.State default is deep-copied per tab, and the model must not be.
        return session or ChatSession(self.model, self.image_processor, self.text_processor, settings=self.defaults,
                                      seed=self.seed)

    @staticmethod
    def images_note(session: ChatSession | None) -> str:
        if session is None or not session.images:
            return "No image yet: upload one to ask about it (questions without one are text-only)."
        waiting = len(session.pending)
        return (f"{len(session.images)} image(s) in this conversation"
                + (f"; {waiting} will be shown to the model with your next question." if waiting else "."))

    def add_image(self, path: str | None, session: ChatSession | None, chat: list[dict]):
        import gradio as gr

        if path is None:  # the image box was cleared
            return session, chat, self.images_note(session)
        session = self.session_of(session)
        try:
            session.add_image(path)  # named by its path in Gradio's upload cache: shown again after a clear
        except ValueError as e:
            gr.Warning(str(e))
            return session, chat, self.images_note(session)
        return session, chat + [{"role": "user", "content": {"path": path}}], self.images_note(session)

    def settings(self, values: tuple) -> GenerationSettings:
        """The settings the controls show, typed as the defaults are."""
        return GenerationSettings(**{
            name: (bool(v) if name == "do_sample" else float(v) if isinstance(getattr(self.defaults, name), float)
                   else int(v)) for name, v in zip(SETTING_FIELDS, values)})

    def ask(self, question: str, session: ChatSession | None, chat: list[dict], seed_value: float | None,
            system: str | None, *settings: Any) -> Iterator[tuple]:
        session = self.session_of(session)
        try:
            session.settings = self.settings(settings)
            if seed_value is not None:
                session.seed = int(seed_value)
            session.system = (system or "").strip() or None  # empty: the model's own system_prompt
            pieces = session.ask(question)
        except ValueError as e:
            _warn(str(e))
            yield question, chat, session, self.images_note(session)
            return
        chat = chat + [{"role": "user", "content": question}, {"role": "assistant", "content": ""}]
        yield "", chat, session, self.images_note(session)
        text = ""
        try:
            for piece in pieces:
                text += piece
                chat[-1] = {"role": "assistant", "content": text}
                yield "", chat, session, self.images_note(session)
        except (Interrupted, ValueError) as e:
            _warn(str(e))
        chat[-1] = {"role": "assistant", "content": session.turns[-1].answer if session.turns else text}
        yield "", chat, session, self.images_note(session)

    def clear_history(self, session: ChatSession | None):
        if session is not None:
            session.clear_history()
        # The images stay in the conversation: show them again as the start of the new one.
        chat = [{"role": "user", "content": {"path": image.name}} for image in session.images] if session else []
        return session, chat, self.images_note(session)

    def restart(self, session: ChatSession | None):
        if session is not None:
            session.reset()
        return session, [], None, self.images_note(session)


def _warn(message: str) -> None:
    """A warning on the page (gradio imported only then: the handlers run without it in tests)."""
    import gradio as gr

    gr.Warning(message)


def _setting_controls(defaults: GenerationSettings, context: int) -> list:
    """The generation settings' controls, in SETTING_FIELDS order."""
    import gradio as gr

    return [
        gr.Checkbox(value=defaults.do_sample, label="Sample (off: greedy, or beam search with beams > 1)"),
        gr.Slider(1, 8, value=defaults.num_beams, step=1, label="Beams"),
        gr.Slider(0.05, 2.0, value=defaults.temperature, step=0.05, label="Temperature"),
        gr.Slider(0.05, 1.0, value=defaults.top_p, step=0.05, label="Top-p"),
        gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0: all tokens)"),
        gr.Slider(1.0, 2.0, value=defaults.repetition_penalty, step=0.05, label="Repetition penalty"),
        gr.Slider(1, max(1, min(context - 1, 2048)), value=min(defaults.max_new_tokens, context - 1),
                  step=1, label="Max new tokens"),
    ]


def build_demo(model, image_processor, text_processor, defaults: GenerationSettings = CHAT_DEFAULTS,
               seed: int = 42, export_name: str = "", system: str | None = None):
    """The Gradio page for one loaded model (not launched)."""
    import gradio as gr

    page = _Page(model, image_processor, text_processor, defaults, seed)
    context = getattr(model.llm.config, "max_position_embeddings", 2048)
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"## {TITLE}" + (f" · `{export_name}`" if export_name else "")
                    + "\nUpload an image, then ask about it. Each uploaded image is shown to the model with your "
                      "next question; the conversation is kept until you clear it.")
        session = gr.State(None)
        with gr.Row():
            with gr.Column(scale=1):
                image = gr.Image(type="filepath", label="Image", sources=["upload", "clipboard"], height=240,
                                 elem_id="image")
                note = gr.Markdown(page.images_note(None), elem_id="images-note")
                with gr.Row():
                    clear_button = gr.Button("Clear history", elem_id="clear-history")
                    restart_button = gr.Button("Restart", elem_id="restart")
                with gr.Accordion("Generation settings", open=True):
                    controls = _setting_controls(defaults, context)
                    seed_box = gr.Number(value=seed, precision=0, label="Seed (set before every answer)")
                    system_box = gr.Textbox(value=system or "", label="System prompt (empty: the model's own)",
                                            elem_id="system")
            with gr.Column(scale=2):
                chatbot = gr.Chatbot(label="Conversation", height=560, elem_id="chatbot")
                question = gr.Textbox(label="Question", placeholder="Ask about the image and press Enter",
                                      elem_id="question")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop = gr.Button("Stop", elem_id="stop")

        image.upload(page.add_image, [image, session, chatbot], [session, chatbot, note])
        inputs = [question, session, chatbot, seed_box, system_box, *controls]
        outputs = [question, chatbot, session, note]
        asked = [question.submit(page.ask, inputs, outputs), send.click(page.ask, inputs, outputs)]
        # Cancelling ends the page's updates; interrupt() ends the generation behind them (its turn is not kept).
        stop.click(lambda s: s.interrupt() if s is not None else None, [session], None, cancels=asked, queue=False)
        clear_button.click(page.clear_history, [session], [session, chatbot, note])
        restart_button.click(page.restart, [session], [session, chatbot, image, note])
    return demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lavis-ds webui", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="export folder (lavis-ds export ... --out <folder>)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--seed", type=int, default=42, help="the page's initial seed")
    parser.add_argument("--system", default=None, help="the page's initial system prompt (default: the model's)")
    add_generation_arguments(parser, CHAT_DEFAULTS)
    parser.add_argument("--dtype", default="auto", help="auto (the dtype it trained in), fp32, bf16 or fp16")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    # No usage reports to Gradio's servers from a research model's demo (set before gradio is imported).
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        defaults = settings_from_args(args)
        model = load_exported(args.model, device=args.device, dtype=args.dtype)
        image_processor, text_processor = eval_processors(args.model)
    except (ExportError, ValueError) as e:
        print(f"lavis_ds webui: {e}", file=sys.stderr)
        return 2
    demo = build_demo(model, image_processor, text_processor, defaults, args.seed, export_name=args.model,
                      system=args.system)
    try:
        # ssr_mode=False: server-side rendering needs Node.js, which a Python install does not have.
        demo.queue().launch(server_name=args.host, server_port=args.port, ssr_mode=False, show_error=True,
                            footer_links=[])
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"lavis_ds webui: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
