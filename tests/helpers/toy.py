"""A small resumable loader and a linear-regression task for testing the training loop without a language model."""

from __future__ import annotations

import torch

from s2t2_dist.config import load_config
from s2t2_dist.engines.torch_engine import TorchEngine
from s2t2_dist.train.config import OptimConfig, TrainConfig
from s2t2_dist.train.loop import Task


class ListLoader:
    """Deterministic, resumable: yields tensors built from (epoch, index) so a resume is checkable exactly."""

    def __init__(self, n: int, batch: int, dim: int = 4, seed: int = 0):
        self.n, self.batch, self.dim, self.seed = n, batch, dim, seed
        self.pos = 0
        self.epoch = 0
        self.seen: list[tuple[int, int]] = []

    def __iter__(self):
        while self.pos < self.n:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.pos)
            x = torch.randn(self.batch, self.dim, generator=g)
            self.seen.append((self.epoch, self.pos))
            self.pos += 1
            yield {"input_ids": x, "x": x}
        self.pos, self.epoch = 0, self.epoch + 1

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, s):
        self.pos, self.epoch = s["pos"], s["epoch"]


class LinearTask(Task):
    def __init__(self, model, target_w, poison_steps=()):
        self.model, self.target_w = model, target_w
        self.poison_steps = set(poison_steps)
        self.calls = 0

    def loss(self, batch):
        self.calls += 1
        x = batch["x"]
        y = x @ self.target_w
        loss = ((self.model(x) - y) ** 2).mean()
        if self.calls in self.poison_steps:
            loss = loss * float("nan")
        return loss, {}

    def report(self, step, logger):
        return {"w_norm": float(self.model.weight.detach().norm())}

    def evaluate(self):
        return {}


def make(steps=12, overrides=(), poison_steps=(), seed=0):
    torch.manual_seed(seed)
    tcfg = load_config(TrainConfig, None, [f"steps={steps}", "batch_size=4", "micro_batch_size=2", "log_every=2",
                                           "ckpt_every=3", *overrides])
    ocfg = OptimConfig(lr=0.3, grad_clip=10.0)
    model = torch.nn.Linear(4, 1, bias=False)
    engine = TorchEngine.build(model, ocfg, steps)
    task = LinearTask(model, torch.tensor([[1.0], [-2.0], [0.5], [3.0]]), poison_steps)
    return tcfg, task, engine, ListLoader(n=5, batch=2)
