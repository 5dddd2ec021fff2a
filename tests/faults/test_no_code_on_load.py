"""Checkpoints and P files load without executing code.

Statically: every torch.load in the package passes weights_only=True, nothing calls pickle.load / pickle.loads,
numpy never unpickles, YAML is read with safe_load. Dynamically: files crafted to run code when unpickled are
refused by each loader the package uses (the loop's and TorchEngine's files: test_checkpoint_faults.py; P files:
test_bad_inputs.py; here DeepSpeed's checkpoint files and FSDP2/DCP's .metadata, which DeepSpeed and
torch.distributed.checkpoint would otherwise unpickle freely)."""

from __future__ import annotations

import ast
import os
import pickle

import pytest
import torch
from tests.helpers.faults_suite import REPO, ledger

pytestmark = pytest.mark.faults


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                    else f"{ast.unparse(f.value)}.{f.attr}" if isinstance(f, ast.Attribute)
                    else f.id if isinstance(f, ast.Name) else "")
            yield name, node


def _kw(node, key):
    for k in node.keywords:
        if k.arg == key:
            return k.value
    return None


def test_every_loader_in_the_package_is_safe():
    bad, yaml_loaders = [], []
    files = sorted((REPO / "s2t2_dist").rglob("*.py"))
    assert len(files) > 30
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for name, node in _calls(tree):
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if name == "torch.load":
                wo = _kw(node, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    bad.append(f"{where}: torch.load without weights_only=True")
            elif name in ("pickle.load", "pickle.loads", "cPickle.load", "dill.load", "joblib.load"):
                bad.append(f"{where}: {name}")
            elif name in ("np.load", "numpy.load", "np.lib.format.read_array"):
                ap = _kw(node, "allow_pickle")
                if not (isinstance(ap, ast.Constant) and ap.value is False):
                    bad.append(f"{where}: {name} without allow_pickle=False")
            elif name in ("yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load"):
                loader = _kw(node, "Loader")
                if name.startswith("yaml.load") and isinstance(loader, ast.Name):
                    yaml_loaders.append((path, loader.id, where))
                else:
                    bad.append(f"{where}: {name} (use yaml.safe_load or a SafeLoader subclass)")
    for path, loader, where in yaml_loaders:  # a Loader defined in the module must be a SafeLoader
        import importlib

        import yaml

        mod = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        if not issubclass(getattr(mod, loader), yaml.SafeLoader):
            bad.append(f"{where}: yaml.load with {loader}, not a SafeLoader")
    assert not bad, "\n".join(bad)


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['S2T2_EVIL_MARK']}",))


def test_deepspeed_checkpoint_files_are_not_unpickled_freely(tmp_path, monkeypatch):
    from s2t2_dist.engines.deepspeed_engine import _safe_ds_load

    mark = tmp_path / "code_ran"
    monkeypatch.setenv("S2T2_EVIL_MARK", str(mark))
    f = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": _Evil()}}, f)
    with pytest.raises(RuntimeError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt holds pickled objects other "
                                           r"than tensors.*refusing to unpickle it"):
        _safe_ds_load(str(f), "cpu")
    assert not mark.exists()
    # what DeepSpeed really writes still loads
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.save({"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0), "t": torch.ones(2)}, f)
    sd = _safe_ds_load(str(f), "cpu")
    assert sd["zero_stage"] == ZeroStageEnum.weights and sd["t"].sum() == 2
    ledger("checkpoint: pickled code in a DeepSpeed checkpoint file (refused, not run)")


def test_fsdp_dcp_metadata_is_checked_before_dcp_unpickles_it(tmp_path, monkeypatch):
    from s2t2_dist.engines.fsdp_engine import check_dcp_metadata

    mark = tmp_path / "code_ran"
    monkeypatch.setenv("S2T2_EVIL_MARK", str(mark))
    meta = tmp_path / ".metadata"
    meta.write_bytes(pickle.dumps({"state_dict_metadata": _Evil()}))
    with pytest.raises(RuntimeError, match=r"\.metadata is not plain DCP metadata .*global posix.system is not "
                                           r"allowed"):
        check_dcp_metadata(meta)
    assert not mark.exists()
    # real DCP metadata passes
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    check_dcp_metadata(tmp_path / "dcp" / ".metadata")
    ledger("checkpoint: pickled code in an FSDP2 (DCP) .metadata file (refused, not run)")
