"""TensorBoard logging for multi-node runs: one run directory on shared storage, global metrics (already reduced
over all ranks) written once by rank 0 under `global/`, per-node metrics written by each node's first rank under
`node_NNN/`, so `tensorboard --logdir RUN/tb` shows every node and a slow node stands out.

For the translation P: `MetricsLogger.heatmap` draws a slice of P (its statistics are the translator's, computed
by translator/stats.py sparsity_summary; its top translations a `text` table).

A requeued run appends new event files to the same folders; TensorBoard drops the points of the earlier attempt
from the step it resumed at (out-of-order steps purge a tag's later points), so curves stay single-valued.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch


class MetricsLogger:
    def __init__(self, log_dir: str | Path, rank: int, node_rank: int, local_rank: int, enabled: bool = True,
                 flush_secs: int = 30):
        self.log_dir = Path(log_dir)
        self.is_global = enabled and rank == 0
        self.is_node = enabled and local_rank == 0
        self._writers: dict = {}
        self._closed = False
        self._dirs = {"global": "global", "node": f"node_{node_rank:03d}"}
        self._flush_secs = flush_secs

    def _writer(self, scope: str):
        """Created at the first write: a run refused by its checks (a resume of another configuration) leaves no
        empty event files behind."""
        if self._closed or not (self.is_global if scope == "global" else self.is_node):
            return None
        if scope not in self._writers:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_threads()
            self._writers[scope] = SummaryWriter(str(self.log_dir / self._dirs[scope]), flush_secs=self._flush_secs)
        return self._writers[scope]

    @contextlib.contextmanager
    def _guard(self):
        """A write that fails because the run directory is gone or no longer this run's is said as that, in one
        line (utils/rundir.verify), not as TensorBoard's traceback from its writer thread: checked before each
        write (a stat and a small JSON read; a no-op on ranks that hold no lock) and after one that failed."""
        from s2t2_dist.utils.rundir import verify

        verify(self.log_dir.parent, before="logging metrics")
        try:
            yield
        except OSError:
            verify(self.log_dir.parent, before="logging metrics")
            raise

    @property
    def _global(self):
        return self._writer("global")

    @property
    def _node(self):
        return self._writer("node")

    def scalars(self, step: int, values: dict[str, float], scope: str = "global") -> None:
        if scope not in ("global", "node"):
            raise ValueError(f"scope must be 'global' or 'node', got {scope!r}")
        w = self._global if scope == "global" else self._node
        if w is None:
            return
        with self._guard():
            for k, v in values.items():
                if v is None:
                    continue
                w.add_scalar(k, float(v), step)

    def text(self, step: int, tag: str, text: str) -> None:
        """Markdown text (TensorBoard's Text tab), global only."""
        if self._global is not None:
            with self._guard():
                self._global.add_text(tag, text, step)

    def image(self, step: int, tag: str, img_hwc) -> None:
        if self._global is not None:
            with self._guard():
                self._global.add_image(tag, img_hwc, step, dataformats="HWC")

    def heatmap(self, step: int, tag: str, matrix: torch.Tensor, max_pixels: int = 512, scale: int = 0) -> None:
        """A slice of P as an image (rows: source tokens, columns: target tokens), brighter = more mass.

        Square-root contrast so small entries stay visible; blocks larger than `max_pixels` are max-pooled
        (a sparse entry never disappears); small ones are enlarged `scale` times (default: to about 256 px)."""
        if self._global is None:
            return
        with self._guard():
            self._global.add_image(tag, heatmap_image(matrix, max_pixels, scale), step, dataformats="HWC")

    def histogram(self, step: int, tag: str, values: torch.Tensor) -> None:
        if self._global is not None:
            with self._guard():
                self._global.add_histogram(tag, values.detach().float().cpu(), step)

    def flush(self) -> None:
        with self._guard():
            for w in self._writers.values():
                w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
        self._closed = True  # later writes are dropped, as before


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread that keeps its error and re-raises it on the next write or flush (where
    `_guard` says it in one line) but also lets it escape the thread, which prints a traceback: a write queued just
    before the run directory was removed would print one beside the one-line error. Those escapes are dropped;
    every other thread's error goes to the hook in place before (installed again if someone replaced it)."""
    previous = threading.excepthook
    if getattr(previous, "_s2t2_quiet_writers", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return  # kept in the thread's `exception`; raised in the writing thread at its next write
        previous(args)

    hook._s2t2_quiet_writers = True
    threading.excepthook = hook


def heatmap_image(matrix: torch.Tensor, max_pixels: int = 512, scale: int = 0):
    """uint8 HxWx3 numpy image of |matrix| (NaN/inf shown as 0), normalised to its maximum, viridis colours."""
    m = matrix.detach().float().cpu()
    if m.dim() != 2 or m.numel() == 0:
        raise ValueError(f"heatmap: expected a non-empty 2-D matrix, got shape {tuple(m.shape)}")
    m = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0).abs()
    h, w = m.shape
    if max(h, w) > max_pixels:  # max-pool so isolated non-zeros survive
        k = -(-max(h, w) // max_pixels)
        m = torch.nn.functional.max_pool2d(m[None, None], kernel_size=k, stride=k, ceil_mode=True)[0, 0]
    m = (m / m.max().clamp_min(1e-30)).clamp(0, 1).sqrt()
    if scale <= 0:
        scale = max(1, min(16, 256 // max(m.shape)))
    if scale > 1:
        m = m.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    try:
        from matplotlib import colormaps

        rgb = colormaps["viridis"](m.numpy())[..., :3]
        return (rgb * 255).round().astype("uint8")
    except ImportError:  # grey levels without matplotlib
        g = (m * 255).round().to(torch.uint8)
        return g.unsqueeze(-1).expand(*g.shape, 3).numpy()
