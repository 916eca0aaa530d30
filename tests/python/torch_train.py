"""A tiny resumable PyTorch training job for test_torch_async.py: a model and AdamW trained on
data generated from the step number, checkpointed by a CheckpointManager with background saves.

    python torch_train.py ROOT STEPS OUT

Resumes from the latest step in ROOT (tensorstash.restore as NumPy, then load_state_dict),
trains to STEPS, saving every step; prints "RESUMED <step>" and, after each save() returns (the
write then runs in the background), "SAVED <step>". At the end torch.save()s the final model
and optimizer state dicts to OUT.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import tensorstash


def as_tensors(tree):
    if isinstance(tree, dict):
        return {k: as_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_tensors(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(as_tensors(v) for v in tree)
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree.copy())
    return tree


def main() -> int:
    root, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tensorstash.CheckpointManager(root, max_to_keep=3, async_save=True) as mgr:
        start = mgr.latest_step() or 0
        if start:
            state = as_tensors(mgr.restore(start))
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            assert state["step"] == start
        print(f"RESUMED {start}", flush=True)
        for step in range(start + 1, steps + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 256, generator=g)
            y = torch.randn(32, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict(),
                            "step": step})
            print(f"SAVED {step}", flush=True)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
