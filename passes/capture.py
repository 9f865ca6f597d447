"""Front end: capture a model as a graph with torch.export (non-strict) and find its FFNs."""
from __future__ import annotations

import inspect
import warnings

import torch
from torch import fx, nn

from moecompile.core.errors import MoECompileError

EXAMPLE_TOKENS = 8


def example_inputs(model: nn.Module) -> tuple[tuple, dict]:
    """Token ids for models with a vocabulary (every HF text model); others must pass their own inputs."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise MoECompileError(f"cannot make example inputs for {type(model).__name__}: pass example_inputs=(...)")
    device = next(model.parameters()).device
    ids = torch.arange(EXAMPLE_TOKENS, device=device).remainder(vocab).unsqueeze(0)
    kwargs = {}
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params:
        kwargs["use_cache"] = False  # a KV cache object would become a graph output
    return (ids,), kwargs


def capture(model: nn.Module, args: tuple | None = None, kwargs: dict | None = None) -> fx.GraphModule:
    """torch.export the model in eval mode; returns the unlifted GraphModule (parameters as get_attr nodes named
    by their fully qualified names, every node carrying nn_module_stack)."""
    if args is None:
        args, default_kwargs = example_inputs(model)
        kwargs = {**default_kwargs, **(kwargs or {})}
    was_training = model.training
    model.eval()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(model, tuple(args), kwargs=kwargs or {}, strict=False)
    except Exception as e:  # noqa: BLE001 - any capture failure is reported as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MoECompileError(f"torch.export could not capture {type(model).__name__}: {first}") from e
    finally:
        model.train(was_training)
    return program.module()


def module_scopes(gm: fx.GraphModule) -> dict[fx.Node, set[str]]:
    """For each call node, the module paths it ran inside (from nn_module_stack)."""
    scopes = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            stack = node.meta.get("nn_module_stack") or {}
            scopes[node] = {path for path, _ in stack.values()}
    return scopes
