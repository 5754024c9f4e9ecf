"""Single-process reference of fault-tolerant Local SGD: the replicas, rounds and joins of a membership sequence.

The sequence is what a run logged (one replica's ``Membership.events``, read by :func:`rounds_of`):
a round averages over the last world formed before it; a replica that joined after a round's step
starts from the state of that round's lowest member (its model and optimizer state) and trains on
from the next step at the same position of its own shard. A replica killed after
``k`` steps trains steps ``1..k`` only (its work since its last round is lost).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters


def rounds_of(
    events: Sequence[dict[str, object]], tau: int
) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """``(worlds, joins)`` by step: the world of each round whose world changed, the replicas joining after a step.

    An event's ``step`` is Lightning's ``global_step`` when the world changed: ``g`` during the
    round of step ``g + 1``, or after step ``g`` (validation's consensus); either way the change
    applies from the first round after step ``g``. A join is logged after the step it follows.
    """
    worlds: dict[int, tuple[int, ...]] = {}
    joins: dict[int, tuple[int, ...]] = {}
    for event in events:
        if event["point"] == "start" or "undone" in event:
            continue
        point, step = str(event["point"]), int(event["step"])  # type: ignore[call-overload]
        if point.endswith("/admit"):
            joins[step] = tuple(event["joined"])  # type: ignore[arg-type]
        else:
            worlds[(step // tau + 1) * tau] = tuple(event["world"])  # type: ignore[arg-type]
    return worlds, joins


def simulate(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    batches: Callable[[int, int, int], tuple[Tensor, Tensor]],
    replicas: int,
    tau: int,
    steps_per_epoch: int,
    epochs: int,
    events: Sequence[dict[str, object]],
    killed: dict[int, int],
    outer: tuple[float, float] | None = None,
) -> list[nn.Module]:
    """The replicas after training, one per identity (a dead one as it was when it died).

    Args:
        make_model: Builds the (identical) initial model.
        make_optimizer: The optimizer of a model.
        batches: ``(replica, epoch, index) -> (x, y)``, the batch of that replica's shard.
        replicas: How many replicas start.
        tau: Rounds every ``tau`` steps.
        steps_per_epoch: Batches per epoch of each shard.
        epochs: Epochs.
        events: The membership sequence a run logged.
        killed: ``replica -> k``: the replica died after ``k`` steps.
        outer: DiLoCo's ``(outer_lr, outer_momentum)``: a round moves the global model ``S`` by
            Nesterov SGD on the live replicas' mean change ``u = mean (x - S)`` (``M <- mu M + u``,
            ``S <- S + lr (u + mu M)``) and every live replica restarts from ``S``. ``None``: the
            round is the mean of the live replicas.
    """
    models = [make_model() for _ in range(replicas)]
    global_model = [p.detach().clone() for p in models[0].parameters()]  # S (DiLoCo)
    momentum = [torch.zeros_like(p) for p in global_model]
    optimizers = [make_optimizer(m) for m in models]
    worlds, joins = rounds_of(events, tau)
    world = tuple(range(replicas))
    training = set(world)
    for step in range(1, steps_per_epoch * epochs + 1):
        epoch, index = divmod(step - 1, steps_per_epoch)
        for r in sorted(training):
            if r in killed and step > killed[r]:
                training.discard(r)
                continue
            x, y = batches(r, epoch, index)
            optimizers[r].zero_grad()
            nn.functional.cross_entropy(models[r](x), y).backward()
            optimizers[r].step()
        if step % tau == 0:
            world = worlds.get(step, world)
            training &= set(world)
            with torch.no_grad():
                params = [list(models[r].parameters()) for r in world]
                for i, tensors in enumerate(zip(*params, strict=True)):
                    mean = torch.stack(list(tensors)).mean(0)
                    if outer is not None:
                        lr, mu = outer
                        change = mean - global_model[i]
                        momentum[i] = mu * momentum[i] + change
                        global_model[i] = global_model[i] + lr * (change + mu * momentum[i])
                        mean = global_model[i]
                    for t in tensors:
                        t.copy_(mean)
        for joiner in joins.get(step, ()):
            donor = world[0]
            models[joiner] = copy.deepcopy(models[donor])
            optimizers[joiner] = make_optimizer(models[joiner])
            optimizers[joiner].load_state_dict(copy.deepcopy(optimizers[donor].state_dict()))
            killed.pop(joiner, None)
            world = (*world, joiner)
            training.add(joiner)
    return models


def simulate_hpsgd(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    batches: Callable[[int, int, int], tuple[Tensor, Tensor]],
    replicas: int,
    window: int,
    steps_per_epoch: int,
    epochs: int,
    leaves: dict[int, tuple[int, ...]],
    joins: dict[int, tuple[int, ...]],
    killed: dict[int, int],
) -> Tensor:
    """The model after fault-tolerant HPSGD (merge='eager', outer step 1, no compression), as a flat vector.

    Written from HPSGD's recurrence (Zhou et al., arXiv 2009.02701, with the eager merge): each
    replica keeps ``x``, its window start ``V`` and its optimizer; the global model ``S`` advances
    by the in-flight sum ``F`` over its count ``n``. A window launches at step 1 and every
    ``window`` steps after; at a merge: ``d = x - V``; ``S += F / n``; ``x = S + d``; ``V = x``;
    launch ``d``. The fault-tolerance rules:

    - ``leaves[s]``: the world of the merge at step ``s`` is these replicas; the window in flight
      is summed again among them (each one's own change as it sent it), ``n = |survivors|``;
    - ``joins[s]``: after step ``s`` the window just launched is finished among its members, and
      each joiner takes the state of the lowest member (``x``, ``V``, ``S``, ``F``, ``n``, optimizer);
    - ``killed[r] = k``: replica ``r`` trained steps ``1..k`` only.
    At the end (a partial window), the in-flight window merges and the steps since it are summed
    and merged at once; the result is ``S``.
    """
    models = [make_model() for _ in range(replicas)]
    optimizers = [make_optimizer(m) for m in models]

    def flat(r: int) -> Tensor:
        return parameters_to_vector(models[r].parameters()).detach().clone()

    def load(r: int, vector: Tensor) -> None:
        vector_to_parameters(vector.clone(), models[r].parameters())

    world = list(range(replicas))
    S = flat(0)
    V: dict[int, Tensor] = {}
    sent: dict[int, Tensor] = {}
    F, n, launch_world, settled = torch.zeros_like(S), 1, list(world), False
    total = steps_per_epoch * epochs
    since = 0
    for step in range(1, total + 1):
        epoch, index = divmod(step - 1, steps_per_epoch)
        for r in list(world):
            if r in killed and step > killed[r]:
                continue
            x, y = batches(r, epoch, index)
            optimizers[r].zero_grad()
            nn.functional.cross_entropy(models[r](x), y).backward()
            optimizers[r].step()
        since += 1
        if step == 1:
            for r in world:
                sent[r] = flat(r) - S
                V[r] = flat(r)
            F, n, launch_world, since = sum(sent[r] for r in world), len(world), list(world), 0
        elif since == window:
            if step in leaves:
                world = list(leaves[step])
            if world != launch_world and not settled:  # a replica was lost while its window was in flight
                F, n = sum(sent[r] for r in world), len(world)
            S = S + F / n
            for r in world:
                d = flat(r) - V[r]
                load(r, S + d)
                V[r] = flat(r)
                sent[r] = d
            F, n, launch_world, since = sum(sent[r] for r in world), len(world), list(world), 0
            settled = False
        for joiner in joins.get(step, ()):
            donor = world[0]
            load(joiner, flat(donor))
            V[joiner] = V[donor].clone()
            optimizers[joiner] = make_optimizer(models[joiner])
            optimizers[joiner].load_state_dict(copy.deepcopy(optimizers[donor].state_dict()))
            killed.pop(joiner, None)
            world.append(joiner)
            settled = True  # the window in flight was finished among its members before the join
    S = S + F / n
    if since:
        S = S + sum(flat(r) - V[r] for r in world) / len(world)
    return S
