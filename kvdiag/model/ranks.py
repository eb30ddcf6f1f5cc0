"""Who a process is in a distributed job: its rank and the group it belongs to, as capture read them."""

from __future__ import annotations

from kvdiag.model.kinds import _Model

# Integer locals that count a loop's steps: the step or sequence number a distributed rank is at. Capture keeps
# only these names, and only integer values, of a rank's locals (Frame.counters); in this order one is
# preferred when a frame has several.
STEP_LOCALS = ("step", "global_step", "step_id", "step_idx", "step_num", "iteration", "iter_num", "seq",
               "seq_num", "seq_no", "batch_idx", "micro_step")


class RankIdentity(_Model):
    """A process's rank, read from its environment (torchrun, torch.distributed's env:// init, Ray's and
    vLLM's launchers set these). Only these variables are kept, never the rest of the environment.

    Two processes belong to one job when their rendezvous agrees (:meth:`job_key`): the same master
    address and port and world size, or the same elastic run id.
    """

    rank: int | None = None              # RANK: the global rank
    local_rank: int | None = None        # LOCAL_RANK
    world_size: int | None = None        # WORLD_SIZE
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE
    group_rank: int | None = None        # GROUP_RANK: the node's index in an elastic job
    master_addr: str | None = None       # MASTER_ADDR
    master_port: int | None = None       # MASTER_PORT
    run_id: str | None = None            # TORCHELASTIC_RUN_ID

    def job_key(self) -> str | None:
        """What every rank of one job shares (None: not enough to group by)."""
        if self.master_addr and self.master_port is not None:
            return f"{self.master_addr}:{self.master_port}/{self.world_size or '?'}"
        if self.run_id:
            return f"run {self.run_id}/{self.world_size or '?'}"
        return None
