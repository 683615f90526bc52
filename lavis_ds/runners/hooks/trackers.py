"""Experiment trackers as hooks: TensorBoard, MLflow and Weights & Biases.

Each logs, from rank 0 only, the resolved config once (TensorBoard as text, MLflow as params and a
config.yaml artifact, W&B as the run's config), then every record the run logs: the training steps
(every `run.log_freq` steps) as ``train/<key>`` and the evaluations as ``<split>/<key>``, at their
optimizer step. A run resumed from a checkpoint continues the MLflow / W&B run it started (its id is kept
in ``<output_dir>/<tracker>_run.json``); TensorBoard drops the events past the resumed step.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Literal

from omegaconf import OmegaConf

from lavis_ds.common.registry import hooks as hook_registry
from lavis_ds.runners.hooks.base import Hook


def scalars(record: dict) -> dict[str, float]:
    """A record's finite numbers, named ``<split>/<key>`` (``train/<key>`` for a training step)."""
    prefix = record.get("split", "train")
    return {f"{prefix}/{key}": float(value) for key, value in record.items()
            if key not in ("step", "epoch") and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Tracker(Hook):
    """A hook that sends the run to a tracker from rank 0: ``start`` before training (or evaluation), ``write``
    for each record, ``finish`` when the run is over, told whether it completed."""

    NAME = ""  # the registered name: names the file that remembers the tracker's run

    def __init__(self) -> None:
        self.started, self.completed = False, False

    def before_train(self, trainer) -> None:
        if trainer.rank == 0 and not self.started:
            self.start(trainer, OmegaConf.to_container(trainer.cfg, resolve=True))
            self.started = True

    def log(self, trainer, record: dict) -> None:
        values = scalars(record)
        if self.started and values:  # a skipped step's record has no loss, a user's may have no number at all
            self.write(record["step"], values)

    def after_train(self, trainer) -> None:
        self.completed = True

    def evaluate(self, trainer) -> None:
        self.completed = True

    def close(self, trainer) -> None:
        if self.started:
            self.started = False
            self.finish(self.completed)

    def start(self, trainer, config: dict) -> None:
        raise NotImplementedError

    def write(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def finish(self, completed: bool) -> None:
        raise NotImplementedError

    # A resumed run continues its tracker run rather than starting a second one beside it.
    def remembered_run(self, trainer, where: str) -> str | None:
        """The id of the tracker run to continue: the one this output_dir recorded for ``where``, if the run
        resumed from a checkpoint (a fresh start, ``run.resume: false`` included, begins a new one)."""
        path = trainer.output_dir / f"{self.NAME}_run.json"
        if not trainer.state.global_step or not path.is_file():
            return None
        info = json.loads(path.read_text())
        return info.get("id") if info.get("where") == where else None

    def remember_run(self, trainer, where: str, run_id: str) -> None:
        trainer.output_dir.mkdir(parents=True, exist_ok=True)
        (trainer.output_dir / f"{self.NAME}_run.json").write_text(json.dumps({"where": where, "id": run_id}))


@hook_registry.register("tensorboard")
class TensorBoard(Tracker):
    """TensorBoard event files in ``log_dir`` (default ``<output_dir>/tb``); on by default (`run.hooks`)."""

    NAME = "tensorboard"

    def __init__(self, log_dir: str | None = None) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.writer = None  # start()'s SummaryWriter

    def start(self, trainer, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        resumed = trainer.state.global_step
        folder = self.log_dir or trainer.output_dir / "tb"
        # A resumed run trains the steps after its checkpoint again: their old events are dropped.
        self.writer = SummaryWriter(str(folder), purge_step=resumed + 1 if resumed else None)
        if not resumed:
            self.writer.add_text("config", "".join(f"    {line}\n" for line in OmegaConf.to_yaml(config).splitlines()))

    def write(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def finish(self, completed: bool) -> None:
        self.writer.close()


@hook_registry.register("mlflow")
class MLflow(Tracker):
    """An MLflow run in ``experiment``: the config as params (dotted keys) and a config.yaml artifact, the records
    as metrics. ``tracking_uri``: a server, a database (``sqlite:///...``, needs the full ``mlflow`` package) or a
    folder; unset: ``$MLFLOW_TRACKING_URI``, else a local file store ``<output_dir>/mlruns`` (no server needed)."""

    NAME = "mlflow"
    REQUIRES = {"mlflow": "mlflow-skinny"}
    MAX_PARAMS_PER_CALL = 100  # MLflow's limits: params per log_batch, characters per param value
    MAX_PARAM_LENGTH = 6000

    def __init__(self, tracking_uri: str | None = None, experiment: str = "lavis_ds", run_name: str | None = None,
                 tags: dict[str, str] | None = None) -> None:
        super().__init__()
        self.tracking_uri, self.experiment, self.run_name, self.tags = tracking_uri, experiment, run_name, tags or {}
        self.client, self.run_id = None, None  # start()'s MlflowClient and the run it writes to

    def start(self, trainer, config: dict) -> None:
        from mlflow.tracking import MlflowClient

        uri = (self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
               or (trainer.output_dir.resolve() / "mlruns").as_uri())
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store (in maintenance mode) unless told it is wanted; a folder beside the
            # run, read with no server, is what the default is for. An explicit MLFLOW_ALLOW_FILE_STORE wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        self.run_id = self.remembered_run(trainer, uri)
        if self.run_id:
            self.client.update_run(self.run_id, status="RUNNING")
            return  # its params are logged already (MLflow refuses to change them)
        experiment = self.client.get_experiment_by_name(self.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment)
        run = self.client.create_run(experiment_id, run_name=self.run_name or trainer.output_dir.name, tags=self.tags)
        self.run_id = run.info.run_id
        self.remember_run(trainer, uri, self.run_id)
        self.log_config(config)

    def log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        params = [Param(key, value[:self.MAX_PARAM_LENGTH]) for key, value in _flatten(config).items()]
        for i in range(0, len(params), self.MAX_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + self.MAX_PARAMS_PER_CALL])
        self.client.log_text(self.run_id, OmegaConf.to_yaml(config), "config.yaml")

    def write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def finish(self, completed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if completed else "KILLED")


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """``{"run.init_lr": "0.0001", ...}``: nested mappings as dotted keys (characters MLflow refuses in a key
    become ``_``), other values as text."""
    flat = {}
    for key, value in tree.items():
        name = prefix + re.sub(r"[^\w\-. /]", "_", str(key))
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return flat


@hook_registry.register("wandb")
class Wandb(Tracker):
    """A Weights & Biases run: the config as the run's config, the records as its history at their step.
    ``mode``: ``offline`` writes the run under ``dir`` with no network (``wandb sync`` uploads it later);
    ``online`` needs ``wandb login`` (or ``WANDB_API_KEY``); unset: W&B's own choice (``WANDB_MODE``, else online).
    ``dir``: where W&B writes its ``wandb/`` folder; default: run.output_dir."""

    NAME = "wandb"
    REQUIRES = {"wandb": "wandb"}

    def __init__(self, project: str = "lavis_ds", entity: str | None = None, name: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, notes: str | None = None,
                 mode: Literal["online", "offline", "disabled", None] = None, dir: str | None = None) -> None:
        super().__init__()
        self.init_args = {"project": project, "entity": entity, "name": name, "group": group, "tags": tags,
                          "notes": notes, "mode": mode}
        self.dir = dir
        self.run = None  # start()'s wandb run

    def start(self, trainer, config: dict) -> None:
        import wandb

        folder = Path(self.dir or trainer.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        where = f"{self.init_args['entity'] or ''}/{self.init_args['project']}"
        run_id = self.remembered_run(trainer, where)
        # create_new: this run is driven through its own object, beside any run the user's code started.
        self.run = wandb.init(**{**self.init_args, "name": self.init_args["name"] or trainer.output_dir.name},
                              dir=str(folder), id=run_id, resume="allow" if run_id else None, reinit="create_new")
        self.run.config.update(config, allow_val_change=True)  # a resumed run may have raised run.max_epoch
        self.remember_run(trainer, where, self.run.id)

    def write(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def finish(self, completed: bool) -> None:
        self.run.finish(exit_code=0 if completed else 1)
