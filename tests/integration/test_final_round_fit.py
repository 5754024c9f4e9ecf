"""Issue 14 under a real Trainer: a short fit returns the consensus of the *trained* replicas, and
GRAWA's fresh probe draws from the whole training set with weights a single process can recompute.
"""

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hier import GrawaStrategy
from lightning_hier.callbacks import PullToCenter
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import digits, flat_params, trainer


class _ReplicaClassifier(Classifier):
    """Keeps its replica as the strategy left it after every optimizer step (a round included)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=0.1)
        self.initial = flat_params(self)
        self.replica = self.initial

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        self.replica = flat_params(self)


class _SaveAtTrainEnd(Callback):
    """A user callback: what every rank's module holds in ``on_train_end``, saved per rank."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: _ReplicaClassifier) -> None:
        rounds = trainer.strategy.sync.algorithm.schedule.rounds
        seen = {"end": flat_params(pl_module), "replica": pl_module.replica, "initial": pl_module.initial}
        seen["rounds"] = rounds
        torch.save(seen, self.out / f"rank{trainer.global_rank}.pt")


@pytest.mark.parametrize("name", ["easgd_fork", "localsgd_fork"])
def test_a_fit_shorter_than_tau_returns_the_average_of_the_trained_replicas(name, tmp_path):
    module = _ReplicaClassifier()
    # 3 steps: EASGD's default tau is 4, Local SGD's 8, so no round runs during the fit
    t = trainer(strategy=name, max_steps=3, callbacks=[_SaveAtTrainEnd(tmp_path)])
    t.fit(module, datamodule=digits(batch_size=64))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["rounds"] == r1["rounds"] == 0
    assert not torch.equal(r0["replica"], r1["replica"])  # the replicas trained apart
    assert torch.equal(r0["end"], r1["end"])  # every rank holds the same model in on_train_end
    torch.testing.assert_close(r0["end"], (r0["replica"] + r1["replica"]) / 2, rtol=0, atol=1e-6)
    assert (r0["end"] - r0["initial"]).abs().max() > 1e-3  # not the untrained initial model
    assert torch.equal(flat_params(module), r0["end"])  # what the fork launcher hands back


N, FEATURES, CLASSES, B, TAU, STEPS = 40, 6, 3, 4, 4, 10  # 2 ranks x 5 batches of 4 per epoch, 2 epochs
BETA, EPS = 0.5, 1e-3


class _Indexed(Dataset):
    """A fixed random problem whose samples carry their index, so a batch tells where it came from."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, FEATURES, generator=g), torch.randint(0, CLASSES, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class _Recorded(pl.LightningModule):
    """Records every ``training_step`` call: step, sample indices, weights and one draw of the global RNG."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__()
        self.net = nn.Linear(FEATURES, CLASSES)
        self.calls: list[dict] = []

    def on_train_start(self) -> None:
        torch.manual_seed(1234)  # the training stream, from here on

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        params = [p.detach().clone() for p in self.parameters()]
        self.calls.append({"step": self.trainer.global_step, "idx": idx.tolist(), "params": params})
        self.calls[-1]["draw"] = float(torch.rand(()))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class _Weights(PullToCenter):
    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def on_round(self, trainer, pl_module, report):
        self.weights.append(report.weights)
        return super().on_round(trainer, pl_module, report)


def _fit_with_fresh_probes(variant: str) -> list[dict]:
    runs = []
    for seed in (7, 7, 8):  # the same seed twice: the same probe batches
        module, rec = _Recorded(), _Weights()
        strategy = GrawaStrategy(variant=variant, tau=TAU, lam=0.5, rho=0.0, beta=BETA, eps=EPS, probe_seed=seed)
        t = trainer(strategy=strategy, max_epochs=2, callbacks=[rec])  # probe='fresh' is the default
        t.fit(module, DataLoader(_Indexed(), batch_size=B, shuffle=False))
        runs.append({"calls": module.calls, "weights": rec.weights, "final": list(module.parameters())})
    return runs


