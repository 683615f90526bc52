"""Imported first by the fork server (``forked.PRELOAD``): DeepSpeed and timm as a lavis_ds run imports them, without
the optional packages they would load for features lavis_ds never calls (``lavis_ds.common.imports``), so that a
forked job holds the modules a launched one does and the server does not spend its start on mlflow and wandb."""
import lavis_ds  # noqa: F401  (timm, through lavis_ds.models.eva_vit)
from lavis_ds.runners.deepspeed.library import load_deepspeed

load_deepspeed()
