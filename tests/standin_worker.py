"""Control paths exercised one by one under the NCCL stand-in, outside a training loop.

    LAVIS_DS_NCCL_STANDIN=1 <launcher variables> python tests/standin_worker.py OUT_DIR

Each process starts its groups as train.py does (``dist.init_distributed``: the default group refuses CPU
tensors, the control group beside it), then calls every control path that is not part of a
loop the test can run here: the stop agreement with a failure on one rank, FSDP's "built on
rank 0" vote (and its meta-device model), the shared-folder check, the GPU-sharing check, and
batch inference's barrier and failure vote. It writes what each returned to ``OUT_DIR/rank<r>.json``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist


def main(argv: list[str]) -> int:
    from lavis_ds.common import comm, dist
    from lavis_ds.common.device import check_one_gpu_per_process
    from lavis_ds.common.errors import InputError
    from lavis_ds.apps.generate import Processes
    from lavis_ds.runners import faults
    from lavis_ds.runners.fsdp.engine import built_on_rank0
    from lavis_ds.runners.shared_folder import not_shared_error

    out = Path(argv[0])
    dist.init_distributed()
    rank, results = dist.rank(), {}
    try:  # the default group is the stand-in's: a CPU tensor there fails as on NCCL
        torch_dist.all_reduce(torch.ones(1))
        results["default_group_refuses_cpu"] = False
    except RuntimeError as e:
        results["default_group_refuses_cpu"] = "No backend type associated with device type cpu" in str(e)
    results["stop"] = faults.agree(15 if rank == 1 else 0)
    try:
        faults.agree(0, InputError("a record rank 1 could not read") if rank == 1 else None)
    except faults.PeerFailed as e:
        results["peer_failed"] = str(e)
    except InputError as e:
        results["own_error"] = str(e)
    with torch.device("meta" if rank == 1 else "cpu"):
        model = torch.nn.Linear(2, 2)
    results["built_on_rank0"] = built_on_rank0(model)
    results["built_on_rank0_whole"] = built_on_rank0(torch.nn.Linear(2, 2))
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    comm.barrier()
    results["shared_folder_error"] = str(not_shared_error(out) or "")
    check_one_gpu_per_process()
    processes = Processes()  # the group exists: batch inference's own calls on it
    processes.barrier()
    results["any_failed"] = processes.any_failed(rank == 0)
    results["none_failed"] = processes.any_failed(False)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    processes.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
