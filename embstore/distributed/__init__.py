"""embstore.distributed: embedding tables sharded over the ranks of a torch.distributed group.

    import torch.distributed as dist, embstore.distributed as ed
    dist.init_process_group("gloo", ...)            # or torchrun's environment
    plan = ed.Plan(2, {"user": ed.Placement("row", (0, 1))})
    store = ed.open("runs/ctr", tables=[...], plan=plan)
    rows = store.lookup("user", my_ids)             # every rank calls, with its own ids
    store.apply_gradients("user", my_ids, my_grads) # = one store fed the ranks' inputs in order
    store.checkpoint("ckpt/step100", step=100)
    store = ed.restore("ckpt/step100", "runs/ctr4") # with 4 ranks, or another plan

Sharding kinds per table: table-wise, row-wise (hash or ranges) and column-wise (`Placement`);
`plan_tables` chooses them to balance the bytes each rank looks up per step, or, within
per-rank tier budgets, the predicted time of each rank's shards through the tier chains it
gives them (`Plan.tiers`; `tables_from_profile` reads tables' miss-ratio curves from a
profile). Every method is collective and bit-identical to one process fed the ranks' inputs
concatenated in rank order.
"""

from ..errors import PeerFailedError
from ._open import open
from ._restore import restore
from .plan import KINDS, Placement, Plan, default_plan
from .planner import (
    MissCurve,
    PlanReport,
    TableProfile,
    parse_tier_budgets,
    plan_tables,
    round_robin,
    tables_from_profile,
)
from .store import ShardedStore

__all__ = ["KINDS", "MissCurve", "PeerFailedError", "PlanReport", "Placement", "Plan",
           "ShardedStore", "TableProfile", "default_plan", "open", "parse_tier_budgets",
           "plan_tables", "restore", "round_robin", "tables_from_profile"]
