"""Checkpoints of EASGD, LSGD and GRAWA: every replica, the center, norm EMAs and counters; exact resume."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hier import EasgdStrategy, GrawaStrategy, LsgdStrategy
from lightning_hier.testing import run_workers
from tests.helpers import ParamRecorder, assert_resumed_run_matches, digits, digits_classifier, trainer

STRATEGIES = {"easgd": EasgdStrategy, "lsgd": LsgdStrategy, "grawa": GrawaStrategy}
PARAMS = ["net.0.1.weight", "net.0.1.bias", "net.1.0.weight", "net.1.0.bias"]  # module order
CASES = [
    ("grawa", {"variant": "layer", "tau": 5, "rho": 0.1, "probe": "batch"}, False),
    # saved inside validation, while the module holds the center: the replicas must be stored
    ("grawa", {"variant": "layer", "tau": 5, "rho": 0.1, "probe": "batch"}, True),
    # fresh probe batches (with augmentation and dropout) seeded apart from training: nothing to save
    ("grawa", {"variant": "layer", "tau": 5, "rho": 0.1, "probe": "fresh"}, False),
    ("easgd", {"tau": 5, "rho": 0.05}, False),
    ("lsgd", {"tau": 5}, False),
]


def _fit_with_checkpoints(name: str, kwargs: dict, ckpt_dir: str, resume: str | None, in_validation: bool) -> dict:
    torch.manual_seed(0)
    rec = ParamRecorder()
    module = digits_classifier(dropout=0.2)  # dropout and augmentation consume the RNG, also in the probe
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}", save_on_train_epoch_end=not in_validation
    )
    strategy = STRATEGIES[name](timeout=30, **kwargs)
    t = trainer(strategy=strategy, max_epochs=4, callbacks=[rec, checkpoint], enable_checkpointing=True)
    t.fit(module, datamodule=digits(batch_size=64, augment=True), ckpt_path=resume)
    return {"steps": rec.steps, "params": rec.params}


def _expected_consensus(name: str, ranks: list[dict]) -> list[torch.Tensor]:
    """The consensus model from the saved replicas and algorithm state, by the papers' definitions."""
    replicas = [[r["model"][k].double() for k in PARAMS] for r in ranks]
    policy = ranks[0]["algorithm"]["policy"]
    if name == "easgd":  # the center variable
        flat = ranks[0]["algorithm"]["center"][0].double()
        pieces = torch.split(flat, [x.numel() for x in replicas[0]])
        return [t.view_as(x) for t, x in zip(pieces, replicas[0], strict=True)]
    if name == "lsgd":  # the replica of the rank with the lowest running loss
        running = []
        for r in ranks:
            p = r["algorithm"]["policy"]
            running.append(p["loss_sum"] / p["loss_count"] if p["loss_count"] else p["last"])
        return replicas[min(range(len(ranks)), key=lambda i: (running[i], i))]
    w = policy["weights"]  # GRAWA: [W, L] weights of the latest round
    return [sum(w[r, i] * replicas[r][i] for r in range(len(ranks))) for i in range(len(PARAMS))]


@pytest.mark.parametrize(
    ("name", "kwargs", "in_validation"),
    CASES,
    ids=[
        c[0] + (f"-{c[1]['probe']}" if "probe" in c[1] else "") + ("-inside-validation" if c[2] else "") for c in CASES
    ],
)
def test_resume_is_bit_identical_and_the_checkpoint_holds_replicas_center_and_state(
    name, kwargs, in_validation, tmp_path
):
    # 11 steps per epoch, tau = 5: at the end of epoch 2 (step 22) the replicas are 2 steps apart
    args = (name, kwargs)
    full = run_workers(_fit_with_checkpoints, *args, str(tmp_path / "a"), None, in_validation, devices=2)
    ckpt_path = tmp_path / "a" / "epoch=1.ckpt"
    resumed = run_workers(_fit_with_checkpoints, *args, str(tmp_path / "b"), str(ckpt_path), in_validation, devices=2)
    assert_resumed_run_matches(full, resumed, after_step=22)

    ckpt = torch.load(ckpt_path, weights_only=True)
    section = ckpt["lightning_hier"]
    ranks = section["ranks"]
    assert section["strategy"] == name and len(ranks) == 2
    assert not torch.equal(ranks[0]["model"][PARAMS[0]], ranks[1]["model"][PARAMS[0]])  # every replica
    for r in ranks:
        alg = r["algorithm"]
        assert alg["schedule"] == {"tau": 5, "steps": 22, "since_sync": 2, "rounds": 4}
        assert torch.equal(alg["center"][0], ranks[0]["algorithm"]["center"][0])  # one center, on every rank
    if name == "grawa":
        ema = ranks[1]["algorithm"]["policy"]["ema"]
        assert ema["r"] == 4 and ema["m"].shape == (len(PARAMS),) and (ema["m"] > 0).all()
    expected = _expected_consensus(name, ranks)
    for key, want in zip(PARAMS, expected, strict=True):
        torch.testing.assert_close(ckpt["state_dict"][key].double(), want, rtol=0, atol=1e-6)
