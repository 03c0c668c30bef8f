"""Run by tests/test_memory_plan.py under torchrun on 2 CPU ranks (gloo):

    python -m torch.distributed.run --nproc-per-node 2 tests/fsdp_memory_ranks.py MODEL_DIR BATCH_PT OUT_PT

The model sharded by distributed.shard_policy (embeddings, head and layers their own units), log-probs in chunks
of 3 tokens with every decoder layer checkpointed (rl_update.token_logprobs as FSDP's ranks run it): each rank
takes every other row of the batch and backpropagates sum w * log pi x world (FSDP averages the ranks' gradients);
rank 0 saves the full gradients to OUT_PT.
"""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import distributed as D  # noqa: E402
import model as models  # noqa: E402
import rl_update as U  # noqa: E402

if __name__ == "__main__":
    D.init_distributed()
    model_dir, batch, out = sys.argv[1:4]
    policy = D.shard_policy(models.load_model(model_dir), bf16=False)
    b = torch.load(batch)
    rows = list(range(D.DIST.rank, len(b["seqs"]), D.DIST.world))
    seqs, masks = [b["seqs"][i] for i in rows], [b["masks"][i] for i in rows]
    logp = U.token_logprobs(policy, seqs, 0.7, share_prefix=False, masks=masks, chunk_tokens=3,
                            checkpoint_layers=True)
    w = torch.zeros_like(logp)
    for r, i in enumerate(rows):
        w[r, :len(b["weights"][i])] = b["weights"][i]
    ((logp * w).sum() * D.DIST.world).backward()
    grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters()}
    if D.DIST.rank == 0:
        torch.save(grads, out)
    D.close_distributed()
    D.exit_rank(0)
