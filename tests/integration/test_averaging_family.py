"""EASGD, LSGD and GRAWA under a real Trainer: single-process references, consensus, cadence, accuracy.

The references below simulate every replica in one process with plain torch, from the papers'
formulas (see docs/algorithms.md, section 4), independently of the classes under test.
"""

import csv

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_hier import EasgdStrategy, GrawaStrategy, LocalSGDStrategy, LsgdStrategy
from lightning_hier.callbacks import PullToCenter
from lightning_hier.models import Classifier, mlp
from lightning_hier.testing import run_workers
from tests.helpers import digits, digits_classifier, flat_params, trainer

W, N, BATCH, EPOCHS, LR = 2, 40, 8, 2, 0.05  # 5 steps per epoch, 10 in all
STRATEGIES = {"localsgd": LocalSGDStrategy, "easgd": EasgdStrategy, "lsgd": LsgdStrategy, "grawa": GrawaStrategy}


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randn(N, 1, 8, 8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _model() -> Classifier:
    torch.manual_seed(0)
    return Classifier(mlp((1, 8, 8), 10, hidden=(16,)), 10, lr=LR, momentum=0.9, nesterov=False)


def _fit_shards(name: str, kwargs: dict) -> dict:
    module = _model()
    x, y = _data(dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"]))
    strategy = STRATEGIES[name](timeout=30, **kwargs)
    t = trainer(strategy=strategy, max_epochs=EPOCHS, use_distributed_sampler=False)
    t.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    logged = {k: float(v) for k, v in t.callback_metrics.items()}
    return {"params": flat_params(module), "metrics": dict(strategy.last_metrics), "logged": logged}


def _toward(xs: list[torch.Tensor], targets: list[torch.Tensor], strength: float) -> list[torch.Tensor]:
    """x + strength (target - x), per tensor."""
    return [x.detach() + strength * (t - x.detach()) for x, t in zip(xs, targets, strict=True)]


class _Reference:
    """W replicas in one process: SGD with momentum, proximal pull, a round every tau steps, finalize."""

    def __init__(self, name: str, tau: int, lam: float, rho: float, **opts: object) -> None:
        self.name, self.tau, self.lam, self.rho, self.opts = name, tau, lam, rho, opts
        self.nets = [_model().net for _ in range(W)]
        self.optims = [torch.optim.SGD(n.parameters(), lr=LR, momentum=0.9) for n in self.nets]
        self.center = [p.detach().clone() for p in self.nets[0].parameters()]
        self.m = [0.0] * W  # GRAWA norm EMAs (scalars or per-tensor tensors)
        self.rounds = 0
        self.weights = [[1.0 / W] * len(self.center) for _ in range(W)]
        self.losses: list[list[float]] = [[] for _ in range(W)]
        self.last = [float("inf")] * W

    def params(self, r: int) -> list[torch.Tensor]:
        return list(self.nets[r].parameters())

    def run(self) -> torch.Tensor:
        data = [_data(r) for r in range(W)]
        step = 0
        for _ in range(EPOCHS):
            for i in range(0, N, BATCH):
                batches = [(d[0][i : i + BATCH], d[1][i : i + BATCH]) for d in data]
                for r, (x, y) in enumerate(batches):
                    self.optims[r].zero_grad()
                    loss = F.cross_entropy(self.nets[r](x), y)
                    loss.backward()
                    self.optims[r].step()
                    self.losses[r].append(float(loss.detach()))
                    self._set(r, _toward(self.params(r), self.center, self.rho / self.tau))
                step += 1
                if step % self.tau == 0:
                    self._round(batches)
        self._finalize(step % self.tau == 0, batches)
        return torch.cat([p.detach().reshape(-1) for p in self.params(0)])

    def _set(self, r: int, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params(r), values, strict=True):
                p.copy_(v)

    def _grawa_weights(self, batches: list) -> None:
        beta, eps, p = self.opts["beta"], self.opts["eps"], self.opts["p"]
        self.rounds += 1
        scores = []
        for r, (x, y) in enumerate(batches):
            if self.opts["probe"] == "batch":  # the round's batch again, at the current weights
                grads = torch.autograd.grad(F.cross_entropy(self.nets[r](x), y), self.params(r))
            else:  # the gradients of the step that closed the round
                grads = [q.grad for q in self.params(r)]
            n = torch.stack([g.norm().double() for g in grads])
            if self.opts["variant"] == "model":
                n = n.sum().reshape(1) if self.opts["norm"] == "sum" else n.norm().reshape(1)
            self.m[r] = beta * self.m[r] + (1 - beta) * n
            scores.append((self.m[r] / (1 - beta**self.rounds) + eps) ** -p)
        total = sum(scores)
        self.weights = [[float(w) for w in (s / total).expand(len(self.center))] for s in scores]

    def _weighted_center(self) -> list[torch.Tensor]:
        return [sum(self.weights[r][i] * self.params(r)[i].detach() for r in range(W)) for i in range(len(self.center))]

    def _leader(self, fresh: bool) -> int:
        running = [sum(v) / len(v) if v else self.last[r] for r, v in enumerate(self.losses)]
        if fresh:
            self.last, self.losses = running, [[] for _ in range(W)]
        return min(range(W), key=lambda r: (running[r], r))

    def _round(self, batches: list) -> None:
        xs = [[p.detach().clone() for p in self.params(r)] for r in range(W)]
        if self.name == "easgd":
            beta = self.opts["beta"]
            mean = [sum(xs[r][i] for r in range(W)) / W for i in range(len(self.center))]
            for r in range(W):
                self._set(r, _toward(xs[r], self.center, beta / W))
            self.center = _toward(self.center, mean, beta)
            return
        if self.name == "lsgd":
            c = xs[self._leader(fresh=True)]
        else:
            self._grawa_weights(batches)
            c = self._weighted_center()
        for r in range(W):
            self._set(r, _toward(xs[r], c, self.lam))
        self.center = c

    def _finalize(self, just_synced: bool, batches: list) -> None:
        if self.name == "easgd":  # the center catches up with the replicas: their mean
            final = [sum(self.params(r)[i].detach() for r in range(W)) / W for i in range(len(self.center))]
        elif just_synced:
            final = self.center
        elif self.name == "lsgd":
            final = [p.detach().clone() for p in self.params(self._leader(fresh=True))]
        else:  # a final round over the partial period: new weights from a probe of the trained replicas
            self._grawa_weights(batches)
            final = self._weighted_center()
        for r in range(W):
            self._set(r, final)


REFERENCE_CASES = [
    ("easgd", {"tau": 3, "beta": 0.3, "rho": 0.1}, {"lam": 0.15}),
    ("lsgd", {"tau": 3, "lam": 0.4, "rho": 0.2}, {}),
    (
        "grawa",
        # tau = 5: the fit ends right after a round, when the consensus is the stored center
        {"variant": "model", "tau": 5, "lam": 0.5, "rho": 0.2, "beta": 0.5, "eps": 0.05, "p": 1.0, "probe": "batch"},
        {"norm": "sum"},
    ),
    (
        "grawa",
        {"variant": "layer", "tau": 3, "lam": 0.7, "rho": 0.0, "beta": 0.3, "eps": 0.1, "p": 2.0, "probe": "step"},
        {"norm": "sum"},
    ),
    (
        "grawa",
        {"variant": "model", "tau": 4, "lam": 0.6, "rho": 0.05, "beta": 0.0, "norm": "l2", "probe": "step"},
        {"eps": 1e-8, "p": 1.0},
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "extra"), REFERENCE_CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_fit_matches_the_single_process_reference_and_ends_on_the_center(name, kwargs, extra):
    out = run_workers(_fit_shards, name, kwargs, devices=W)
    opts = {**kwargs, **extra}
    ref = _Reference(name, opts.pop("tau"), opts.pop("lam", 0.0), opts.pop("rho"), **opts).run()
    for o in out:
        torch.testing.assert_close(o["params"], ref, atol=1e-6, rtol=0)
    assert torch.equal(out[0]["params"], out[1]["params"])  # every rank holds the consensus model
    metrics, logged = out[0]["metrics"], out[0]["logged"]
    assert metrics["comm/rounds"] == 10 // kwargs["tau"] and metrics["comm/bytes"] > 0
    assert "avg/consensus_dist" in logged  # reached Lightning's logging, not only last_metrics
    if name == "grawa":
        assert {"grawa/weight/rank0", "grawa/weight/rank1", "grawa/grad_norm/rank1"} <= set(logged)
        if kwargs["variant"] == "layer":
            assert {"grawa/layer_weight_min/rank0", "grawa/layer_weight_max/rank1"} <= set(logged)
    if name == "lsgd":
        assert {"lsgd/leader", "lsgd/loss/rank0", "lsgd/loss/rank1"} <= set(logged)


class _RecordingPull(PullToCenter):
    """A pull schedule (strength grows per round) that records every round it sees."""

    def __init__(self) -> None:
        super().__init__(lam=lambda r: min(1.0, 0.2 + 0.1 * r), log_layer_weights=True)
        self.rounds: list[tuple[int, float]] = []

    def on_round(self, trainer, pl_module, report):
        self.rounds.append((report.step, report.lam))
        return super().on_round(trainer, pl_module, report)


def _fit_with_accumulation(name: str, kwargs: dict) -> dict:
    pull = _RecordingPull()
    module = digits_classifier()
    strategy = STRATEGIES[name](timeout=30, **kwargs)
    t = trainer(strategy=strategy, max_epochs=2, accumulate_grad_batches=2, callbacks=[pull])
    t.fit(module, datamodule=digits(batch_size=32))
    return {"rounds": pull.rounds, "steps": t.global_step, "metrics": dict(strategy.last_metrics)}


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("localsgd", {"tau": 3}), ("easgd", {"tau": 3}), ("lsgd", {"tau": 3}), ("grawa", {"variant": "layer", "tau": 3})],
)
def test_accumulation_keeps_the_cadence_and_the_callback_sets_the_pull(name, kwargs):
    r0, r1 = run_workers(_fit_with_accumulation, name, kwargs, devices=2)
    # 1437 samples / (2 ranks x 32) = 22 micro-batches per epoch -> 11 optimizer steps per epoch
    assert r0["steps"] == 22
    assert [s for s, _ in r0["rounds"]] == [3, 6, 9, 12, 15, 18, 21]
    assert [lam for _, lam in r0["rounds"]] == pytest.approx([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert r0["rounds"] == r1["rounds"]
    if name == "grawa":  # log_layer_weights: every rank's weight of every parameter tensor
        assert {"grawa/layer_weight/rank0/net.0.1.weight", "grawa/layer_weight/rank1/net.1.0.bias"} <= set(
            r0["metrics"]
        )


@pytest.mark.parametrize(("every_round", "expected"), [(True, [(2, 1), (5, 2), (8, 3)]), (False, [(4, 1), (9, 3)])])
def test_rounds_reach_the_loggers_once_each_or_at_lightnings_cadence(every_round, expected, tmp_path):
    def fit() -> None:
        t = trainer(
            strategy=LsgdStrategy(tau=3, timeout=30),
            logger=CSVLogger(str(tmp_path)),
            log_every_n_steps=5,
            callbacks=[PullToCenter(log_every_round=every_round)],
        )
        t.fit(digits_classifier(), datamodule=digits(batch_size=64))  # 11 steps: rounds after 3, 6, 9

    run_workers(fit, devices=2)
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).read_text().splitlines()))
    assert [(int(r["step"]), int(float(r["comm/rounds"]))) for r in rows if r["comm/rounds"]] == expected


