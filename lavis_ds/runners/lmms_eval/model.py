"""``LavisDsLmms``: lmms-eval's model class for a lavis_ds model (``--model lavis_ds``); imports lmms-eval.

It evaluates a model that is already in memory: the trainer's (handing over its engine, so that ZeRO-3 and FSDP2
gather what they shard), or one loaded from a run or an export (``lavis_ds.apps.eval_model.PretrainedLavisDsLmms``,
which lmms-eval's ``--model lavis_ds --model_args pretrained=PATH`` builds). Import this module only where
lmms-eval is installed (``require_lmms_eval`` says how to install it).
"""
from __future__ import annotations

import contextlib
import itertools
from functools import partial, wraps
from typing import Any, Callable, Iterator

import torch
from lmms_eval.api.instance import GenerationResult
from lmms_eval.api.model import lmms
from tqdm import tqdm

from lavis_ds.common import comm, dist
from lavis_ds.common.errors import InputError, LavisDsError, message_of
from lavis_ds.common.modes import eval_mode
from lavis_ds.common.precision import as_trained
from lavis_ds.datasets.instruction import DEFAULT_MAX_FRAMES
from lavis_ds.runners.lmms_eval.failures import EvaluationFailed, agree_on_evaluation, what_failed
from lavis_ds.runners.lmms_eval.requests import (Request, batch_of, cut_at, generate_kwargs, stop_strings)
from lavis_ds.runners.lmms_eval.scoring import ContinuationScorer, check_complete, scoring_problem

# What lavis_ds generates with when neither the caller nor the task says otherwise (the demo's run.generate).
DEFAULT_GENERATION = {"max_new_tokens": 30, "num_beams": 1}
CLI = "lmms-eval --model lavis_ds"  # who reports a failure the ranks agree on after each request method


def _agreed(method: Callable) -> Callable:
    """``method`` (a request method lmms-eval calls), ended by the ranks' agreement on whether it failed on any of
    them where the model was made with ``agree_per_call`` (:meth:`LavisDsLmms._agreed_call`)."""
    @wraps(method)
    def call(self: LavisDsLmms, requests):
        if not self.agree_per_call:
            return method(self, requests)
        return self._agreed_call(partial(method, self), requests)
    return call


