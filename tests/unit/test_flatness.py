"""Flatness measures against the explicit Hessian of a tiny network."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

from lightning_hier.algorithms.flatness import (
    exact_trace,
    hessian_vector_products,
    hutchinson_trace,
    top_eigenvalue,
)


def _tiny() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    batches = [(torch.randn(6, 3, dtype=torch.float64), torch.randint(0, 3, (6,))) for _ in range(2)]
    return net, batches


def _loss(net: nn.Module):
    return lambda batch: nn.functional.cross_entropy(net(batch[0]), batch[1])


def _explicit_hessian(net: nn.Module, batches) -> torch.Tensor:
    """The P x P Hessian of the mean loss over the batches, by torch.autograd.functional.hessian."""
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def mean_loss(x: torch.Tensor) -> torch.Tensor:
        parts, start = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            parts[name] = x[start : start + shape.numel()].reshape(shape)
            start += shape.numel()
        losses = [nn.functional.cross_entropy(functional_call(net, parts, (b[0],)), b[1]) for b in batches]
        return torch.stack(losses).mean()

    return torch.autograd.functional.hessian(mean_loss, flat)


def test_hessian_vector_products_equal_the_explicit_hessian_times_v():
    net, batches = _tiny()
    hessian = _explicit_hessian(net, batches)
    params = list(net.parameters())
    v = [torch.randn_like(p) for p in params]
    (hv,) = hessian_vector_products(params, _loss(net), batches, [v])
    expected = hessian @ torch.cat([t.reshape(-1) for t in v])
    torch.testing.assert_close(torch.cat([t.reshape(-1) for t in hv]), expected, rtol=1e-10, atol=1e-12)


def test_trace_with_every_basis_vector_is_exact_and_leaves_grads_alone():
    net, batches = _tiny()
    params = list(net.parameters())
    params[0].grad = torch.full_like(params[0], 5.0)  # an optimizer's gradient must survive the measurement
    trace = exact_trace(params, _loss(net), batches)
    assert trace == pytest.approx(float(torch.trace(_explicit_hessian(net, batches))), rel=1e-10)
    assert torch.equal(params[0].grad, torch.full_like(params[0], 5.0)) and params[1].grad is None


def test_hutchinson_estimate_is_within_its_error_and_repeatable():
    net, batches = _tiny()
    params = list(net.parameters())
    true_trace = float(torch.trace(_explicit_hessian(net, batches)))
    estimate = hutchinson_trace(params, _loss(net), batches, probes=64, seed=1)
    assert len(estimate.samples) == 64 and estimate.stderr > 0
    # a fixed seed makes this deterministic; 4 standard errors leaves no room for a biased estimator
    assert abs(estimate.trace - true_trace) <= 4 * estimate.stderr
    assert hutchinson_trace(params, _loss(net), batches, probes=64, seed=1).samples == estimate.samples


def test_power_iteration_finds_the_eigenvalue_of_largest_magnitude():
    net, batches = _tiny()
    eigenvalues = torch.linalg.eigvalsh(_explicit_hessian(net, batches))
    top = float(eigenvalues[eigenvalues.abs().argmax()])
    found = top_eigenvalue(list(net.parameters()), _loss(net), batches, max_iterations=2000, tol=1e-12, seed=0)
    assert found.converged
    assert found.eigenvalue == pytest.approx(top, rel=1e-6)
    assert len(found.vector) == len(list(net.parameters()))


def test_measures_reject_empty_input():
    net, batches = _tiny()
    with pytest.raises(ValueError, match="`batches` is empty"):
        hutchinson_trace(list(net.parameters()), _loss(net), [], probes=1)
    with pytest.raises(ValueError, match="`probes` must be >= 1, got 0"):
        hutchinson_trace(list(net.parameters()), _loss(net), batches, probes=0)
    with pytest.raises(ValueError, match="max_iterations >= 1"):
        top_eigenvalue(list(net.parameters()), _loss(net), batches, max_iterations=0)
