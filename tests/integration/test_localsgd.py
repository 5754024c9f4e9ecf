"""Local SGD under a real Trainer: math against a single-process reference, consistency, resume."""

import copy

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import LocalSGDStrategy
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import WorkerFailed, run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, flat_params, trainer

W, N, BATCH, TAU, EPOCHS = 2, 48, 8, 4, 2


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _model() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.05, momentum=0.9, nesterov=False)


def _fit_shards(tau: int) -> torch.Tensor:
    module = _model()
    x, y = _data(dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"]))
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    t = trainer(strategy=LocalSGDStrategy(tau=tau, timeout=30), max_epochs=EPOCHS, use_distributed_sampler=False)
    t.fit(module, loader)
    return flat_params(module)


def _reference(tau: int) -> torch.Tensor:
    """W replicas in one process, plain SGD with momentum, uniform average every tau steps, and at the end."""
    replicas = [_model().net for _ in range(W)]
    opts = [torch.optim.SGD(r.parameters(), lr=0.05, momentum=0.9) for r in replicas]
    data = [_data(r) for r in range(W)]
    steps = 0
    for _ in range(EPOCHS):
        for i in range(0, N, BATCH):
            for r in range(W):
                x, y = data[r][0][i : i + BATCH], data[r][1][i : i + BATCH]
                opts[r].zero_grad()
                torch.nn.functional.cross_entropy(replicas[r](x), y).backward()
                opts[r].step()
            steps += 1
            if steps % tau == 0:
                _average(replicas)
    if steps % tau:
        _average(replicas)
    return torch.cat([p.detach().reshape(-1) for p in replicas[0].parameters()])


def _average(replicas: list[torch.nn.Module]) -> None:
    with torch.no_grad():
        for ps in zip(*(r.parameters() for r in replicas), strict=True):
            mean = sum(p.detach().clone() for p in ps) / len(ps)
            for p in ps:
                p.copy_(mean)


@pytest.mark.parametrize("tau", [1, 4, 5])  # 12 steps: tau=5 leaves 2 steps for the final average
def test_matches_single_process_reference(tau):
    out = run_workers(_fit_shards, tau, devices=W)
    ref = _reference(tau)
    for params in out:
        torch.testing.assert_close(params, ref, atol=1e-6, rtol=0)


def _consistency() -> dict:
    rec = ParamRecorder()
    module = digits_classifier()
    t = trainer(strategy=LocalSGDStrategy(tau=3, timeout=30), max_epochs=2, callbacks=[rec])
    t.fit(module, datamodule=digits(batch_size=64))
    return {"steps": rec.steps, "params": rec.params, "final": flat_params(module)}


def test_ranks_agree_at_every_round_and_at_the_end():
    r0, r1 = run_workers(_consistency, devices=2)
    last = r0["steps"][-1]  # 22: the fit's last step is followed by the final average
    for step, a, b in zip(r0["steps"], r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b) == (step % 3 == 0 or step == last), f"step {step}"
    assert torch.equal(r0["final"], r1["final"])


def _fit_with_checkpoints(ckpt_dir: str, resume: str | None, in_validation: bool = False) -> dict:
    torch.manual_seed(0)
    rec = ParamRecorder()
    module = digits_classifier(dropout=0.2)  # dropout and augmentation consume the RNG
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}", save_on_train_epoch_end=not in_validation
    )
    callbacks = [rec, checkpoint]
    t = trainer(
        strategy=LocalSGDStrategy(tau=5, timeout=30), max_epochs=4, callbacks=callbacks, enable_checkpointing=True
    )
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


@pytest.mark.parametrize("in_validation", [False, True], ids=["train_epoch_end", "inside_validation"])
def test_resume_continues_bit_identically(tmp_path, in_validation):
    # 11 steps per epoch, tau=5: at the end of epoch 2 (step 22) replicas differ (2 local steps).
    # Saved inside validation, the module holds the consensus: the replicas must still be stored.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    full = run_workers(_fit_with_checkpoints, a, None, in_validation, devices=2)
    resumed = run_workers(_fit_with_checkpoints, b, f"{a}/epoch=1.ckpt", in_validation, devices=2)
    assert_resumed_run_matches(full, resumed, after_step=22)


def test_checkpoint_loads_weights_only_and_holds_every_replica(tmp_path):
    run_workers(_fit_with_checkpoints, str(tmp_path), None, devices=2)
    ckpt = torch.load(tmp_path / "epoch=1.ckpt", weights_only=True)
    section = ckpt["lightning_hier"]
    assert section["strategy"] == "localsgd" and len(section["ranks"]) == 2
    w0, w1 = (section["ranks"][r]["model"]["net.0.1.weight"] for r in range(2))
    assert not torch.equal(w0, w1)  # replicas diverged since the last round
    # the checkpoint's state_dict is the consensus (average) model, not rank 0's replica
    torch.testing.assert_close(ckpt["state_dict"]["net.0.1.weight"], (w0 + w1) / 2)


def _resume_with(ckpt_path: str, devices: int) -> None:
    t = trainer(strategy=LocalSGDStrategy(tau=5, timeout=30), devices=devices, max_epochs=5)
    t.fit(digits_classifier(dropout=0.2), datamodule=digits(batch_size=64), ckpt_path=ckpt_path)


def test_resume_on_another_layout_or_from_another_strategy_is_rejected(tmp_path):
    run_workers(_fit_with_checkpoints, str(tmp_path), None, devices=2)
    with pytest.raises(WorkerFailed, match=r"written with layout .*'world_size': 2.* this run has layout .*4"):
        run_workers(_resume_with, str(tmp_path / "epoch=1.ckpt"), 4, devices=4)

    def ddp_checkpoint() -> None:
        t = trainer(strategy="ddp", max_epochs=1)
        t.fit(digits_classifier(), datamodule=digits(batch_size=64))
        t.save_checkpoint(str(tmp_path / "ddp.ckpt"))

    run_workers(ddp_checkpoint, devices=2)
    with pytest.raises(WorkerFailed, match="no lightning-hier strategy state"):
        run_workers(_resume_with, str(tmp_path / "ddp.ckpt"), 2, devices=2)


def test_validation_after_fit_uses_the_consensus_model():
    def fit_then_validate() -> tuple[torch.Tensor, float, float]:
        module = digits_classifier()
        t = trainer(strategy=LocalSGDStrategy(tau=7, timeout=30), max_epochs=1)
        dm = digits(batch_size=64)
        t.fit(module, datamodule=dm)
        after_fit = flat_params(module)
        acc = t.validate(module, datamodule=dm, verbose=False)[0]["val/acc"]
        return after_fit, acc, float(copy.deepcopy(module).net(torch.zeros(1, 1, 8, 8)).sum())

    (p0, acc0, o0), (p1, acc1, o1) = run_workers(fit_then_validate, devices=2)
    assert torch.equal(p0, p1) and acc0 == acc1 and o0 == o1
