"""Helpers of the torch tests: seeded random tensors, and forgetting the hot path's plans."""

import torch

from rope_jit import _plans


def random(*shape, seed, requires_grad=False):
    """A float32 tensor of standard normal values, the same for the same seed everywhere."""
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*shape, generator=generator, dtype=torch.float64)
        .float()
        .requires_grad_(requires_grad)
    )


def fresh_plans(runtime):
    """Forgets this thread's plans of `runtime`: the dict and the last two plans and key (a
    plan left as last_plan would still be served through its guard). Returns the dict."""
    state = _plans._thread_state(runtime)
    state.plans.clear()
    state.last_key = state.last_plan = state.other_plan = None
    return state.plans
