"""FSDP2 with CPU offload and the meta-device build: the shards are materialised where the offload policy expects
them (the CPU), the buffers on the compute device. On a CPU only the placement policy and the load itself run (the
offload policy needs a GPU)."""

import torch
from safetensors.torch import save_file

import s2t2_dist.engines.fsdp_engine as fe


def test_shards_go_to_the_cpu_under_offload_and_to_the_gpu_otherwise(monkeypatch):
    assert fe.shard_device(True) == fe.shard_device(False) == torch.device("cpu")  # (no GPU here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert fe.shard_device(False) == torch.device("cuda", 3)
    assert fe.shard_device(True) == torch.device("cpu")  # CPUOffloadPolicy's lazy init refuses GPU shards


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        with fe.params_on_meta():
            self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("freq", torch.arange(4.0), persistent=False)


def test_a_meta_model_is_materialised_on_the_given_device_with_its_weights_and_buffers(tmp_path):
    m = _Tiny()
    assert m.lin.weight.device.type == "meta"
    w = {"lin.weight": torch.randn(2, 3), "lin.bias": torch.randn(2)}
    save_file(w, str(tmp_path / "m.safetensors"))
    fe.load_sharded(m, {k: tmp_path / "m.safetensors" for k in w}, device=torch.device("cpu"))
    assert torch.equal(m.lin.weight, w["lin.weight"]) and torch.equal(m.lin.bias, w["lin.bias"])
    assert torch.equal(m.freq, torch.arange(4.0)) and m.freq.device.type == "cpu"