class LavisDsLmms(lmms):
    """A lavis_ds model as lmms-eval's model: ``generate_until`` and ``loglikelihood`` over lmms-eval's requests.

    Simple style (``is_simple``): lmms-eval hands each request's context text and visuals, and the model's own
    chat template (``ChatPrompt``: its system prompt and turn markers) makes the prompt, exactly as in training and
    in ``lavis-ds generate``; images go through the run's eval image processor, videos are sampled to
    ``max_frames`` frames where the architecture takes videos. Requests are answered ``batch_size`` at a time.

    Under several processes lmms-eval gives each rank its share of the requests (``rank``, ``world_size`` follow
    ``torch.distributed``) and pads the shares to the same length; every rank then runs as many batches as the
    rank with the most (agreed through ``lavis_ds.common.comm``, whose control group takes host tensors under
    NCCL too), since a ZeRO-3 or FSDP2 forward is a collective. ``device`` is the model's: lmms-eval's own
    collectives put their tensors there.

    Args:
        model: The lavis_ds model (the engine's module in training: ``trainer.engine.module``).
        image_processor: The eval image processor (``lavis_ds.image_config.eval_processors_of(run config)``).
        text_processor: The eval text processor, or None.
        engine: The trainer's engine: ``engine.generate(batch, **kwargs)`` and ``engine.forward(batch)`` run the
            model as training runs it (dtype, autocast, gathered shards). None: ``model`` is run as it trained
            (``common.precision.as_trained``), the way ``lavis-ds generate`` runs an export.
        batch_size: Requests per generate or forward call (per process).
        generation: Generation settings under the task's (``max_new_tokens``, ``num_beams``, ...; default
            ``DEFAULT_GENERATION``); a task's ``generation_kwargs`` override them.
        max_frames: Frames sampled from a video request.
        hold_failures: A request this rank cannot prepare (its document's image missing, say) or score whole is
            answered blank and its failure kept in ``failure`` instead of raised, so that this rank still joins every
            round and gather the others run; the caller raises it once lmms-eval is done (the ``lmms_eval`` hook,
            where the ranks then agree on it). False: raised at once.
        agree_per_call: For lmms-eval's own command line on several processes, after whose evaluation nobody calls
            lavis_ds: each request method (``generate_until``, ``loglikelihood``, ...) holds this rank's failures
            while it runs, then the ranks agree on whether it failed on any (one collective); if so every rank
            raises, so that lmms-eval stops the evaluation on every rank rather than scoring blank answers or
            leaving the others waiting in its next gather. False (the ``lmms_eval`` hook, ``lavis-ds eval``): the
            caller agrees once lmms-eval is done.
    """

    is_simple = True

    def __init__(self, model: torch.nn.Module, image_processor: Callable, text_processor: Callable | None = None, *,
                 engine: Any = None, batch_size: int = 1, generation: dict[str, Any] | None = None,
                 max_frames: int = DEFAULT_MAX_FRAMES, hold_failures: bool = False, agree_per_call: bool = False):
        super().__init__()
        if int(batch_size) < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size!r}")
        self.lavis_model, self.engine = model, engine
        self.image_processor, self.text_processor = image_processor, text_processor
        self.batch_size_per_process, self.max_frames = int(batch_size), int(max_frames)
        self.generation = {**DEFAULT_GENERATION, **(generation or {})}
        self._rank, self._world_size = dist.rank(), dist.world_size()
        self._joining: tuple[dict, dict] | None = None  # the batch a round without requests of this rank reruns
        self.hold_failures, self.agree_per_call = hold_failures or agree_per_call, agree_per_call
        self.failure: LavisDsError | None = None  # the first failure held (hold_failures), naming the request

    # ------------------------------------------------------------------ what lmms-eval reads
    @property
    def batch_size(self) -> int:
        return self.batch_size_per_process

    @property
    def device(self) -> torch.device:
        return next(self.lavis_model.parameters()).device

    @property
    def tokenizer(self):
        return self.lavis_model.llm.tokenizer

    def clean(self) -> None:
        """Nothing: lmms-eval's default drops every ``nn.Module`` attribute after an evaluation; the model is the
        caller's (the trainer evaluates it again later)."""

    # ------------------------------------------------------------------ requests
    @_agreed
    def generate_until(self, requests) -> list[str]:
        texts = []
        for batch_requests in self._batches(requests, self._request, with_settings=True):
            if batch_requests is None:  # a round this rank joins without requests of its own
                self._generate(*self._joining)
                continue
            kwargs = generate_kwargs(batch_requests[0].settings, self.generation, batch_requests[0].where)
            batch = self._batch_of(batch_requests, with_settings=True)
            self._joining = (batch, kwargs)
            answers = self._generate(batch, kwargs)
            texts.extend(cut_at(text, stop_strings(request.settings, request.where))
                         for text, request in zip(answers, batch_requests, strict=True))
        return texts

    @_agreed
    def loglikelihood(self, requests) -> list[GenerationResult]:
        """Per request, ``GenerationResult(text=(the continuation's loss, whether greedy decoding gives it))``.

        The loss is the mean negative log-probability of the continuation's tokens, what lmms-eval 0.7.3's models
        return (``llava_hf``: the model's loss over them): its multiple-choice scoring picks the choice with the
        lowest value (``np.argmin`` in api/task.py, "we return the actual loss"), not the highest log-likelihood.
        """
        problem = scoring_problem(self.lavis_model)
        if problem is not None:  # on every rank, one without requests too: the ranks then agree alike
            task = f"task {requests[0].args[4]!r}" if requests else "a task of this evaluation"
            raise InputError(f"{task} asks for log-likelihoods (a multiple-choice task); {problem}")
        results = []
        for batch_requests in self._batches(requests, self._request, with_settings=False):
            if batch_requests is None:
                self._score(self._joining[0])
                continue
            batch = self._batch_of(batch_requests, with_settings=False)
            self._joining = (batch, {})
            scores = {key: value.tolist() for key, value in self._score(batch).items()}
            wheres = [r.where for r in batch_requests]
            self._held(partial(check_complete, scores["complete"], wheres, self.lavis_model), lambda: None, wheres[0])
            # Each (loss, is_greedy) pair inside a GenerationResult: lmms-eval 0.7.3's evaluator passes a result's
            # text through as it is, but turns any other output that is not a string into its str()
            # (api/instance.py, unwrap_generation_output), which no multiple-choice task can read back.
            results.extend(GenerationResult(text=(-logp / max(tokens, 1), bool(greedy)))
                           for logp, tokens, greedy in zip(scores["logp"], scores["tokens"], scores["greedy"]))
        return results

    @_agreed
    def generate_until_multi_round(self, requests) -> list[str]:
        raise InputError("lavis_ds answers single-round tasks (generate_until, loglikelihood); a multi-round task "
                         "needs generate_until_multi_round, which the lavis_ds model does not implement")

    def _agreed_call(self, answer: Callable[[list], list], requests) -> list:
        """Collective: ``answer(requests)`` with this rank's failures held, then the ranks' agreement on whether it
        failed on any (``failures.agree_on_evaluation``): every rank raises if so, the failing rank its own line
        naming the task, the document and the rank, the others ``faults.PeerFailed`` with it.

        The agreement is aligned: lmms-eval 0.7.3's ``evaluate`` (evaluator.py) gathers every rank's request types
        and calls each type's method once on every rank, in the same order, a rank without requests of a type with
        an empty list, and pads the ranks' lists to equal length with copies of their last request. Inside a call the
        only collective is ``_batches``' count of rounds, made before any request runs (what can fail before it,
        the scoring check and a multi-round task, fails alike on every rank), and the model ``--model_args`` loads
        is whole on each rank (no engine: its forwards are no collectives), so a rank that raises after it meets
        the others here once they finish their rounds. Not aligned, as for ``_batches``' count: lmms-eval's
        ``--use_cache`` (a rank whose requests are all cached skips the call) and agentic tasks (one call per step).
        """
        answers, failure = None, None
        try:
            answers = answer(requests)
        except Exception as e:  # told to every rank by the agreement, rather than leaving them in lmms-eval's gather
            failure = e
        failure, self.failure = self.failure or failure, None  # the first held one came first
        tasks = sorted({instance.args[4] for instance in requests}) or ["(none on this rank)"]
        agree_on_evaluation(None if failure is None else EvaluationFailed.from_error(
            f"{CLI}: {what_failed(failure, tasks)}", failure), train_on=False)
        return answers

    # ------------------------------------------------------------------ running the model
    def _request(self, instance, with_settings: bool) -> Request:
        context, second, doc_to_visual, doc_id, task, split = instance.args[:6]
        doc = self.task_dict[task][split][doc_id]
        visuals = doc_to_visual(doc) if callable(doc_to_visual) else []
        where = _where(instance)
        if with_settings:
            return Request(context, list(visuals or []), settings=dict(second or {}), where=where)
        return Request(context, list(visuals or []), continuation=second, where=where)

    def _batches(self, requests, make: Callable, with_settings: bool) -> Iterator[list[Request] | None]:
        """This rank's requests in batches of ``batch_size`` (a batch shares its generation settings), then None
        for each round another rank still runs (sharded engines need every rank in every forward)."""
        made = [self._held(lambda instance=instance: make(instance, with_settings),
                           lambda: _blank(with_settings), _where(instance)) for instance in requests]
        groups = [list(g) for _, g in itertools.groupby(made, key=lambda r: repr(sorted(r.settings.items())))]
        batches = [group[i:i + self.batch_size] for group in groups for i in range(0, len(group), self.batch_size)]
        rounds = len(batches)
        if self.world_size > 1:
            rounds = int(comm.all_reduce(torch.tensor([rounds]), op="max").item())
        bar = tqdm(total=len(made), disable=self.rank != 0, desc="lmms-eval requests")
        for batch in batches:
            yield batch
            bar.update(len(batch))
        bar.close()
        if rounds > len(batches) and not batches:
            # No request here (a --limit below the number of processes leaves some without documents, and lmms-eval
            # has none to pad with): the rounds run a text-only blank, whose answer nobody reads.
            self._joining = (batch_of([_blank(with_settings)], self.image_processor, self.text_processor,
                                      self.max_frames),
                             generate_kwargs({}, self.generation, "a blank request"))
        for _ in range(rounds - len(batches)):
            yield None

    def _batch_of(self, requests: list[Request], with_settings: bool) -> dict[str, Any]:
        return self._held(lambda: batch_of(requests, self.image_processor, self.text_processor, self.max_frames),
                          lambda: batch_of([_blank(with_settings)] * len(requests), self.image_processor,
                                           self.text_processor, self.max_frames), requests[0].where)

    def _held(self, prepare: Callable[[], Any], blank: Callable[[], Any], where: str) -> Any:
        """``prepare()``; with ``hold_failures``, ``blank()`` where it fails, its failure kept (the first)."""
        if not self.hold_failures:
            return prepare()
        try:
            return prepare()
        except Exception as e:  # raised by the caller after lmms-eval's gathers, which this rank must still join
            if self.failure is None:
                self.failure = e if isinstance(e, LavisDsError) else LavisDsError(
                    f"{where}: {type(e).__name__}: {message_of(e)}")
            return blank()

    def _generate(self, batch: dict[str, Any], kwargs: dict[str, Any]) -> list[str]:
        with self._running():
            if self.engine is not None:
                return self.engine.generate(batch, **kwargs)
            batch, context = as_trained(self.lavis_model, batch)
            with context:
                return self.lavis_model.generate(batch, **kwargs)

    @torch.no_grad()
    def _score(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        batch = {**batch, "objective": ContinuationScorer()}
        with self._running():
            if self.engine is not None:
                return self.engine.forward(batch)
            batch, context = as_trained(self.lavis_model, batch)
            with context:
                return self.lavis_model(batch)

    def _running(self) -> contextlib.AbstractContextManager:
        return eval_mode(self.lavis_model)


def _blank(with_settings: bool) -> Request:
    """A text-only request whose answer nobody reads: what a rank runs in a round it has no request of its own for,
    or in place of a request it could not prepare."""
    return Request(" ", continuation=None if with_settings else "", where="a blank request")


def _where(instance) -> str:
    """An lmms-eval request's task and document, for messages."""
    doc_id, task, split = instance.args[3:6]
    return f"task {task} ({split} doc {doc_id})"
