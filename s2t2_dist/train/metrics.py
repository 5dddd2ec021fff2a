"""TensorBoard logging for multi-node runs: one run directory on shared storage, global metrics (already reduced
over all ranks) written once by rank 0 under `global/`, per-node metrics written by each node's first rank under
`node_NNN/`, so `tensorboard --logdir RUN/tb` shows every node and a slow node stands out."""

from __future__ import annotations

from pathlib import Path

import torch


class MetricsLogger:
    def __init__(self, log_dir: str | Path, rank: int, node_rank: int, local_rank: int, enabled: bool = True):
        self.log_dir = Path(log_dir)
        self.is_global = enabled and rank == 0
        self.is_node = enabled and local_rank == 0
        self._global = self._node = None
        if self.is_global or self.is_node:
            from torch.utils.tensorboard import SummaryWriter

            if self.is_global:
                self._global = SummaryWriter(str(self.log_dir / "global"))
            if self.is_node:
                self._node = SummaryWriter(str(self.log_dir / f"node_{node_rank:03d}"))

    def scalars(self, step: int, values: dict[str, float], scope: str = "global") -> None:
        w = self._global if scope == "global" else self._node
        if w is None:
            return
        for k, v in values.items():
            if v is None:
                continue
            w.add_scalar(k, float(v), step)

    def text(self, step: int, tag: str, text: str) -> None:
        if self._global is not None:
            self._global.add_text(tag, text, step)

    def image(self, step: int, tag: str, img_hwc) -> None:
        if self._global is not None:
            self._global.add_image(tag, img_hwc, step, dataformats="HWC")

    def heatmap(self, step: int, tag: str, matrix: torch.Tensor) -> None:
        """A slice of P as an image (rows: source tokens, columns: target tokens), brighter = more mass."""
        if self._global is None:
            return
        m = matrix.detach().float().cpu()
        m = m / m.max().clamp_min(1e-12)
        img = (m.clamp(0, 1) ** 0.5 * 255).to(torch.uint8)
        self._global.add_image(tag, img.unsqueeze(-1).expand(*img.shape, 3).numpy(), step, dataformats="HWC")

    def flush(self) -> None:
        for w in (self._global, self._node):
            if w is not None:
                w.flush()

    def close(self) -> None:
        for w in (self._global, self._node):
            if w is not None:
                w.close()