def _split(calls: list[dict]) -> tuple[list[dict], list[dict]]:
    """Training calls (one per step, in order) and probe calls (a second call at a step, or after the last)."""
    train, probes, steps = [], [], set()
    for c in calls:
        (probes if c["step"] in steps or c["step"] == STEPS else train).append(c)
        steps.add(c["step"])
    return train, probes


def _grawa_weights(probes_per_rank: list[list[dict]], variant: str) -> list[torch.Tensor]:
    """GRAWA's weights of every round from the recorded probe batches and replicas, in one process."""
    data, net = _Indexed(), nn.Linear(FEATURES, CLASSES)
    m, out = None, []
    for k in range(len(probes_per_rank[0])):
        norms = []
        for probes in probes_per_rank:
            with torch.no_grad():
                for p, v in zip(net.parameters(), probes[k]["params"], strict=True):
                    p.copy_(v)
            idx = torch.tensor(probes[k]["idx"])
            grads = torch.autograd.grad(F.cross_entropy(net(data.x[idx]), data.y[idx]), list(net.parameters()))
            n = torch.stack([g.norm().double() for g in grads])
            norms.append(n if variant == "layer" else n.sum().reshape(1))
        n = torch.stack(norms)
        m = (1 - BETA) * n if m is None else BETA * m + (1 - BETA) * n
        scores = 1 / (m / (1 - BETA ** (k + 1)) + EPS)
        out.append(scores / scores.sum(dim=0, keepdim=True))
    return out


@pytest.mark.parametrize("variant", ["model", "layer"])
def test_fresh_probe_draws_from_the_whole_dataset_and_weights_match_a_single_process(variant):
    ranks = run_workers(_fit_with_fresh_probes, variant, devices=2)
    first = [r[0] for r in ranks]
    split = [_split(run["calls"]) for run in first]
    per_epoch = STEPS // 2
    for train, probes in split:
        assert [c["step"] for c in train] == list(range(STEPS))
        # the rank's shard of each epoch (Lightning's DistributedSampler): half of the dataset
        shards = [{i for c in train[e * per_epoch : (e + 1) * per_epoch] for i in c["idx"]} for e in range(2)]
        assert [len(s) for s in shards] == [N // 2, N // 2]
        # rounds after steps 4 and 8, and the final round after step 10 (a partial period)
        assert [c["step"] for c in probes] == [TAU - 1, 2 * TAU - 1, STEPS]
        assert all(len(c["idx"]) == B for c in probes)  # the training batch size
        epochs = [min(c["step"] // per_epoch, 1) for c in probes]
        assert any(set(c["idx"]) - shards[e] for c, e in zip(probes, epochs, strict=True))  # outside the shard
        # the training RNG stream is untouched by the probes
        torch.manual_seed(1234)
        assert [c["draw"] for c in train] == [float(torch.rand(())) for _ in range(STEPS)]
    assert split[0][1][0]["idx"] != split[1][1][0]["idx"]  # every rank draws its own batch
    for runs in ranks:  # deterministic with a seed, different with another
        again, other = (_split(run["calls"])[1] for run in runs[1:])
        assert [c["idx"] for c in again] == [c["idx"] for c in _split(runs[0]["calls"])[1]]
        assert [c["idx"] for c in other] != [c["idx"] for c in again]

    expected = _grawa_weights([probes for _, probes in split], variant)
    for got, want in zip(first[0]["weights"], expected[:2], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    # the final round: the center of the trained replicas with the weights of the final probe
    w = expected[2]
    replicas = [probes[-1]["params"] for _, probes in split]
    for i, (got0, got1) in enumerate(zip(first[0]["final"], first[1]["final"], strict=True)):
        col = 0 if variant == "model" else i
        want = w[0, col].float() * replicas[0][i] + w[1, col].float() * replicas[1][i]
        torch.testing.assert_close(got0.detach(), want, rtol=0, atol=1e-6)
        assert torch.equal(got0, got1)
