"""Train (or evaluate) from one YAML: the script LAVIS users know; ``lavis-ds train`` is the same command.

    python train.py --cfg-path projects/demo/tiny_zero2.yaml [--options run.max_epoch=2 ...]
    torchrun --nproc_per_node=2 train.py --cfg-path ...
    deepspeed --num_gpus 2 train.py --cfg-path ...
"""
from lavis_ds.common.dist import exit_now
from lavis_ds.train import main

if __name__ == "__main__":
    exit_now(main())