class _ParamsAtValidation(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._replica: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        self._replica = flat_params(pl_module)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if batch_idx == 0 and trainer.state.fn == "fit":
            self.seen.append((flat_params(pl_module), self._replica))


def test_validation_during_fit_evaluates_the_consensus_and_training_resumes_on_the_replica():
    def fit() -> dict:
        rec = _ParamsAtValidation()
        module = digits_classifier()
        strategy = GrawaStrategy(variant="layer", tau=5, lam=0.5, timeout=30)
        t = trainer(strategy=strategy, max_epochs=2, callbacks=[rec])
        t.fit(module, datamodule=digits(batch_size=64))  # 11 steps per epoch: validation mid-period
        return {"seen": rec.seen}

    r0, r1 = run_workers(fit, devices=2)
    *during, last = zip(r0["seen"], r1["seen"], strict=True)
    for (c0, x0), (c1, x1) in during:
        assert torch.equal(c0, c1)  # the same center on both ranks
        assert not torch.equal(x0, x1) and not torch.equal(c0, x0)  # while the replicas differ
    # the last epoch's validation comes after the fit's last round: every replica is the center
    (c0, x0), (c1, x1) = last
    assert torch.equal(c0, c1) and torch.equal(x0, c0) and torch.equal(x1, c0)


ACCURACY_RUNS = [
    ("ddp", "ddp", {}),
    ("localsgd", "localsgd", {"tau": 8}),
    ("easgd", "easgd", {}),
    ("lsgd", "lsgd", {}),
    # 22 steps per epoch: GRAWA's default tau = 32 would average once per 1.5 epochs
    ("mgrawa", "grawa", {"variant": "model", "tau": 8}),
    ("lgrawa", "grawa", {"variant": "layer", "tau": 8}),
]


def _accuracies() -> dict[str, float]:
    """Every fit in the same two workers, one after the other (they share the process group)."""
    out = {}
    dm = digits(batch_size=32)
    for label, name, kwargs in ACCURACY_RUNS:
        torch.manual_seed(0)
        module = digits_classifier(hidden=(64,))
        strategy = STRATEGIES[name](timeout=30, **kwargs) if name in STRATEGIES else "ddp"
        t = trainer(strategy=strategy, max_epochs=4, check_val_every_n_epoch=100)
        t.fit(module, datamodule=dm)
        out[label] = float(t.validate(module, datamodule=dm, verbose=False)[0]["val/acc"])
    return out


def test_two_process_fits_reach_the_accuracy_of_ddp_at_equal_epochs():
    accuracies = run_workers(_accuracies, devices=2)[0]
    ddp = accuracies.pop("ddp")
    assert ddp > 0.85
    for name, acc in accuracies.items():
        assert acc >= ddp - 0.01, f"{name}: {acc:.4f} vs DDP {ddp:.4f} ({accuracies})"
